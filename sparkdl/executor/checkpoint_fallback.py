"""Resuming from the newest checkpoint every rank can read, agreed by all ranks.

A part can be damaged after it was recorded complete: truncated by a full disk or an interrupted
copy, a flipped bit, a file removed, a manifest entry edited by hand. keep_checkpoints keeps older
complete steps for exactly this, so a damaged latest step is no reason to end the run. Each rank
tries to load what it needs of a step (its own part, and the strategy state's part), checksums
checked (executor/checkpoint_verify.py); the ranks then gather every rank's verdict, so one rank's
bad part sends all of them back to the same older step together (a rank that fell back alone would
train a different model, or wait forever in the next collective). The fall-back is said in rank 0's
log, in the resumed epoch's history record and, through the driver's monitor, in the MLflow run
(a tag and a text artifact): a run that silently lost steps would look like a slow one.

Damage and a failed read are told apart: only damage is a reason to fall back. Damage is what the
bytes or the record say: a checksum or manifest entry that does not match (CheckpointError), a part
that is not there (FileNotFoundError), bytes torch.load cannot decode. Any other OSError is the
storage failing to answer (pyarrow raises a plain OSError for an S3 503, a dropped connection, a
timeout, access denied, a directory where a file should be): the step may be perfectly good, so
no rank falls back past it. Every rank raises the same TransientCheckpointError instead, nothing
moved or deleted, and the driver retries the attempt (executor/failures.py reports it retryable).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from sparkdl.errors import CheckpointError, SparkdlError
from sparkdl.executor.checkpoint_report import HISTORY_FROM, HISTORY_REASON
from sparkdl.storage import files as storage

__all__ = ["HISTORY_FROM", "HISTORY_REASON", "Skipped", "TransientCheckpointError", "fallback_fields",
           "fallback_line", "first_readable", "is_transient", "record_without_damaged", "set_aside",
           "transient_error"]
ASIDE = "damaged-"  # a skipped step's directory, moved aside: damaged-step-<9 digits>[.<n>]
_REASON_CHARS = 400  # one rank's reason, in the history and the tag: a torch error can be long


class TransientCheckpointError(CheckpointError):
    """Checkpoint files the storage did not let a rank read (not damage): retrying the attempt may
    read them; nothing was skipped, moved or deleted."""

    retryable = True  # executor/failures.py tells the driver: the attempt is worth another try

    def __init__(self, message: str) -> None:
        super().__init__(message, hint="the storage refused or did not answer the read (a timeout, a dropped "
                                       "connection, permissions): nothing was deleted and sparkdl retries the "
                                       "attempt; if it persists, check that checkpoint_dir is readable from "
                                       "every executor")


def is_transient(exc: BaseException) -> bool:
    """Whether a failure to load a step says nothing about its files (see the module's docstring)."""
    return isinstance(exc, TransientCheckpointError) or (
        isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError))


def transient_error(path: str, exc: BaseException) -> TransientCheckpointError:
    return TransientCheckpointError(f"cannot read {path!r}: {_one_line(exc)}")


@dataclass(frozen=True)
class Skipped:
    """A step resuming could not use, and why (every rank's problem with it)."""

    step: int | None  # None: a damaged manifest entry whose step number is unknown
    reason: str


def first_readable(comm: Any, candidates: Sequence[Any], load: Callable[[Any], Any],
                   where: str) -> tuple[Any, Any, tuple[Skipped, ...]]:
    """(the newest candidate every rank loaded, what `load` gave for it on this rank, what was
    skipped before it). `candidates` are newest first: step records (with `.step`), and Skipped
    entries (damaged manifest entries, the same on every rank: they parsed the same text). A
    collective, one allgather per record tried; the same CheckpointError on every rank when none
    can be read."""
    skipped: list[Skipped] = []
    for candidate in candidates:
        if isinstance(candidate, Skipped):
            skipped.append(candidate)
            continue
        loaded, problem = None, None
        try:
            loaded = load(candidate)
        except Exception as exc:  # noqa: BLE001 - the ranks agree below on what it means
            problem = ("transient" if is_transient(exc) else "damaged", _one_line(exc))
        verdicts = comm.allgather_object(problem)
        failed = [(rank, seen) for rank, seen in enumerate(verdicts) if seen is not None]
        if not failed:
            return candidate, loaded, tuple(skipped)
        del loaded  # one step's state in memory at a time
        said = "; ".join(f"rank {rank}: {text}" for rank, (_, text) in failed)
        if any(kind == "transient" for _, (kind, _) in failed):  # the step may be good: never skip it
            raise TransientCheckpointError(
                f"cannot read the checkpoint of step {candidate.step} under {where!r} now: {said}; "
                f"no step was skipped or deleted")
        skipped.append(Skipped(int(candidate.step), f"step {candidate.step}: {said}"))
    raise CheckpointError(
        f"no complete checkpoint under {where!r} can be read: " + "; ".join(s.reason for s in skipped),
        hint="the checkpoint files were damaged or removed after they were written: restore them, or start a "
             "fresh run (another checkpoint_dir, or remove that directory); keep_checkpoints > 1 keeps older "
             "steps to fall back to")


