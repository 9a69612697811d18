"""sparkdl.run: custom loops on every rank, with the world, the communicator and the batches."""
from __future__ import annotations

import torch
from torch import nn

import sparkdl
from sparkdl import TorchEstimator


def test_run_without_a_dataframe_returns_rank_zeros_value(spark) -> None:  # type: ignore[no-untyped-def]
    def train_fn(ctx):  # type: ignore[no-untyped-def]
        total = torch.tensor([float(ctx.rank + 1)])
        ctx.comm.allreduce(total)
        world = ctx.comm.allgather_object((ctx.rank, ctx.local_rank, ctx.world.local_size, ctx.world.hosts))
        return {"sum": total.item(), "world": world, "size": ctx.world_size}

    result = sparkdl.run(train_fn, num_workers=2)
    assert result["sum"] == 3.0
    assert result["size"] == 2
    ranks = sorted(result["world"])
    # Both executors of local-cluster live on this host: the two ranks must get distinct local ranks.
    assert [r[1] for r in ranks] == [0, 1]
    assert all(r[2] == 2 for r in ranks)


def test_a_model_larger_than_one_result_chunk_comes_back(spark) -> None:  # type: ignore[no-untyped-def]
    from sparkdl.wire.codec import RESULT_CHUNK_BYTES

    width = RESULT_CHUNK_BYTES // (4 * 4) + 1000  # Linear(4, width): > one chunk of float32 weights
    df = spark.createDataFrame([(float(i), float(-i), float(i % 3), float(i % 5), i % 2) for i in range(16)],
                               ["a", "b", "c", "d", "label"])
    model = TorchEstimator(model=lambda: nn.Sequential(nn.Linear(4, width), nn.Linear(width, 2)),
                           feature_cols=["a", "b", "c", "d"], label_col="label", optimizer="sgd", lr=0.01,
                           batch_size=8, epochs=1, num_workers=2).fit(df)
    module = model.torch_module()
    total = sum(p.numel() * p.element_size() for p in module.parameters())
    assert total > RESULT_CHUNK_BYTES
    assert torch.isfinite(module[0].weight).all()


def test_strategy_options_do_not_break_a_custom_loop(spark) -> None:  # type: ignore[no-untyped-def]
    import sparkdl

    assert sparkdl.run(lambda ctx: ctx.world_size, num_workers=2, strategy="auto", progress=False) == 2


def test_features_keep_column_order_across_scalar_array_and_vector_columns(spark) -> None:  # type: ignore[no-untyped-def]
    from pyspark.ml.linalg import Vectors, VectorUDT
    from pyspark.sql import types as T

    from sparkdl.data.feed import features_expression

    schema = T.StructType([T.StructField("a", T.DoubleType()), T.StructField("b", T.ArrayType(T.DoubleType())),
                           T.StructField("c", T.IntegerType()), T.StructField("d", T.FloatType()),
                           T.StructField("v", VectorUDT()), T.StructField("e", T.DoubleType())])
    df = spark.createDataFrame([(1.0, [2.0, 3.0], 4, 5.5, Vectors.dense([6.0, 7.0]), 8.0)], schema)
    cols = ["a", "b", "c", "d", "v", "e"]
    row = df.select(features_expression(df, cols).alias("x")).first()
    assert row.x == [1.0, 2.0, 3.0, 4.0, 5.5, 6.0, 7.0, 8.0]
    assert df.select(features_expression(df, ["c", "a"]).alias("x")).first().x == [4.0, 1.0]


def test_odd_column_names_are_quoted_everywhere(spark) -> None:  # type: ignore[no-untyped-def]
    from sparkdl.data.feed import prepare

    df = spark.createDataFrame([(1.0, [2.0, float("nan")], 1), (4.0, [5.0, 6.0], 0)],
                               "`a.b` double, `c d` array<double>, `l`` x` int")
    prepared = prepare(df, ["a.b", "c d"], "l` x", classification=True, num_workers=1, on_invalid="skip")
    assert prepared.num_rows == 1 and prepared.dropped_rows == 1
    row = prepared.df.collect()[0]
    assert list(row[0]) == [4.0, 5.0, 6.0] and row[1] == 0


def _streaming_loop(ctx):  # type: ignore[no-untyped-def]
    """Reads epoch 0 as it streams, then again, then epoch 1, and reports what each rank saw."""
    import time

    from pyspark.taskcontext import BarrierTaskContext

    def labels(batches):  # type: ignore[no-untyped-def]
        return [int(v) for _, y in batches for v in y]

    started = time.perf_counter()
    first = next(ctx.batches(0))  # the rows are still arriving: the first batch does not wait for the rest
    first_s = time.perf_counter() - started
    phases_before = set(ctx.task_phases)
    streamed = labels(ctx.batches(0))
    again = labels(ctx.batches(0))  # the same batches, from the spool
    later = labels(ctx.batches(1))
    # The loop's own Spark barrier calls do not collide with the rendezvous's allGather.
    BarrierTaskContext.get().barrier()
    gathered = BarrierTaskContext.get().allGather(str(ctx.rank))
    return ctx.comm.allgather_object({"rows": ctx.num_rows, "first": len(first[0]), "first_s": first_s,
                                      "streamed": streamed, "again": again, "later": later,
                                      "spool_s": ctx.spool_seconds, "phases_before": sorted(phases_before),
                                      "phases": ctx.task_phases, "gathered": sorted(gathered)})


def test_a_custom_loop_streams_epoch_one_and_replays_it_from_the_spool(spark) -> None:  # type: ignore[no-untyped-def]
    df = spark.range(0, 4000, 1, 2).selectExpr("cast(id as float) as a", "cast(id % 7 as float) as b",
                                               "cast(id as long) as label")
    ranks = sparkdl.run(_streaming_loop, df=df, num_workers=2, feature_cols=["a", "b"], label_col="label",
                        batch_size=64, shuffle=True, progress=False)
    assert sum(r["rows"] for r in ranks) == 4000
    seen = []
    for r in ranks:
        assert r["first"] == 64
        assert r["again"] == r["streamed"] and sorted(r["later"]) == sorted(r["streamed"]) != r["later"]
        assert len(set(r["streamed"])) == r["rows"]
        seen += r["streamed"]
        assert r["spool_s"] > 0 and r["gathered"] == ["0", "1"]
        # Spark's delivery was timed before the loop's first batch; the other phases as they ended.
        assert {"delivery", "memory_reset", "rendezvous", "communicator"} <= set(r["phases_before"])
        assert {"conversion", "spool_write"} <= set(r["phases"])
    assert sorted(seen) == list(range(4000))


def test_a_custom_loop_that_shuts_its_backend_down_still_returns(spark) -> None:  # type: ignore[no-untyped-def]
    def train_fn(ctx):  # type: ignore[no-untyped-def]
        import torch.distributed as dist

        total = torch.tensor([1.0])
        ctx.comm.allreduce(total)
        dist.destroy_process_group()  # as a script ending with hvd.shutdown() or destroy_process_group()
        return total.item()

    assert sparkdl.run(train_fn, num_workers=2, progress=False) == 2.0
