"""batch_balance="dynamic" (executor/rebalance.py): the split rules, and the exchange over real gloo
ranks: every step keeps exactly the even split's rows, every row of the epoch is computed once, and
shares follow measured speeds (with hysteresis)."""
from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch

from sparkdl.data.epochs import BatchOptions, epoch_plan
from sparkdl.executor.rebalance import (Rebalancer, remembered_speeds, resplit, split_rows, step_time,
                                        transfers)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "support"))
from gloo_world import run_world  # noqa: E402


def test_rows_split_by_speed_with_a_floor() -> None:
    assert split_rows(12, [1, 1, 1]) == [4, 4, 4]
    assert split_rows(12, [3, 1]) == [9, 3]
    assert sum(split_rows(100, [2.0, 1.0, 1.0])) == 100
    assert split_rows(16, [100.0, 1.0], floor=2) == [14, 2]
    assert split_rows(3, [100.0, 1.0, 1.0], floor=5) == [1, 1, 1]  # floors capped to fit


def test_transfers_move_surplus_tails_in_rank_order() -> None:
    assert transfers([8, 8, 8], [8, 8, 8]) == []
    assert transfers([8, 8, 8], [12, 10, 2]) == [(2, 0, 4), (2, 1, 2)]
    moves = transfers([5, 9, 1, 7], [7, 2, 8, 5])
    given = {r: sum(n for s, _, n in moves if s == r) for r in range(4)}
    taken = {r: sum(n for _, d, n in moves if d == r) for r in range(4)}
    assert [c - given[r] + taken[r] for r, c in enumerate([5, 9, 1, 7])] == [7, 2, 8, 5]


def test_resplit_needs_a_real_gain() -> None:
    even = [0.5, 0.5]
    assert step_time([8, 8], [1.0, 0.5]) == 16.0
    assert resplit(even, [1.0, 0.98], 16, 1) is None  # within the hysteresis: no churn
    assert resplit(even, [1.0, 0.0], 16, 1) is None  # one measurement is no comparison
    new = resplit(even, [3.0, 1.0], 16, 1)
    assert new is not None and new == pytest.approx([0.75, 0.25])
    assert resplit(new, [3.0, 1.05], 16, 1) is None


def test_remembered_speeds_by_executor_then_host() -> None:
    kept = {"executor:e1": 3.0, "host:h2": 1.0}
    assert remembered_speeds(kept, ["e1", "e9", "e3"], ["h1", "h2", "h3"]) == [3.0, 1.0, 2.0]
    assert remembered_speeds({}, ["e1"], ["h1"]) is None


ROWS, BATCH, STEPS = 16 * 10 + 3, 16, 11  # per rank: 10 full steps of 16 rows and a last one of 3


def _epoch(comm: Any, speeds_by_rank: list[list[float]], every: int) -> dict[str, Any]:
    """One epoch of ROWS rows per rank (row ids as features, 2 columns), re-split as the injected
    speeds say: what each step kept, the loss weights, and the shares agreed."""
    rank, world = comm.rank, comm.size
    plan = epoch_plan([ROWS] * world, BatchOptions(BATCH))
    balancer = Rebalancer.start(comm, every, None, [f"e{r}" for r in range(world)], ["h"] * world)

    def batches() -> Any:
        for step in range(plan.steps):
            n = plan.last_batch_size(rank) if step == plan.steps - 1 else plan.batch_size(rank)
            ids = torch.arange(step * BATCH, step * BATCH + n) + 1000 * rank
            yield torch.stack([ids.double(), -ids.double()], 1), ids, ids.float() / 10

    seen, weights, rows = [], [], []
    for step, (features, labels, w) in enumerate(balancer.exchanged(batches(), plan, 0, 0)):
        assert torch.equal(features[:, 0].long(), labels) and torch.equal(features[:, 1].long(), -labels)
        assert torch.allclose(w, labels.float() / 10)
        seen.append(labels.tolist())
        weights.append(balancer.loss_weight)
        rows.append(len(labels))
        speed = speeds_by_rank[min(step // every, len(speeds_by_rank) - 1)][rank]
        balancer.record(len(labels), len(labels) / speed)  # compute seconds at the injected speed
    return {"seen": seen, "weights": weights, "rows": rows, "shares": balancer.shares,
            "counts": balancer.take_epoch_counts()}


def test_every_row_once_and_each_step_the_even_splits_rows() -> None:
    # Rank 2 slows to a third mid-epoch, then recovers: shares change twice within the epoch (an
    # agreement every step: a re-split waits for WINDOW agreements in a row that say it pays).
    speeds = [[1.0, 1.0, 1.0]] * 2 + [[1.0, 1.0, 1 / 3]] * 4 + [[1.0, 1.0, 1.0]] * 5
    results = run_world(3, _epoch, speeds, 1)
    plan = epoch_plan([ROWS] * 3, BatchOptions(BATCH))
    for step in range(STEPS):
        n = plan.last_batch_size(0) if step == STEPS - 1 else BATCH
        expected = {step * BATCH + i + 1000 * r for r in range(3) for i in range(n)}
        got = [row for result in results for row in result["seen"][step]]
        assert sorted(got) == sorted(expected), step  # the even split's rows, each once
        # each row's weight in the average over ranks of weighted per-rank means: 1 / the step's rows
        total = sum(result["rows"][step] for result in results)
        for result in results:
            assert result["weights"][step] / (3 * result["rows"][step]) == pytest.approx(1 / total)
    rows_of_rank2 = [results[2]["rows"][s] for s in range(STEPS)]
    assert min(rows_of_rank2[:-1]) < BATCH  # the slow rank gave rows away for a while
    assert results[0]["counts"]["rebalances"] >= 2 and results[0]["counts"]["rows_moved"] > 0
    assert all(r["shares"] == results[0]["shares"] for r in results)  # agreed


def test_steady_speeds_make_no_churn() -> None:
    results = run_world(2, _epoch, [[1.0, 0.97]], 2)
    assert results[0]["counts"] == {"rebalances": 0, "rows_moved": 0}
    assert results[0]["rows"] == [BATCH] * (STEPS - 1) + [3]


def test_a_rank_slowing_far_from_the_start_is_recorded_as_drift() -> None:
    results = run_world(3, _epoch, [[1.0, 1.0, 0.2]], 2)
    drift = results[0]["counts"].get("speed_drift", "")
    assert drift.startswith("rank 2 runs at") and "bound 2x" in drift, results[0]["counts"]
    assert all(r["counts"].get("speed_drift") == drift for r in results)


def test_dynamic_balance_is_checked_before_any_job() -> None:
    from sparkdl.config import RunConfig
    from sparkdl.errors import ConfigError

    def config(**options: Any) -> Any:
        return RunConfig.from_kwargs(feature_cols=["a"], batch_balance="dynamic", **options).validate()

    for ok in ({"strategy": "data_parallel"}, {"strategy": "sharded"}, {"sync": "diloco"}, {"strategy": "auto"}):
        assert config(**ok).train.batch_balance == "dynamic"
    with pytest.raises(ConfigError, match="train.batch_balance='dynamic' re-splits .* train.strategy='ist'"):
        config(strategy="ist")
    with pytest.raises(ConfigError, match="backend='horovod' cannot"):
        config(strategy="data_parallel", backend="horovod")
    with pytest.raises(ConfigError, match="train.rebalance_every"):
        config(strategy="data_parallel", rebalance_every=0)
    with pytest.raises(ConfigError, match="fragments"):
        config(sync="diloco", fragments=2, sync_every=10)
