"""batch_balance="dynamic" in a real fit (issue 43, item 3): a rank slowed by a test loss (1 ms per
row, outside the library) computes fewer of each step's rows, rows move between ranks, and the weights are those of the even split on the same
rows (shares changing mid-epoch); a run resumed from its checkpoint starts from the measured shares."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from slow_rank import SlowOnRank
from sparkdl import TorchEstimator
from sparkdl.datasets import DIGITS_FEATURE_COLS


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))


SLOW = SlowOnRank(rank=1, seconds=0.001, per_row=True)
COMMON = dict(model=_net, feature_cols=DIGITS_FEATURE_COLS, optimizer="sgd", lr=0.05, batch_size=64,
              num_workers=2, shuffle=False, seed=3, tracking=False, progress=False)


@pytest.mark.parametrize("strategy", ["data_parallel", "sharded"])
def test_dynamic_shares_follow_speed_and_keep_the_even_splits_update(spark, digits_df, strategy) -> None:  # type: ignore[no-untyped-def]
    df = digits_df.limit(1792).repartition(2).cache()  # 896 rows per rank: the even split sees each once
    equal = TorchEstimator(**COMMON, epochs=1, strategy=strategy, loss=SLOW).fit(df)
    dynamic = TorchEstimator(**COMMON, epochs=1, strategy=strategy, batch_balance="dynamic", rebalance_every=2,
                             loss=SLOW).fit(df)
    record = dynamic.history[0]
    fast, slow = record["batch_rows_per_rank"]
    assert fast + slow == 128 and fast > 1.8 * slow, record
    assert record["rebalances"] >= 1 and record["rows_moved"] > 0
    assert record["samples"] == equal.history[0]["samples"] == df.count()  # every row once
    assert record["steps"] == equal.history[0]["steps"]
    assert dynamic.history[0]["loss"] == pytest.approx(equal.history[0]["loss"], rel=1e-5)
    for (name, got), want in zip(dynamic.torch_module().state_dict().items(),
                                 equal.torch_module().state_dict().values()):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=name)


def test_a_resumed_run_starts_from_the_measured_shares(spark, digits_df, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    df = digits_df.limit(1792).repartition(2).cache()  # 14 steps per epoch
    options = dict(COMMON, batch_balance="dynamic", rebalance_every=2, loss=SLOW, epochs=1,
                   checkpoint_dir=str(tmp_path), checkpoint_every=10)
    first = TorchEstimator(**options).fit(df)
    assert first.history[0]["rebalances"] >= 1
    (run,) = [p.name for p in tmp_path.iterdir() if p.is_dir()]
    resumed = TorchEstimator(**options, resume_run=run).fit(df)
    (record,) = resumed.history
    assert record["resumed_from_step"] == 10, record
    # Steps 10-13 again, balanced from the first: without the remembered speeds the first agreement
    # (step 10) has no measurement yet, and steps 10 and 11 would move nothing.
    fast, slow = record["batch_rows_per_rank"]
    assert fast > 1.8 * slow and record["rows_moved"] > 3 * (64 - slow), record


def test_diloco_replicas_share_rows_by_speed_and_weigh_pseudo_gradients_by_them(spark, digits_df) -> None:  # type: ignore[no-untyped-def]
    df = digits_df.limit(1792).repartition(2).cache()
    model = TorchEstimator(**dict(COMMON, lr=0.2), epochs=2, sync="diloco", sync_every=4, batch_balance="dynamic",
                           rebalance_every=2, loss=SLOW).fit(df)
    first, last = model.history
    fast, slow = last["batch_rows_per_rank"]
    assert fast > 1.8 * slow and last["rows_moved"] > 0, last
    assert first["samples"] == last["samples"] == 1792  # every row once per epoch
    assert last["loss"] < first["loss"]
