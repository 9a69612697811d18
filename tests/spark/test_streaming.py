"""Epoch 1 streams while the partition arrives; spool="none" trains one pass without a local file."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from sparkdl import TorchEstimator

FEATURES = [f"f{i}" for i in range(4)]


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def rows_df(spark, rows: int = 300):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(4)
    x = rng.normal(size=(rows, 4))
    data = [(*map(float, r), int(r[0] > 0)) for r in x]
    # exactly two partitions, kept: each rank's rows arrive in the same order in every run
    return spark.sparkContext.parallelize(data, 2).toDF(FEATURES + ["label"]).cache()


def fit(df, **options):  # type: ignore[no-untyped-def]
    settings = dict(model=net, feature_cols=FEATURES, label_col="label", batch_size=16, epochs=1, num_workers=2,
                    optimizer="sgd", lr=0.2, seed=3, strategy="data_parallel", tracking=False, progress=False)
    settings.update(options)
    return TorchEstimator(**settings).fit(df)


def test_one_pass_writes_no_file_and_trains_the_weights_of_a_spooled_pass(spark, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    df = rows_df(spark)
    spooled = fit(df, shuffle=False, spool="disk", spool_dir=str(tmp_path / "spool"))
    not_a_directory = tmp_path / "a-file"
    not_a_directory.write_text("any write under this path fails")
    one_pass = fit(df, shuffle=False, spool="none", spool_dir=str(not_a_directory / "spool"))
    got, want = one_pass.torch_module().state_dict(), spooled.torch_module().state_dict()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=0, rtol=0, msg=key)
    assert not list((tmp_path / "spool").iterdir())  # the spooled pass removed its file too
    record = one_pass.history[0]
    assert record["steps"] == 10 and record["samples"] == 300  # 150 rows per rank: 9 steps of 16 and one of 6
    assert 0 < record["time_to_first_step_s"] and record["spool_seconds"] > 0


def test_a_shuffled_one_pass_run_sees_every_row_and_validates(spark) -> None:  # type: ignore[no-untyped-def]
    history = fit(rows_df(spark).repartition(3), validation_fraction=0.2, epochs=1).history  # "auto": one pass
    record = history[0]
    assert record["samples"] >= 240 - 20 and "val_loss" in record and np.isfinite(record["val_loss"])
