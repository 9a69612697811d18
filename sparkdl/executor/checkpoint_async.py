"""The training loop's side of checkpoints: what to save, written in the background, recorded once complete.

A save serialises this rank's state into memory on the training thread (tensors, nested optimizer
state and history: the bytes are the copy training cannot mutate) and hands the write to one
background thread; training continues. At the next save (or `finish()`, after the last epoch) every rank waits for its
write, and the ranks agree in one allgather whether every write of that step succeeded; rank 0 then
records the step in the manifest (executor/checkpoint.py), in the background too, with every
rank's part checksum (taken by the writer as it wrote). Collectives happen
only here, on the training thread, at the same points on every rank (saves fall due at the same
global steps everywhere); the background thread does file I/O only.

Pruning follows the manifest: the steps a new manifest drops are deleted (each rank its own files,
rank 0 the directories) only once rank 0 has reported that manifest durable, at the next agreement,
so a crash between the two never leaves a manifest naming deleted files. A step is thus loadable
one save after it was taken: a killed attempt redoes at most two intervals (`checkpoint_every`).
"""
from __future__ import annotations

import copy
import queue
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from sparkdl.errors import CheckpointError
from sparkdl.executor.checkpoint import CheckpointStore, Manifest, Position, StepRecord

# Test seam: called by the writer thread between the pieces of a part's write, with (step, bytes
# written so far), while the part exists only under its temporary name. None outside tests.
WRITE_HOOK: Callable[[int, int], None] | None = None
ABANDON_WAIT_S = 30.0  # a failing attempt lets a queued manifest write land, not a hung store block it


