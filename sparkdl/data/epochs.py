"""How many steps an epoch has and how many rows each rank's steps hold: the one home of that rule.

Collectives hang when ranks disagree on the step count, so every rank runs the same number of steps,
sized by the largest shard (smaller shards wrap around their rows); without drop_last the largest
shard sees each row once and the last step holds its remainder. With batches shared by rank speed
(executor/balance.py) every step holds each rank's full share and the epoch covers all rows once over
all ranks. Config validation, the planner, the worker's shard check, `WorkerContext.steps_per_epoch`
and the spool's batches all ask `epoch_plan`; config validation shares its batch-size check
(config_values.check_batch_size). Standard library only (and sparkdl.errors, config_values).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

from sparkdl.config.values import check_batch_size
from sparkdl.errors import EmptyDataError

__all__ = ["Accumulation", "BatchOptions", "EpochPlan", "accumulation", "check_batch_size", "check_shards",
           "epoch_plan", "expected_row_counts", "optimizer_steps"]

if TYPE_CHECKING:
    from sparkdl.config import DataConfig


class _HasBatchOptions(Protocol):
    batch_size: int
    drop_last: bool


@dataclass(frozen=True)
class BatchOptions:
    """The two options the rule reads, for callers without a DataConfig at hand."""

    batch_size: int
    drop_last: bool = False


@dataclass(frozen=True)
class EpochPlan:
    """Every rank's steps this epoch: `steps` steps of `batch_sizes[r]` rows, the last one of
    `last_batch_sizes[r]` rows (equal to the batch size when every step is full)."""

    steps: int
    batch_sizes: tuple[int, ...]
    last_batch_sizes: tuple[int, ...]
    full_steps_only: bool  # drop_last, or batches shared by speed: every step holds full batches

    def batch_size(self, rank: int) -> int:
        return self.batch_sizes[rank]

    def last_batch_size(self, rank: int) -> int:
        return self.last_batch_sizes[rank]

    @property
    def rows_per_step(self) -> int:
        """Rows of one full step over all ranks (the global batch)."""
        return sum(self.batch_sizes)


def expected_row_counts(num_rows: int, workers: int) -> tuple[int, ...]:
    """Equal shares +-1: the planner's estimate before data/shards.py counts the real shards (which
    differ from it by a few rows per input partition)."""
    base, extra = divmod(max(num_rows, 0), max(workers, 1))
    return tuple(base + (1 if rank < extra else 0) for rank in range(max(workers, 1)))


def epoch_plan(row_counts: Sequence[int], data: "DataConfig | _HasBatchOptions",
               shares: Sequence[int] | None = None) -> EpochPlan:
    """The steps of one epoch over shards of `row_counts` rows (every rank's, in rank order)."""
    batch_size, drop_last = data.batch_size, bool(data.drop_last)
    check_batch_size(batch_size)
    world = len(row_counts)
    if shares:
        if len(shares) != world or min(shares) < 1:
            raise ValueError(f"batch shares {list(shares)} must give each of {world} ranks at least one row")
        steps = _steps(sum(row_counts), sum(shares), drop_last)  # every row once over all ranks
        full = tuple(int(s) for s in shares)
        return EpochPlan(steps, full, full if steps else (0,) * world, True)
    largest = max(row_counts, default=0)
    steps = _steps(largest, batch_size, drop_last)  # the largest shard sees each row once
    if steps == 0:
        last = 0
    elif drop_last:
        last = batch_size
    else:
        last = largest - (steps - 1) * batch_size
    return EpochPlan(steps, (batch_size,) * world, (last,) * world, drop_last)


def _steps(rows: int, batch_size: int, drop_last: bool) -> int:
    return rows // batch_size if drop_last else math.ceil(rows / batch_size)


def check_shards(row_counts: Sequence[int], data: "DataConfig | _HasBatchOptions",
                 shares: Sequence[int] | None = None) -> EpochPlan:
    """The epoch plan, or the EmptyDataError every rank raises alike (no rank then waits in a
    collective): a rank without rows, or drop_last leaving no full batch."""
    empty = [rank for rank, n in enumerate(row_counts) if n == 0]
    if empty:
        raise EmptyDataError(f"rank(s) {empty} received no rows (rows per rank: {list(row_counts)})",
                             hint="use fewer workers, or repartition the DataFrame so no partition is empty")
    plan = epoch_plan(row_counts, data, shares)
    if plan.steps == 0:
        raise EmptyDataError(f"drop_last=True with batch_size={data.batch_size} leaves no full batch "
                             f"(rows per rank: {list(row_counts)})", hint="lower batch_size or set drop_last=False")
    return plan


@dataclass(frozen=True)
class Accumulation:
    """Where a loader step sits in its gradient-accumulation window: micro-batch `index` of `count`;
    gradients are communicated and the optimizer steps on the last one only."""

    index: int = 0
    count: int = 1

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


def optimizer_steps(steps: int, accumulate: int) -> int:
    """Optimizer steps of an epoch of `steps` loader steps: windows never cross an epoch's end, so
    a last, shorter window still steps (its micro-batches then weigh 1/its length each)."""
    return math.ceil(steps / max(accumulate, 1))


def accumulation(step: int, steps: int, accumulate: int) -> Accumulation:
    """The window of loader step `step` (0-based) of an epoch of `steps` steps."""
    accumulate = max(accumulate, 1)
    start = step - step % accumulate
    return Accumulation(step - start, min(accumulate, steps - start))
