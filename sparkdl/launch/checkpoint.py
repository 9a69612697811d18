"""Checkpoints of a training run, so a retried barrier stage resumes instead of starting over.

Layout under `train.checkpoint_dir` (a local path or any pyarrow filesystem URI):
    <dir>/<run id>/step-<global step, 9 digits>/rank-<r>.pt   one file per rank that holds state
    <dir>/<run id>/step-<global step, 9 digits>/COMPLETE      written by rank 0 after all ranks wrote
Every file is written to a temporary name, flushed (fsync on local disks) and renamed, so a rank
killed mid-write leaves at most a stray temporary file; a step directory without COMPLETE is never
loaded. Files hold only tensors and plain Python values and are read with
torch.load(weights_only=True): loading a checkpoint cannot run code. The run id is the same for
every attempt of one fit (Spark retries the stage with the same closure), so an attempt finds what
the previous one wrote; the last `keep_checkpoints` complete steps are kept.
"""
from __future__ import annotations

import io
import os
import uuid
from dataclasses import dataclass
from typing import Any

COMPLETE = "COMPLETE"


@dataclass(frozen=True)
class Position:
    """Where a run stands: the next step to train is step `step` of epoch `epoch`."""

    epoch: int
    step: int
    global_step: int


class CheckpointStore:
    """Per-rank checkpoint files of one run on a pyarrow filesystem (local disks included)."""

    def __init__(self, uri: str, run_id: str, rank: int, keep: int = 2) -> None:
        import pyarrow.fs as pafs

        self._fs, root = pafs.FileSystem.from_uri(uri if "://" in uri else os.path.abspath(uri))
        self._local = isinstance(self._fs, pafs.LocalFileSystem)
        self.root = f"{root.rstrip('/')}/{run_id}"
        self.rank = rank
        self.keep = max(1, keep)

    # -- writing ------------------------------------------------------------------------------
    def write_rank(self, global_step: int, state: dict[str, Any]) -> None:
        """This rank's state for `global_step`, atomically."""
        import torch

        buffer = io.BytesIO()
        torch.save(state, buffer)
        self._atomic_write(f"{self._step_dir(global_step)}/rank-{self.rank}.pt", buffer.getvalue())

    def mark_complete(self, global_step: int) -> None:
        """Rank 0, after every rank has written: the step becomes loadable; older ones beyond keep go."""
        self._atomic_write(f"{self._step_dir(global_step)}/{COMPLETE}", b"ok\n")
        for old in self.complete_steps()[:-self.keep]:
            self._fs.delete_dir(self._step_dir(old))

    # -- reading ------------------------------------------------------------------------------
    def complete_steps(self) -> list[int]:
        import pyarrow.fs as pafs

        info = self._fs.get_file_info(self.root)
        if info.type != pafs.FileType.Directory:
            return []
        steps = []
        for entry in self._fs.get_file_info(pafs.FileSelector(self.root)):
            name = entry.base_name
            if entry.type == pafs.FileType.Directory and name.startswith("step-") and name[5:].isdigit():
                marker = self._fs.get_file_info(f"{entry.path}/{COMPLETE}")
                if marker.type == pafs.FileType.File:
                    steps.append(int(name[5:]))
        return sorted(steps)

    def latest(self) -> int | None:
        steps = self.complete_steps()
        return steps[-1] if steps else None

    def read_rank(self, global_step: int, rank: int) -> dict[str, Any]:
        import torch

        with self._fs.open_input_stream(f"{self._step_dir(global_step)}/rank-{rank}.pt") as stream:
            data = stream.read()
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)

    # -- helpers ------------------------------------------------------------------------------
    def _step_dir(self, global_step: int) -> str:
        return f"{self.root}/step-{global_step:09d}"

    def _atomic_write(self, path: str, data: bytes) -> None:
        directory = path.rsplit("/", 1)[0]
        self._fs.create_dir(directory, recursive=True)
        temporary = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        if self._local:
            with open(temporary, "wb") as stream:
                stream.write(data)
                stream.flush()
                os.fsync(stream.fileno())
            os.replace(temporary, path)
            fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(fd)  # the rename itself survives a crash of the machine
            finally:
                os.close(fd)
            return
        with self._fs.open_output_stream(temporary) as stream:
            stream.write(data)
        self._fs.move(temporary, path)


@dataclass(frozen=True)
class Resume:
    """Where a retried attempt picks up: the latest complete checkpoint as this rank saved it.
    Read before the strategy exists (the batch shares the run started with decide how the context
    is built); applied to the strategy once it is set up."""

    position: Position
    progress: dict[str, Any]  # this rank's running sums, rank 0's history, the batch shares
    strategy_state: dict[str, Any]
    rng: Any  # torch's CPU generator state

    def apply(self, strategy: Any) -> None:
        import torch

        strategy.load_checkpoint_state(self.strategy_state)
        torch.set_rng_state(self.rng)


def open_store(spec: Any, rank: int) -> CheckpointStore | None:
    """This rank's checkpoint store for the run, or None when the run keeps no checkpoints."""
    train = spec.config.train
    if not train.checkpoint_dir:
        return None
    return CheckpointStore(train.checkpoint_dir, spec.run_id, rank, train.keep_checkpoints)


def find_resume(store: CheckpointStore, comm: Any) -> Resume | None:
    """The latest complete checkpoint, or None when the run has none (a first attempt). One verdict
    for all ranks, from rank 0's view of the store (a collective: every rank calls it)."""
    latest = comm.allgather_object(store.latest() if comm.rank == 0 else None)[0]
    if latest is None:
        return None
    own = store.read_rank(latest, comm.rank)
    training = own.get("strategy")
    if training is None:  # replicated: rank 0 saved it for everyone
        training = store.read_rank(latest, 0)["strategy"]
    epoch, step, global_step = own["position"]
    return Resume(Position(int(epoch), int(step), int(global_step)), dict(own["progress"]), training, own["rng"])


class RunCheckpoints:
    """The training loop's side: when to save and what to save.

    Each rank saves its position, its RNG state, its part of the epoch's running sums (and rank 0
    the history so far); the strategy's state is saved by every rank, or only by rank 0 when all
    ranks hold the same (data parallel with allreduce). A save is complete once every rank has
    written and rank 0 has marked it: one barrier per save."""

    def __init__(self, store: CheckpointStore, comm: Any, strategy: Any, every: int) -> None:
        self.store, self.comm, self.strategy, self.every = store, comm, strategy, every

    def due(self, global_step: int) -> bool:
        return self.every > 0 and global_step % self.every == 0

    def save(self, position: Position, progress: dict[str, Any]) -> None:
        import torch

        state: dict[str, Any] = {"position": [position.epoch, position.step, position.global_step],
                                 "progress": progress, "rng": torch.get_rng_state()}
        if self.comm.rank == 0 or not self.strategy.replicated_state:
            state["strategy"] = self.strategy.checkpoint_state()
        self.store.write_rank(position.global_step, state)
        self.comm.barrier()  # every rank has written: the step may be marked complete
        if self.comm.rank == 0:
            self.store.mark_complete(position.global_step)