def serialize(state: dict[str, Any]) -> memoryview:
    """The checkpoint part's bytes (torch.save: tensors, nested optimizer state, plain values)."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getbuffer()


def snapshot(value: Any) -> Any:
    """A deep copy whose tensors are detached CPU copies (training mutates the live ones in place)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, (dict, OrderedDict)):
        kind = OrderedDict if isinstance(value, OrderedDict) else dict
        return kind((key, snapshot(item)) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(snapshot(item) for item in value) if type(value) in (list, tuple) else copy.deepcopy(value)
    return copy.deepcopy(value)


class _Job:
    def __init__(self, work: Callable[[], Any]) -> None:
        self.work, self.done, self.seconds = work, threading.Event(), 0.0
        self.error: BaseException | None = None
        self.result: Any = None  # what the work returned (a part's write: its checksum)


class BackgroundWriter:
    """One daemon thread running file jobs in the order given (a daemon: a store that hangs never
    keeps a finished Python worker from exiting)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        _WRITERS.add(self)

    def submit(self, work: Callable[[], Any]) -> _Job:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="sparkdl-checkpoint-writer", daemon=True)
            self._thread.start()
        job = _Job(work)
        self._jobs.put(job)
        return job

    def close(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            started = time.perf_counter()
            try:
                job.result = job.work()
            except BaseException as exc:  # noqa: BLE001 - reported to every rank at the next agreement
                job.error = exc
            job.work = _done  # the job's closure holds the state copy: freed now, not at the next save
            job.seconds = time.perf_counter() - started
            job.done.set()


def _done() -> None:
    pass


_WRITERS: "weakref.WeakSet[BackgroundWriter]" = weakref.WeakSet()


def wait_idle(timeout: float) -> None:
    """Until every job queued so far in this process has run (a test seam: a fault injected after
    it finds the previous save's manifest durable, so where a run resumes is deterministic)."""
    for writer in list(_WRITERS):
        if writer._thread is not None:
            writer.submit(_done).done.wait(timeout)


@dataclass
class CheckpointTimings:
    """Seconds this rank spent on checkpoints since the last `take()`."""

    saves: int = 0
    stall_s: float = 0.0  # on the training thread: copying the state, waiting for the last write, agreeing
    write_s: float = 0.0  # in the background: serialising and writing (what a synchronous save stalls for)

    def take(self) -> dict[str, float]:
        figures = {"checkpoint_saves": float(self.saves), "checkpoint_stall_s": self.stall_s,
                   "checkpoint_write_s": self.write_s}
        self.saves, self.stall_s, self.write_s = 0, 0.0, 0.0
        return figures


@dataclass
class _Pending:
    step: int
    job: _Job
    has_strategy: bool


class RunCheckpoints:
    """When to save, what to save, and the agreement that makes a saved step complete.

    Each rank saves its position, its RNG state, its part of the epoch's running sums (and rank 0
    the history so far); the strategy's state is saved by every rank, or only by rank 0 when all
    ranks hold the same (data parallel with allreduce)."""

    def __init__(self, store: CheckpointStore, comm: Any, strategy: Any, every: int, timeout_s: float = 600.0) -> None:
        self.store, self.comm, self.strategy, self.every = store, comm, strategy, every
        self.timeout_s = timeout_s  # a write (or manifest) not done by then fails the run: a hung store must not hang it
        self.timings = CheckpointTimings()
        self._manifest = store.manifest or Manifest(comm.size)
        self._writer = BackgroundWriter()
        self._pending: _Pending | None = None
        self._manifest_job: _Job | None = None  # rank 0: the manifest write queued at the last agreement
        self._unconfirmed = False  # a manifest was queued and not yet reported durable (known to all ranks)
        self._dropped: list[int] = []  # steps that manifest drops: deleted once it is durable

    def due(self, global_step: int) -> bool:
        return self.every > 0 and global_step % self.every == 0

    def save(self, position: Position, progress: dict[str, Any]) -> None:
        """Record the previous save if complete, then write this one in the background."""
        import torch

        started = time.perf_counter()
        self._agree()  # first: the previous write's bytes are freed before this state is copied
        state: dict[str, Any] = {"position": [position.epoch, position.step, position.global_step],
                                 "progress": progress, "rng": torch.get_rng_state()}
        has_strategy = self.comm.rank == 0 or not self.strategy.replicated_state
        if has_strategy:
            state["strategy"] = self.strategy.checkpoint_state()
        # Serialised here, on the training thread: the bytes are the copy training cannot mutate, and
        # the writer is left with write() and fsync(), which release the GIL. A writer that pickles
        # holds the GIL in bursts, and the training thread, which drops it at every torch op, waits up
        # to a switch interval each time to get it back (measured: +10% step time at every 10 steps).
        payload = serialize(state)
        del state
        step = position.global_step
        job = self._writer.submit(lambda: self.store.write_part(step, payload, _hook(step)))
        self._pending = _Pending(step, job, has_strategy)
        self.timings.saves += 1
        self.timings.stall_s += time.perf_counter() - started

    def finish(self) -> None:
        """After the last epoch (every rank, early stopping included): the last save recorded, its
        manifest durable, what it drops deleted, the writer thread ended."""
        started = time.perf_counter()
        self._agree()
        if self._unconfirmed:
            error = self._error_of(self._manifest_job, self.timeout_s) if self._manifest_job is not None else None
            self._manifest_job = None
            _raise_failures([{"manifest_error": e} for e in self.comm.allgather_object(error)])
            self.store.delete_steps(self._dropped)
            self._dropped, self._unconfirmed = [], False
        self._writer.close()
        self.timings.stall_s += time.perf_counter() - started

    def abandon(self) -> None:
        """Training failed: no collectives (peers may be gone); queued writes may still land (a
        manifest among them), bounded so a hung store cannot hold the failure back."""
        self._writer.close(timeout=ABANDON_WAIT_S)

    def _agree(self) -> None:
        pending, self._pending = self._pending, None
        report: dict[str, Any] = {"step": None, "error": None, "strategy": False, "manifest_error": None,
                                  "checksum": None}
        if pending is not None:
            report.update(step=pending.step, error=self._error_of(pending.job, self.timeout_s),
                          strategy=pending.has_strategy)
            if isinstance(pending.job.result, str):
                report["checksum"] = pending.job.result
            self.timings.write_s += pending.job.seconds
        if self._manifest_job is not None:  # queued before the write above: done by now
            report["manifest_error"] = self._error_of(self._manifest_job, self.timeout_s)
            self._manifest_job = None
        gathered = self.comm.allgather_object(report)
        _raise_failures(gathered)
        if self._unconfirmed and self._dropped:  # rank 0 reported the manifest dropping them durable
            dropped, self._dropped = self._dropped, []
            self._writer.submit(lambda: self.store.delete_steps(dropped))
        self._unconfirmed = pending is not None
        if pending is not None:
            record = StepRecord(pending.step, tuple(range(len(gathered))),
                                tuple(rank for rank, seen in enumerate(gathered) if seen["strategy"]), len(gathered),
                                _checksums(gathered))
            self._manifest, dropped_now = self._manifest.with_step(record, self.store.keep)
            self._dropped += dropped_now
            if self.comm.rank == 0:
                manifest = self._manifest
                self._manifest_job = self._writer.submit(lambda: self.store.write_manifest(manifest))

    @staticmethod
    def _error_of(job: _Job, timeout_s: float) -> str | None:
        if not job.done.wait(timeout_s):
            return f"TimeoutError: not written within launch.timeout_s={timeout_s:g} s"
        return None if job.error is None else f"{type(job.error).__name__}: {job.error}"


def _hook(step: int) -> Callable[[int], None] | None:
    hook = WRITE_HOOK
    return None if hook is None else (lambda written: hook(step, written))


def _checksums(gathered: list[dict[str, Any]]) -> tuple[str, ...]:
    """Every rank's part checksum for the manifest; none at all unless every rank has one (a
    step without checksums is read as before checksums)."""
    sums = tuple(seen.get("checksum") for seen in gathered)
    return sums if all(isinstance(s, str) for s in sums) else ()  # type: ignore[return-value]


def _raise_failures(gathered: list[dict[str, Any]]) -> None:
    """The same CheckpointError on every rank when any rank's write (or rank 0's manifest) failed:
    every rank sees the same reports, so all stop together instead of waiting on a failed peer."""
    steps = {seen.get("step") for seen in gathered}
    if len(steps) > 1:
        raise CheckpointError(f"ranks disagree on the checkpoint being completed: steps {sorted(map(str, steps))}",
                              hint="this is a bug in sparkdl: please report it with the run's logs")
    for rank, seen in enumerate(gathered):
        for key, what in (("error", f"rank {rank}'s part of step {seen.get('step')}"), ("manifest_error", "the manifest")):
            if seen.get(key):
                raise CheckpointError(f"writing the checkpoint failed: {what}: {seen[key]}",
                                      hint="check that checkpoint_dir is writable from every executor and has "
                                           "space; the checkpoints recorded before are intact")
