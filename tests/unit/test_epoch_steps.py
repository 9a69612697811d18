"""One rule for the steps of an epoch (data/epochs.py), asked by the planner, the driver's pre-job
check and every rank: they agree over a grid of drop_last, equal and unequal shards and batch shares,
and the spool yields exactly the batches the rule promises."""
from __future__ import annotations

import itertools
from typing import Any

import pyarrow as pa
import pytest

from sparkdl.comm.base import WorldInfo
from sparkdl.config import RunConfig
from sparkdl.data.batches import Spool
from sparkdl.data.epochs import epoch_plan, expected_row_counts
from sparkdl.data.layout import FeedLayout
from sparkdl.errors import ConfigError
from sparkdl.executor.context import WorkerContext
from sparkdl.wire.spec import TrainSpec
from sparkdl.planner.candidates import run_steps

LAYOUT = FeedLayout(num_features=1, label_dtype="int64")


class _NoComm:
    device = "cpu"


def context(config: RunConfig, row_counts: tuple[int, ...], shares: tuple[int, ...] | None, rank: int = 0,
            spool: Any = None) -> WorkerContext:
    world = WorldInfo(rank=rank, size=len(row_counts), local_rank=rank, local_size=len(row_counts),
                      hosts=("h",) * len(row_counts), master_addr="127.0.0.1", master_port=1)
    spec = TrainSpec(run_id="r", data=config.data, train=config.train, launch=config.launch,
                     tracking=config.tracking, layout=LAYOUT)
    return WorkerContext(world=world, comm=_NoComm(), spec=spec, row_counts=row_counts, batch_shares=shares,
                         spool=spool)  # type: ignore[arg-type]


def config(batch_size: int, drop_last: bool, workers: int, epochs: int = 1, balance: str = "equal") -> RunConfig:
    return RunConfig.from_kwargs(feature_cols=["x"], batch_size=batch_size, drop_last=drop_last, num_workers=workers,
                                 epochs=epochs, batch_balance=balance, strategy="data_parallel")


SHARDS = {"equal": lambda n, w: expected_row_counts(n, w), "unequal": lambda n, w: tuple(
    max(1, round(n * (k + 1) / sum(range(1, w + 1)))) for k in range(w))}


@pytest.mark.parametrize("drop_last, shards, balance, workers, batch, rows", [
    (d, s, b, w, bs, n) for d, s, b, w, bs, n in itertools.product(
        (False, True), ("equal", "unequal"), ("equal", "speed"), (1, 2, 3), (1, 7, 32), (5, 64, 100, 1000))
    if not (b == "speed" and w == 1)])
def test_planner_and_worker_agree_on_steps(drop_last: bool, shards: str, balance: str, workers: int, batch: int,
                                           rows: int) -> None:
    counts = SHARDS[shards](rows, workers)
    cfg = config(batch, drop_last, workers, epochs=3, balance=balance)
    # shares by speed: any split of the global batch; the planner cannot know it, only its sum
    shares = None if balance == "equal" else tuple([workers * batch - (workers - 1)] + [1] * (workers - 1))
    worker = context(cfg, counts, shares).steps_per_epoch
    planner = run_steps(cfg.data, cfg.train, cfg.launch, sum(counts), row_counts=counts)
    assert planner == 3 * worker, (counts, shares)
    if shards == "equal":  # the planner's default: the round-robin shares prepare() gives
        assert run_steps(cfg.data, cfg.train, cfg.launch, sum(counts)) == 3 * worker
        assert epoch_plan(expected_row_counts(sum(counts), workers), cfg.data).steps == \
            context(cfg, counts, None).steps_per_epoch


@pytest.mark.parametrize("drop_last", [False, True])
def test_every_rank_gets_exactly_the_promised_batches(tmp_path, drop_last: bool) -> None:  # type: ignore[no-untyped-def]
    counts = (10, 7)
    cfg = config(4, drop_last, 2)
    for rank, n in enumerate(counts):
        rows = pa.RecordBatch.from_arrays([pa.FixedSizeListArray.from_arrays(pa.array([float(i) for i in range(n)],
                                                                                      pa.float32()), 1),
                                           pa.array(range(n), pa.int64())],
                                          names=[LAYOUT.feature_column, LAYOUT.label_column])
        with Spool.write([rows], LAYOUT, tmp_path) as spool:
            ctx = context(cfg, counts, None, rank=rank, spool=spool)
            sizes = [len(labels) for _, labels in ctx.batches(0)]
        plan = ctx.epoch
        assert len(sizes) == plan.steps == (2 if drop_last else 3)
        assert sizes == [4] * (plan.steps - 1) + [plan.last_batch_size(rank)]
        assert plan.last_batch_size(rank) == (4 if drop_last else 2)


def test_shares_fill_every_step_and_cover_all_rows_once() -> None:
    plan = epoch_plan([100, 90], config(32, False, 2).data, shares=[48, 16])
    assert plan.steps == 3 and plan.batch_sizes == (48, 16) and plan.last_batch_sizes == (48, 16)
    assert plan.full_steps_only and plan.rows_per_step == 64
    assert epoch_plan([100, 90], config(32, True, 2).data, shares=[48, 16]).steps == 2


def test_a_bad_batch_size_is_refused_by_the_rule() -> None:
    from sparkdl.data.epochs import BatchOptions

    with pytest.raises(ConfigError, match="batch_size must be at least 1"):
        epoch_plan([10], BatchOptions(0))
    assert expected_row_counts(7, 3) == (3, 2, 2) and sum(expected_row_counts(1001, 4)) == 1001