def record_without_damaged(store: Any, comm: Any) -> None:
    """Rank 0 writes the agreed manifest (`store.manifest`, without the damaged steps) before any
    is moved aside, and every rank learns whether it did: a failure is the same retryable error
    everywhere. A collective."""
    error = None
    if comm.rank == 0:
        try:
            store.write_manifest(store.manifest)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            error = _one_line(exc)
    error = comm.allgather_object(error)[0]
    if error is not None:
        raise TransientCheckpointError(f"cannot record the checkpoint manifest under {store.root.path!r} without "
                                       f"the damaged steps: {error}; nothing was moved or deleted")


def set_aside(store: Any, steps: Sequence[int]) -> list[str]:
    """Moves `steps`' directories to damaged-step-<n> names, never loaded nor pruned; the names
    used. Local directories: every rank moves what it sees (a host-local path is each rank's own;
    on a shared one the first rename wins, the others find nothing). Object stores: rank 0 moves
    the objects. Best effort: a step left in place is unlisted, so no resume loads it."""
    import pyarrow.fs as pafs

    moved = []
    for step in steps:
        source = store.step_dir(step)
        try:
            if not (source.local or store.rank == 0) or not storage.is_dir(source):
                continue
            target = _free_name(store.root.child(ASIDE + source.name))
            if source.local:
                source.fs.move(source.path, target.path)  # one rename of the directory
            else:
                prefix = len(source.path.rstrip("/"))
                source.fs.create_dir(target.path, recursive=True)  # a no-op on most object stores
                for info in source.fs.get_file_info(pafs.FileSelector(source.path, recursive=True)):
                    if info.type == pafs.FileType.File:
                        source.fs.move(info.path, target.path + info.path[prefix:])
                storage.delete_tree(source)
            moved.append(target.path)
        except OSError:
            pass  # another rank moved it first (shared storage), or the store refused: left unlisted
    return moved


def _free_name(base: storage.Location) -> storage.Location:
    target, count = base, 1
    while storage.exists(target):  # the same step skipped by an earlier attempt
        count += 1
        target = _sibling(base, f"{base.name}.{count}")
    return target


def _sibling(where: storage.Location, name: str) -> storage.Location:
    return storage.Location(where.fs, where.path[: len(where.path) - len(where.name)] + name, where.local)


def fallback_fields(skipped: Sequence[Skipped]) -> dict[str, Any]:
    """The resumed epoch's history fields naming the fall-back (none when nothing was skipped)."""
    if not skipped:
        return {}
    steps = [s.step for s in skipped if s.step is not None]
    return {HISTORY_FROM: max(steps) if steps else None, HISTORY_REASON: "; ".join(s.reason for s in skipped)}


def fallback_line(skipped: Sequence[Skipped], where: str, resumed: int) -> str:
    """Rank 0's log line when resuming skipped damaged steps."""
    return (f"sparkdl: the newest checkpoint under {where!r} cannot be read ("
            + "; ".join(s.reason for s in skipped)
            + f"); every rank resumes from step {resumed}, the newest complete one all ranks read")


def _one_line(exc: BaseException) -> str:
    text = exc.message if isinstance(exc, SparkdlError) else str(exc)
    text = text.strip().splitlines()[0] if text.strip() else ""
    name = "" if isinstance(exc, SparkdlError) else f"{type(exc).__name__}: "
    text = name + text
    return text if len(text) <= _REASON_CHARS else text[:_REASON_CHARS - 3] + "..."
