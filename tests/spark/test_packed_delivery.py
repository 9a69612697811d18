"""Packed delivery (data.delivery): a DataFrame of scalar features that keeps one partition per worker
reaches the ranks as blocks of rows packed on the JVM (ai.sparkdl.bridge.PackedRows), and trains
exactly what Spark's own Arrow rows train."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import sparkdl
from sparkdl import RunConfig
from sparkdl.errors import ConfigError

FEATURES = ["a", "b", "c"]


def frame(spark, rows: int = 5000, partitions: int = 2):  # type: ignore[no-untyped-def]
    """double, int and float features, an integer label and a weight, in `partitions` partitions."""
    return spark.range(0, rows, 1, partitions).selectExpr(
        "sin(id) * 3 as a", "cast(id % 11 - 5 as int) as b", "cast(cos(id) as float) as c",
        "cast(id % 3 as int) as label", "0.5 + (id % 4) / 4.0 as w")


def fit(df, **options):  # type: ignore[no-untyped-def]
    settings = dict(feature_cols=FEATURES, label_col="label", weight_col="w", batch_size=64, epochs=2, num_workers=2,
                    optimizer="sgd", lr=0.05, seed=3, strategy="data_parallel", tracking=False, progress=False,
                    shuffle=True)
    settings.update(options)
    torch.manual_seed(0)
    return sparkdl.fit(df, nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 3)), RunConfig.from_kwargs(**settings))


def test_packed_blocks_train_the_weights_spark_rows_train(spark) -> None:  # type: ignore[no-untyped-def]
    df = frame(spark).cache()
    packed, rows = fit(df), fit(df, delivery="spark")
    assert packed.extra["delivery"] == "packed" and rows.extra["delivery"] == "spark"
    got, want = packed.module.state_dict(), rows.module.state_dict()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=0, rtol=0, msg=key)
    assert [r["samples"] for r in packed.history] == [5000, 5000]
    df.unpersist()


def _rows_seen(ctx):  # type: ignore[no-untyped-def]
    batches = [(x.numpy().tolist(), y.tolist(), w.tolist()) for x, y, w in ctx.batches(0)]
    return ctx.comm.allgather_object(batches)


def test_a_custom_loop_gets_every_row_in_order_with_its_values(spark) -> None:  # type: ignore[no-untyped-def]
    df = frame(spark, rows=20_000)  # more than two blocks per rank
    options = dict(feature_cols=FEATURES, label_col="label", weight_col="w", batch_size=1000, shuffle=False,
                   progress=False)
    packed = sparkdl.run(_rows_seen, df=df, num_workers=2, delivery="packed", **options)
    through_spark = sparkdl.run(_rows_seen, df=df, num_workers=2, delivery="spark", **options)
    assert packed == through_spark
    first = packed[0][0]
    row = df.limit(1).collect()[0]
    assert first[0][0] == pytest.approx([row.a, row.b, row.c], rel=1e-6) and first[1][0] == row.label
    assert sum(len(batch[1]) for rank in packed for batch in rank) == 20_000


def test_what_cannot_be_packed_is_delivered_by_spark_or_refused(spark) -> None:  # type: ignore[no-untyped-def]
    dealt = frame(spark, rows=600, partitions=3)  # dealt over 2 workers: Spark's rows
    assert fit(dealt, epochs=1).extra["delivery"] == "spark"
    assert fit(frame(spark, rows=600), epochs=1, validation_fraction=0.2).extra["delivery"] == "spark"
    with pytest.raises(ConfigError, match=r"data.delivery='packed'.*dealt over the workers"):
        fit(dealt, epochs=1, delivery="packed")
    arrays = frame(spark, rows=600).selectExpr("array(a, b, c) as v", "label", "w")
    with pytest.raises(ConfigError, match=r"data.delivery='packed'.*array or vector features"):
        fit(arrays, epochs=1, feature_cols=["v"], delivery="packed")


def test_cached_columns_of_the_right_types_are_read_without_rows(spark) -> None:  # type: ignore[no-untyped-def]
    """float features, a bigint label and a float weight, cached: the blocks are the cached column
    batches themselves (no row conversion), and train what Spark's rows train."""
    from sparkdl.spark import jvm
    from sparkdl.data.prepare import prepare_run
    from sparkdl.data.packed_delivery import PACKER

    df = frame(spark).selectExpr("cast(a as float) as a", "cast(b as float) as b", "c", "cast(label as bigint) as label",
                                 "cast(w as float) as w").cache()
    config = RunConfig.from_kwargs(num_workers=2, feature_cols=FEATURES, label_col="label", weight_col="w")
    prepared = prepare_run(df, config.data, config.train, config.launch)
    assert prepared.delivery == "packed"
    assert jvm.call_static(spark, PACKER, "readsCachedColumns", prepared.flat._jdf)  # noqa: SLF001
    cast = prepare_run(frame(spark).cache(), config.data, config.train, config.launch)
    assert cast.delivery == "packed"  # double and int features cast to float: packed from rows instead
    assert not jvm.call_static(spark, PACKER, "readsCachedColumns", cast.flat._jdf)  # noqa: SLF001
    packed, rows = fit(df), fit(df, delivery="spark")
    got, want = packed.module.state_dict(), rows.module.state_dict()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=0, rtol=0, msg=key)
    df.unpersist()
