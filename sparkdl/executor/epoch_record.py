"""One epoch on one rank: its running sums while it trains, and the record every rank agrees on at
its end (sums over ranks, per-rank maxima, each rank's pace)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from sparkdl.executor.context import WorkerContext
from sparkdl.executor.loss_watch import LossWatch
from sparkdl.executor.memory import peak_memory
from sparkdl.executor.pace import pace_figures, slow_ranks_in_groups, wait_fraction, with_costs
from sparkdl.executor.rebalance import Rebalancer
from sparkdl.strategies import Strategy

@dataclass
class EpochTotals:
    """One epoch's running sums on this rank (the loss on device: no sync per step)."""

    loss_sum: torch.Tensor
    samples: int
    step: int
    global_step: int
    transform_started: float = 0.0  # ctx.transform_seconds when the epoch began
    data_seconds: float = 0.0  # waiting for the next batch (spool read, assembly, transform_fn not hidden by prefetch)
    step_seconds: float = 0.0  # in train_step: compute and the strategy's collectives (executor/pace.py)
    wait_seconds: float = 0.0  # of those, blocked in collectives on this thread (comm.base.blocked_seconds)
    balancer: Rebalancer | None = None  # batch_balance="dynamic": who computes which rows of a step
    first_step_s: float | None = None  # task start to the end of the run's first step (a fresh run's epoch 0)
    checkpoint: dict[str, float] = field(default_factory=dict)  # CheckpointTimings.take() of the epoch
    watch: LossWatch | None = None  # train.nonfinite_loss: NaN/inf losses raise or are left out
    skipped: dict[str, int] = field(default_factory=dict)  # LossWatch.end_epoch(): steps and rows left out


SLOWEST_RANK = ("data_seconds", "time_to_first_step_s", "spool_seconds",
                "checkpoint_saves", "checkpoint_stall_s", "checkpoint_write_s")
# Kept per rank too (what sharding saves shows rank by rank); the baselines the peak grew from, and
# the torch threads each rank trains with (executor/threads.py), only so.
PER_RANK = ("peak_rss_bytes", "start_rss_bytes", "model_start_rss_bytes", "cuda_peak_bytes", "torch_threads")
BASELINES = ("start_rss_bytes", "model_start_rss_bytes", "torch_threads")


def epoch_record(ctx: WorkerContext, strategy: Strategy, epoch: int, totals: EpochTotals, seconds: float,
                 bytes_sent: int) -> dict[str, Any]:
    """The epoch's history record, the same on every rank: sums over ranks, per-rank maxima."""
    skipped_rows = totals.skipped.get("skipped_rows", 0)
    sums = torch.tensor([float(totals.loss_sum.cpu()), float(totals.samples - skipped_rows),
                         float(totals.skipped.get("skipped_steps", 0))], dtype=torch.float64)
    ctx.comm.allreduce(sums, op="sum")
    record: dict[str, Any] = {
        "epoch": epoch,
        "loss": float(sums[0] / max(sums[1], 1.0)),
        "samples": int(sums[1]),
        "steps": totals.step,
        "seconds": seconds,
        "samples_per_sec": float(sums[1]) / seconds if seconds > 0 else 0.0,
        "bytes_sent": bytes_sent,
        "lr": strategy.learning_rate(),
        "workers": ctx.world_size,
    }
    if ctx.spec.train.nonfinite_loss == "skip":  # steps left out on some rank (rank-steps, summed)
        record["nonfinite_steps_skipped"] = int(sums[2])
    if ctx.batch_shares:
        record["batch_rows_per_rank"] = list(ctx.batch_shares)
    if totals.balancer is not None:  # the split the epoch ended with, and how much it moved
        record["batch_rows_per_rank"] = totals.balancer.full_step_rows(ctx.epoch)
        record.update(totals.balancer.take_epoch_counts())
    record.update(strategy.epoch_record())
    local = dict(strategy.epoch_metrics(), bytes_sent=float(bytes_sent), data_seconds=totals.data_seconds,
                 step_seconds=totals.step_seconds, rows=float(totals.samples), **peak_memory(ctx.comm.device),
                 torch_threads=float(torch.get_num_threads()), **totals.checkpoint)
    # Collectives timed on this thread; a strategy's own figure also holds waits for its background
    # sync thread (DiLoCo's outer syncs not hidden behind training): the larger is this rank's wait.
    local["wait_seconds"] = max(totals.wait_seconds, float(local.get("comm_wait_s", 0.0)))
    if totals.first_step_s is not None:  # every rank's first step is in the same epoch (equal steps)
        local.update(time_to_first_step_s=totals.first_step_s, spool_seconds=ctx.partition_seconds)
    if ctx.spec.data.transform_fn is not None:  # time in transform_fn this epoch (on the prefetch thread)
        local["transform_seconds"] = record["transform_seconds"] = ctx.transform_seconds - totals.transform_started
    gathered = _gather_metrics(ctx, local)
    record.update(_pace(gathered, ctx.world.hosts, strategy.peer_groups(), totals.step))
    for name, values in gathered.items():
        if name in ("step_seconds", "rows", "wait_seconds"):
            continue  # in the pace figures
        if name == "bytes_sent":
            record["bytes_sent_all_ranks"] = int(sum(values))  # "bytes_sent" is rank 0's own
        elif name in SLOWEST_RANK:  # the slowest rank holds every rank back
            record[name] = max(values)
        elif name not in BASELINES:
            record[f"max_{name}_per_rank"] = max(values)
        if name in PER_RANK:
            record[f"{name}_by_rank"] = [int(v) for v in values]
    return record


def _pace(gathered: dict[str, list[float]], hosts: Sequence[str], groups: Sequence[Sequence[int]],
          step_count: int) -> dict[str, Any]:
    """Each rank's compute time, waits and speed, and the ranks that hold the others back at a cost
    (executor/pace.py's rule), named with their hosts: each held against the ranks doing the same
    work (`groups`: Strategy.peer_groups)."""
    steps, waits = gathered["step_seconds"], gathered["wait_seconds"]
    figures: dict[str, Any] = pace_figures(steps, waits, gathered["rows"])
    figures["wait_fraction"] = wait_fraction(steps, waits)
    slow = with_costs(slow_ranks_in_groups(figures["rows_per_compute_s_by_rank"], hosts, groups),
                      figures["compute_seconds_by_rank"], steps, groups, step_count)
    if slow:
        figures["slow_ranks"] = slow
    return figures


def _gather_metrics(ctx: WorkerContext, local: dict[str, float]) -> dict[str, list[float]]:
    gathered = ctx.comm.allgather_object(local)
    return {name: [float(m.get(name, 0.0)) for m in gathered] for name in local}
