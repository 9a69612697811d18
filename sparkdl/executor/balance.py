"""Data parallel on ranks of different speeds (DT-FM, ALGORITHMS.md): each rank's share of the global
batch in proportion to its speed, so that the fast ranks do not wait for the slow one at every
allreduce (`train.batch_balance="speed"`).

Speeds are measured inside the training job, after the ranks are placed (a rank is only known to
sit on a given executor once its barrier task runs): a short matrix-product probe per rank, or the
declared `launch.emulate_speed`, gathered by every rank. The global batch stays num_workers x
batch_size rows and one epoch still covers as many rows as there are, so results stay comparable
with equal shares; a rank with a larger share cycles over its rows more often (as smaller ranks
already do with equal shares). The loss of rank r is weighted by share_r x W / global batch
before backward, so the averaged gradient is exactly the gradient of the mean over all rows.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from sparkdl.data.epochs import BatchOptions, epoch_plan
from sparkdl.model.layouts import batch_shares

if TYPE_CHECKING:
    from sparkdl.comm.base import Communicator
    from sparkdl.config import TrainConfig


def measured_speed(rank: int, emulated: Sequence[float] | None) -> float:
    """This rank's FLOP/s with the torch threads it trains with (or its declared emulated speed)."""
    if emulated:
        return float(emulated[rank])  # the emulation declares the speeds; the real ranks are alike
    from sparkdl.planner.speed import matmul_flops

    return matmul_flops()


def shares_by_speed(speeds: Sequence[float], batch_size: int) -> list[int]:
    """Rows per rank and step: the global batch (len(speeds) x batch_size) split by speed."""
    return batch_shares(list(speeds), len(speeds) * batch_size)


def balanced_steps(row_counts: Sequence[int], global_batch: int, drop_last: bool) -> int:
    """Steps per epoch with shared batches: every row once over all ranks, i.e. one shard of all
    rows in batches of the global batch (data/epochs.py's rule; full steps only with drop_last)."""
    return epoch_plan([sum(row_counts)], BatchOptions(global_batch, drop_last)).steps


def loss_weight(shares: Sequence[int], rank: int) -> float:
    """Factor on rank's mean loss so that averaging gradients over ranks gives the all-rows mean."""
    return shares[rank] * len(shares) / sum(shares)


def agree_on_shares(comm: Any, rank: int, batch_size: int, emulated: Sequence[float] | None) -> list[int]:
    """Every rank measures itself; all get the same shares."""
    speeds = comm.allgather_object(measured_speed(rank, emulated))
    return shares_by_speed(speeds, batch_size)


def agreed_shares(train: "TrainConfig", batch_size: int, emulate_speed: Sequence[float] | None, comm: "Communicator",
                  rank: int, world_size: int, row_counts: Sequence[int],
                  started_with: Sequence[int] | None = None) -> tuple[int, ...] | None:
    """The batch shares of a data-parallel run with train.batch_balance="speed" (None otherwise):
    those the run started with when a retried attempt resumes, else measured now by every rank."""
    if train.batch_balance != "speed" or train.strategy != "data_parallel" or world_size < 2 or not any(row_counts):
        return None
    if started_with:
        return tuple(int(s) for s in started_with)
    return tuple(agree_on_shares(comm, rank, batch_size, emulate_speed))
