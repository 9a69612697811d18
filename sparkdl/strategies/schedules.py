"""Micro-batch schedules of a K-stage pipeline: the order in which one stage runs its forward (F)
and backward (B) passes. Pure functions, so the orders are unit-tested without torch.

GPipe: all m forwards, then all m backwards (last micro-batch first); m micro-batches of activations
are held at once. 1F1B (PipeDream-flush / DAPPLE): stage k runs K-k-1 warm-up forwards, then
alternates one forward with one backward, then drains; at most K-k micro-batches are in flight.
Both take (m + K - 1) slots of a balanced stage's time per step. With asynchronous sends and
blocking receives neither order can deadlock: every receive waits on a send its peer issues
earlier in its own order.
"""
from __future__ import annotations

from typing import Callable

Op = tuple[str, int]  # ("F" | "B", micro-batch index)


def gpipe(stage: int, stages: int, microbatches: int) -> list[Op]:
    _check(stage, stages, microbatches)
    return [("F", i) for i in range(microbatches)] + [("B", i) for i in reversed(range(microbatches))]


def one_f_one_b(stage: int, stages: int, microbatches: int) -> list[Op]:
    _check(stage, stages, microbatches)
    warmup = min(stages - stage - 1, microbatches)
    ops: list[Op] = [("F", i) for i in range(warmup)]
    for i in range(microbatches - warmup):
        ops += [("F", warmup + i), ("B", i)]
    ops += [("B", i) for i in range(microbatches - warmup, microbatches)]
    return ops


SCHEDULES: dict[str, Callable[[int, int, int], list[Op]]] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def max_in_flight(ops: list[Op]) -> int:
    """Micro-batches whose activations are held at once (forward done, backward not yet)."""
    live = peak = 0
    for kind, _ in ops:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def _check(stage: int, stages: int, microbatches: int) -> None:
    if not (0 <= stage < stages and microbatches >= 1):
        raise ValueError(f"no schedule for stage {stage} of {stages} with {microbatches} micro-batches")
