"""Ingest benchmark: how fast a worker spools Spark's Arrow batches and replays them per epoch.

Part A (always, no Spark): 2 ranks' halves of N rows x D float32 features as 10,000-row list<float>
record batches, as Spark sends them. Per rank: spool write rows/s (epoch 1), shuffled epoch rows/s
from the spool (epochs 2+), and the same epoch from an Arrow table already in memory (the
in-memory limit). The target is spool/in-memory >= 0.5.

Part B (--spark): the same shape generated in Spark (cached first), fed through
mapInArrow(barrier=True) on local[2]; each task spools its iterator (epoch 1) and replays it
(epochs 2+). A job that only consumes Spark's batches shows what delivery alone costs.

Prints one JSON object. Figures are medians over --repeats (part B: --spark-rounds jobs, each
replaying --repeats epochs); nothing here asserts a timing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sparkdl.data.batches import Spool, last_batch_size, steps_per_epoch, table_batches  # noqa: E402
from sparkdl.data.layout import FEATURES_COLUMN, FeedLayout  # noqa: E402

SPARK_BATCH_ROWS = 10_000  # spark.sql.execution.arrow.maxRecordsPerBatch default


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows in all (split over 2 ranks)")
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-mb", type=int, default=64, help="spool chunk size")
    parser.add_argument("--spark", action="store_true", help="also run part B through Spark")
    parser.add_argument("--spark-rounds", type=int, default=2, help="part B: spool/deliver job pairs")
    args = parser.parse_args()
    if min(args.repeats, args.spark_rounds, args.rows, args.features, args.batch_size) < 1:
        parser.error("--rows, --features, --batch-size, --repeats and --spark-rounds must be >= 1")
    return args


def median_rate(rows: int, seconds: list[float]) -> float:
    return round(rows / statistics.median(seconds), 1)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def drain(batches: Iterator[tuple[Any, Any]]) -> float:
    """Consume an epoch, touching every batch so lazily produced data is really read."""
    total = 0.0
    for features, _ in batches:
        total += float(features[-1, -1])
    return total


def epoch_options(counts: list[int], batch_size: int, rank: int) -> dict[str, Any]:
    return dict(batch_size=batch_size, steps=steps_per_epoch(counts, batch_size, drop_last=False),
                last_batch_size=last_batch_size(counts, batch_size, drop_last=False), seed=0,
                rank=rank, drop_last=False)


# ------------------------------------------------------------------------------------ part A


def spark_like_batches(rows: int, width: int, seed: int) -> list[pa.RecordBatch]:
    rng = np.random.default_rng(seed)
    batches = []
    for start in range(0, rows, SPARK_BATCH_ROWS):
        n = min(SPARK_BATCH_ROWS, rows - start)
        values = pa.array(rng.random(n * width, dtype=np.float32))
        offsets = pa.array(np.arange(0, (n + 1) * width, width, dtype=np.int32))
        batches.append(pa.record_batch({FEATURES_COLUMN: pa.ListArray.from_arrays(offsets, values)}))
    return batches


def in_memory_table(batches: list[pa.RecordBatch], width: int) -> pa.Table:
    values = pa.concat_arrays([b.column(0).flatten() for b in batches])
    features = pa.FixedSizeListArray.from_arrays(values, width)
    return pa.table({FEATURES_COLUMN: features})


def bench_rank(rank: int, counts: list[int], batches: list[pa.RecordBatch], layout: FeedLayout,
               args: argparse.Namespace, directory: str) -> dict[str, Any]:
    rows = counts[rank]
    options = epoch_options(counts, args.batch_size, rank)
    table = in_memory_table(batches, layout.num_features)
    write_s: list[float] = []
    for repeat in range(args.repeats):  # epoch 1: consume the input into a fresh spool
        seconds, spool = timed(lambda: Spool.write(iter(batches), layout, directory,
                                                   chunk_bytes=args.chunk_mb << 20))
        write_s.append(seconds)
        if repeat < args.repeats - 1:
            spool.close()
    shuffled_s, in_order_s, memory_s = [], [], []
    # Epochs 2+ replay the last spool, as training does, alternating with the in-memory runs so
    # that both see the same machine.
    with spool:
        chunks = spool.chunk_count
        for epoch in range(2, 2 + args.repeats):
            shuffled_s.append(timed(lambda: drain(spool.batches(epoch, shuffle=True, **options)))[0])
            memory_s.append(timed(lambda: drain(table_batches(table, layout, epoch, shuffle=True,
                                                              **options)))[0])
            in_order_s.append(timed(lambda: drain(spool.batches(epoch, shuffle=False, **options)))[0])
    epoch_rows = (options["steps"] - 1) * args.batch_size + options["last_batch_size"]
    spool_rate, memory_rate = median_rate(epoch_rows, shuffled_s), median_rate(epoch_rows, memory_s)
    return {
        "rank": rank,
        "rows": rows,
        "steps_per_epoch": options["steps"],
        "spool_chunks": chunks,
        "spool_write_rows_per_s": median_rate(rows, write_s),
        "spool_epoch_shuffled_rows_per_s": spool_rate,
        "spool_epoch_in_order_rows_per_s": median_rate(epoch_rows, in_order_s),
        "in_memory_epoch_shuffled_rows_per_s": memory_rate,
        "ratio_spool_to_in_memory": round(spool_rate / memory_rate, 3),
    }


def part_a(args: argparse.Namespace) -> dict[str, Any]:
    layout = FeedLayout(num_features=args.features, label_dtype=None)
    counts = [args.rows // 2, args.rows - args.rows // 2]
    ranks = []
    with tempfile.TemporaryDirectory(prefix="sparkdl-ingest-") as directory:
        for rank, rows in enumerate(counts):
            batches = spark_like_batches(rows, args.features, seed=rank)
            ranks.append(bench_rank(rank, counts, batches, layout, args, directory))
    worst = min(r["ratio_spool_to_in_memory"] for r in ranks)
    return {"ranks": ranks, "min_ratio_spool_to_in_memory": worst, "target_ratio": 0.5,
            "meets_target": worst >= 0.5}


# ------------------------------------------------------------------------------------ part B


def part_b(args: argparse.Namespace) -> dict[str, Any]:
    # Executors must run this Python and import this checkout.
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    spark = (SparkSession.builder.master("local[2]").appName("sparkdl-ingest-bench")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.memory", "4g").getOrCreate())
    layout = FeedLayout(num_features=args.features, label_dtype=None)
    runs: dict[int, dict[str, list[float]]] = {}
    try:
        columns = [F.rand(seed=i).cast("float").alias(f"f{i}") for i in range(args.features)]
        df = (spark.range(args.rows).select(*columns)
              .select(F.array(*[f"f{i}" for i in range(args.features)]).alias(FEATURES_COLUMN))
              .repartition(2).cache())
        generate_s, _ = timed(df.count)  # materialise once: epoch 1 then times Arrow delivery only
        deliver = df.mapInArrow(_deliver_task, _DELIVER_SCHEMA, barrier=True)
        spool = df.mapInArrow(_spooling_task(layout, args.batch_size, args.repeats), _SPOOL_SCHEMA,
                              barrier=True)
        deliver.collect()  # warms the JVM's Arrow path and the Python workers
        for _ in range(args.spark_rounds):  # alternated, so both jobs see the same machine
            for row in [*spool.collect(), *deliver.collect()]:
                for key, value in row.asDict().items():
                    runs.setdefault(row.rank, {}).setdefault(key, []).append(value)
    finally:
        spark.stop()
    ranks = [{"rank": rank, "rows": int(r["rows"][0]), "steps_per_epoch": int(r["steps_per_epoch"][0]),
              "epoch1_spool_rows_per_s": median_rate(int(r["rows"][0]), r["epoch1_s"]),
              "deliver_only_rows_per_s": median_rate(int(r["rows"][0]), r["deliver_s"]),
              "epochN_shuffled_rows_per_s": round(statistics.median(r["epochN_rows_per_s"]), 1)}
             for rank, r in sorted(runs.items())]
    return {"master": "local[2]", "rounds": args.spark_rounds,
            "generate_and_cache_s": round(generate_s, 2), "ranks": ranks}


_SPOOL_SCHEMA = "rank int, rows long, steps_per_epoch int, epoch1_s double, epochN_rows_per_s double"
_DELIVER_SCHEMA = "rank int, deliver_s double"


def _spooling_task(layout: FeedLayout, batch_size: int, epochs: int
                   ) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import BarrierTaskContext

        context = BarrierTaskContext.get()
        rank = context.partitionId()
        with tempfile.TemporaryDirectory(prefix="sparkdl-spool-") as directory:
            epoch1_s, spool = timed(lambda: Spool.write(batches, layout, directory))
            with spool:
                # Every rank needs every rank's row count to agree on the step count.
                counts = [int(c) for c in context.allGather(str(spool.num_rows))]
                options = epoch_options(counts, batch_size, rank)
                seconds = [timed(lambda e=e: drain(spool.batches(e, shuffle=True, **options)))[0]
                           for e in range(2, 2 + epochs)]
                epoch_rows = (options["steps"] - 1) * batch_size + options["last_batch_size"]
                result = {"rank": [rank], "rows": [spool.num_rows], "steps_per_epoch": [options["steps"]],
                          "epoch1_s": [epoch1_s], "epochN_rows_per_s": [median_rate(epoch_rows, seconds)]}
        yield pa.RecordBatch.from_pydict(result, schema=_arrow_schema(_SPOOL_SCHEMA))

    return task


def _deliver_task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Reference: consume Spark's batches without spooling, to show what the spool adds."""
    from pyspark import BarrierTaskContext

    start = time.perf_counter()
    for _ in batches:
        pass
    seconds = time.perf_counter() - start
    yield pa.RecordBatch.from_pydict({"rank": [BarrierTaskContext.get().partitionId()],
                                      "deliver_s": [seconds]}, schema=_arrow_schema(_DELIVER_SCHEMA))


def _arrow_schema(ddl: str) -> pa.Schema:
    types = {"int": pa.int32(), "long": pa.int64(), "double": pa.float64()}
    return pa.schema([(name, types[kind]) for name, kind in (f.split() for f in ddl.split(", "))])


def main() -> None:
    args = parse_args()
    report: dict[str, Any] = {
        "benchmark": "ingest",
        "rows": args.rows, "features": args.features, "batch_size": args.batch_size,
        "repeats": args.repeats, "chunk_mb": args.chunk_mb, "input_batch_rows": SPARK_BATCH_ROWS,
        "cpus": os.cpu_count(),
    }
    started = time.perf_counter()
    report["part_a"] = part_a(args)
    if args.spark:
        report["part_b"] = part_b(args)
    report["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
