"""DiLoCo with Dynamic Local Updates through the estimator on local-cluster, one rank emulated at a third
of the speed: it trains, each epoch's record keeps the schedule, and the fast rank took more inner steps."""
from __future__ import annotations

import numpy as np
import pytest
from torch import nn

from sparkdl import TorchEstimator
from sparkdl.datasets import DIGITS_FEATURE_COLS, digits_dataframe, train_test_split_digits

pytestmark = pytest.mark.timeout(120)


def small_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 10))


def test_dynamic_local_updates_let_the_fast_rank_work(spark) -> None:  # type: ignore[no-untyped-def]
    train_idx, test_idx = train_test_split_digits(seed=0)
    train = digits_dataframe(spark, indices=train_idx).repartition(2)
    model = TorchEstimator(model=small_mlp, feature_cols=DIGITS_FEATURE_COLS, label_col="label", batch_size=32,
                           epochs=2, lr=2e-3, optimizer="adamw", seed=0, num_workers=2, tracking=False,
                           progress=False, strategy="data_parallel", sync="diloco", sync_every=5,
                           local_updates="dynamic", max_staleness=1, emulate_speed=[1.0, 0.33]).fit(train)
    rows = model.transform(digits_dataframe(spark, indices=test_idx)).select("label", "prediction").collect()
    assert float(np.mean([r["label"] == r["prediction"] for r in rows])) > 0.6  # it trains (chance: 0.1; the schedule follows measured speeds)
    for record in model.history:
        rounds = record["diloco_round_steps_by_rank"]
        assert len(rounds) == 2 and all(h >= 5 for h in rounds[0] + rounds[1])
        # Each agreed plan gives the replica measured slower one inner step per batch (no row skipped),
        # the other echoes batches. Which one was slower is measured (a stall of the emulated-fast rank
        # under load can swap them for a round), and with max_staleness=1 a replica may land a sync a
        # round later than the other, so its k-th round follows an earlier plan: check each round
        # against the plan it ran under, not against the other replica's k-th round.
        plans = record["diloco_round_plans_by_rank"]
        for rank, (steps, used) in enumerate(zip(rounds, plans)):
            assert all(min(plan) == 5 and h == plan[rank] for h, plan in zip(steps, used)), (rounds, plans)
        assert min(record["diloco_inner_steps_by_rank"]) >= record["steps"]
        assert record["diloco_max_staleness"] <= 1
    # H_w of the fast rank from its measured compute speed: emulate_speed stretches forward and backward
    # only (not the AdamW step), and a busy machine adds noise, so the measured ratio is below 3
    fast, slow = (sum(r["diloco_inner_steps_by_rank"][i] for r in model.history) for i in (0, 1))
    assert fast > slow, [r["diloco_inner_steps_by_rank"] for r in model.history]
    assert model.options["train.local_updates"] == "dynamic"
