"""Direct Parquet delivery (data.delivery): ranks read a plain Parquet scan's files themselves;
anything Spark would change (a filter, a computed column, a validation split) is read through Spark."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

import sparkdl
from sparkdl import RunConfig
from sparkdl.errors import ConfigError

FEATURES = [f"f{i}" for i in range(3)] + ["v"]


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def write_table(path: Path, rows: int = 301) -> Path:
    """One file of several row groups: mixed scalar types (double, int, float) and a 3-long array."""
    rng = np.random.default_rng(5)
    table = pa.table({"f0": rng.normal(size=rows), "f1": rng.integers(-5, 5, rows),
                      "f2": rng.normal(size=rows).astype(np.float32),
                      "v": pa.array(list(rng.normal(size=(rows, 3))), pa.list_(pa.float64())),
                      "label": rng.integers(0, 3, rows), "w": rng.uniform(0.5, 1.5, rows)})
    path.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path / "part-0.parquet", row_group_size=70)
    return path


def fit(df, **options):  # type: ignore[no-untyped-def]
    settings = dict(model=net, feature_cols=FEATURES, label_col="label", batch_size=16, epochs=2, num_workers=1,
                    optimizer="sgd", lr=0.1, seed=3, strategy="data_parallel", tracking=False, progress=False,
                    shuffle=False)
    settings.update(options)
    model = settings.pop("model")
    return sparkdl.fit(df, model, RunConfig.from_kwargs(**settings))


def test_direct_reads_train_the_weights_spark_delivery_trains(spark, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    df = spark.read.parquet(str(write_table(tmp_path / "t"))).select(*FEATURES, "label", "w")
    direct = fit(df, weight_col="w")
    through_spark = fit(df, weight_col="w", delivery="spark")
    assert direct.extra["delivery"] == "parquet" and through_spark.extra["delivery"] == "spark"
    got, want = direct.module.state_dict(), through_spark.module.state_dict()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=0, rtol=0, msg=key)
    assert [r["samples"] for r in direct.history] == [301, 301]


def test_two_ranks_read_every_row_once(spark, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    df = spark.read.parquet(str(write_table(tmp_path / "t")))
    result = fit(df, num_workers=2, shuffle=True, epochs=1)
    assert result.extra["delivery"] == "parquet"
    # shards of 151 + 150 rows: equal steps per rank, so the smaller wraps one row around
    assert result.history[0]["samples"] == 302


def test_what_spark_would_change_is_delivered_by_spark(spark, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from pyspark.sql import functions as F

    df = spark.read.parquet(str(write_table(tmp_path / "t")))
    filtered = df.filter(F.col("f0") > -1)  # one partition for one worker, array features: Spark's rows
    assert fit(filtered, epochs=1).extra["delivery"] == "spark"
    computed = df.withColumn("f0", F.col("f0") * 2)
    assert fit(computed, epochs=1).extra["delivery"] == "spark"
    scalars = computed.drop("v")  # scalar features only: packed on the JVM instead
    three = lambda: nn.Sequential(nn.Linear(3, 3))  # noqa: E731
    assert fit(scalars, epochs=1, feature_cols=FEATURES[:3], model=three).extra["delivery"] == "packed"
    assert fit(df, epochs=1, validation_fraction=0.2).extra["delivery"] == "spark"
    df.write.partitionBy("label").parquet(str(tmp_path / "by-label"))  # the label lives in directory names
    assert fit(spark.read.parquet(str(tmp_path / "by-label")), epochs=1).extra["delivery"] == "spark"
    with pytest.raises(ConfigError, match=r"data.delivery='parquet'.*filter|data.delivery='parquet'.*plain file scan"):
        fit(filtered, epochs=1, delivery="parquet")
    with pytest.raises(ConfigError, match="validation split"):
        fit(df, epochs=1, validation_fraction=0.2, delivery="parquet")
