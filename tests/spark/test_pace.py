"""Each rank's pace measured during a fit (issue 43, item 2): a rank slowed by a test loss (no hook
in the library) is named with its host, its speed and the time the others spend waiting for it
reach the history and MLflow."""
from __future__ import annotations

import pytest
from torch import nn

from slow_rank import SlowOnRank
from sparkdl import TorchEstimator
from sparkdl.datasets import DIGITS_FEATURE_COLS, digits_dataframe


@pytest.mark.parametrize("strategy", ["data_parallel", "sharded"])
def test_a_slow_rank_is_named_with_its_host_and_its_pace_is_recorded(spark, capfd, strategy) -> None:  # type: ignore[no-untyped-def]
    df = digits_dataframe(spark)
    model = TorchEstimator(model=lambda: nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)),
                           feature_cols=DIGITS_FEATURE_COLS, loss=SlowOnRank(rank=1, seconds=0.03), epochs=2,
                           batch_size=64, num_workers=2, lr=3e-3, tracking=False, progress=False,
                           strategy=strategy).fit(df)
    last = model.history[-1]
    speeds = last["rows_per_compute_s_by_rank"]
    assert len(speeds) == 2 and speeds[0] > 2 * speeds[1], last
    (slow,) = last["slow_ranks"]
    assert slow["rank"] == 1 and slow["slower"] > 1.5 and slow["host"]
    waits = last["wait_seconds_by_rank"]
    assert waits[0] > waits[1] and 0 < last["wait_fraction"] < 1  # rank 0 waits for rank 1, not the reverse
    err = capfd.readouterr().err
    assert f"sparkdl: rank 1 on host {slow['host']} computes" in err and "of step time is spent waiting for it" in err
    assert err.count("sparkdl: rank 1 on host") == 1  # named once per run, not every epoch
