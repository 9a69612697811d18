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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from sparkdl.errors import CheckpointError, SparkdlError
from sparkdl.executor.checkpoint_report import HISTORY_FROM, HISTORY_REASON

__all__ = ["HISTORY_FROM", "HISTORY_REASON", "Skipped", "fallback_fields", "fallback_line", "first_readable"]
_REASON_CHARS = 400  # one rank's reason, in the history and the tag: a torch error can be long


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
        except Exception as exc:  # noqa: BLE001 - any failure makes the step unusable: the ranks agree below
            problem = _one_line(exc)
        failed = [(rank, seen) for rank, seen in enumerate(comm.allgather_object(problem)) if seen is not None]
        if not failed:
            return candidate, loaded, tuple(skipped)
        del loaded  # one step's state in memory at a time
        skipped.append(Skipped(int(candidate.step), f"step {candidate.step}: "
                                                    + "; ".join(f"rank {rank}: {seen}" for rank, seen in failed)))
    raise CheckpointError(
        f"no complete checkpoint under {where!r} can be read: " + "; ".join(s.reason for s in skipped),
        hint="the checkpoint files were damaged or removed after they were written: restore them, or start a "
             "fresh run (another checkpoint_dir, or remove that directory); keep_checkpoints > 1 keeps older "
             "steps to fall back to")


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
