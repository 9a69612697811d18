"""Delivery benchmark (issue 20, part 3): how fast the rows of a Parquet table reach a rank as the
numpy block training reads, for each way sparkdl could deliver them, side by side in one run.

One table of --rows x --features float32 columns plus an int64 label, written to Parquet once;
local[2], 2 ranks, one barrier job per candidate and round:
  spark_array     today's path through Spark: sparkdl's feature expression (one array<float>)
                  delivered by mapInArrow from the Parquet scan, viewed as a (rows, features) block
  spark_cached    the same column from Spark's cache (the scan and the array built beforehand)
  jvm_packed      (a) the array packed on the JVM into one binary column of little-endian float32
                  (ai.sparkdl.bridge.PackFloat32, a Java UDF) and viewed with numpy.frombuffer
  direct_parquet  (c) each rank reads its range of the files with pyarrow (data/parquet_shards.py)
(b), spark.sql.execution.arrow.maxRecordsPerBatch, was measured with benchmarks/streaming.py.

Every figure is rows/s per rank (rows / the task's own seconds, the median over ranks and rounds)
and rows/s of the whole job (all rows / the job's wall time, launch included); ratios against
spark_array are medians of per-round ratios. Prints one JSON object; asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pyarrow as pa

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WORLD = 2
RESULT = "rows long, seconds double"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--candidates", default="spark_array,spark_cached,jvm_packed,direct_parquet")
    args = parser.parse_args()
    if min(args.rows, args.features, args.repeats) < 1:
        parser.error("--rows, --features and --repeats must be >= 1")
    return args


def session() -> Any:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    from sparkdl.spark.jvm import session_options

    builder = (SparkSession.builder.master(f"local[{WORLD}]").appName("sparkdl-delivery")
               .config("spark.driver.memory", "4g").config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false"))
    for key, value in session_options().items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


def write_table(spark: Any, rows: int, features: int, directory: str) -> list[str]:
    from pyspark.sql import functions as F

    names = [f"f{i:02d}" for i in range(features)]
    cols = [F.rand(7 + i).cast("float").alias(name) for i, name in enumerate(names)]
    spark.range(0, rows, 1, WORLD).select(*cols, (F.abs(F.hash("id")) % 10).cast("long").alias("label")) \
        .write.mode("overwrite").parquet(directory)
    return names


def timed_task(consume: Callable[[Iterator[pa.RecordBatch]], int]) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        started = time.perf_counter()
        rows = consume(batches)
        yield pa.RecordBatch.from_pydict({"rows": [rows], "seconds": [time.perf_counter() - started]})
    return task


def array_rows(width: int) -> Callable[[Iterator[pa.RecordBatch]], int]:
    """The (rows, width) float32 block of each batch's list column, as the spool sees it."""
    def consume(batches: Iterator[pa.RecordBatch]) -> int:
        rows = 0
        for batch in batches:
            values = batch.column(0).values.to_numpy(zero_copy_only=False)
            rows += values.reshape(-1, width).shape[0]
        return rows
    return consume


def packed_rows(width: int) -> Callable[[Iterator[pa.RecordBatch]], int]:
    """One binary column of width * 4 bytes per row: numpy views its data buffer without copying."""
    def consume(batches: Iterator[pa.RecordBatch]) -> int:
        rows = 0
        for batch in batches:
            column = batch.column(0)
            offsets = np.frombuffer(column.buffers()[1], np.int32, len(column) + 1, column.offset * 4)
            data = np.frombuffer(column.buffers()[2], np.float32, (offsets[-1] - offsets[0]) // 4, offsets[0])
            rows += data.reshape(-1, width).shape[0]
        return rows
    return consume


def direct_rows(shards: Any, layout: Any) -> Callable[[Iterator[pa.RecordBatch]], int]:
    def consume(batches: Iterator[pa.RecordBatch]) -> int:
        from pyspark.taskcontext import BarrierTaskContext

        from sparkdl.data.arrow_rows import incoming_arrays
        from sparkdl.data.parquet_shards import shard_batches

        for _ in batches:
            pass
        rank = BarrierTaskContext.get().partitionId()
        return sum(len(incoming_arrays(b, layout)[0]) for b in shard_batches(shards, rank, layout))
    return consume


def candidates(spark: Any, directory: str, names: list[str]) -> dict[str, Callable[[], list[Any]]]:
    from sparkdl.data.feed import features_expression
    from sparkdl.data.layout import FeedLayout
    from sparkdl.data.parquet_shards import ParquetShards, SourceColumn, assign_pieces
    from sparkdl.data.parquet_source import scan_row_groups

    width = len(names)
    scan = spark.read.parquet(directory)
    array_df = scan.select(features_expression(scan, names).alias("features"), "label")
    cached = array_df.cache()
    cached.count()
    spark.udf.registerJavaFunction("sparkdl_pack_f32", "ai.sparkdl.bridge.PackFloat32", "binary")
    packed_df = array_df.selectExpr("sparkdl_pack_f32(features) AS features", "label")
    groups = scan_row_groups(scan, names + ["label"])
    shards = ParquetShards(tuple(SourceColumn(n) for n in names), "label", None, assign_pieces(groups, WORLD),
                           len({path for path, _, _ in groups}))
    layout = FeedLayout(num_features=width, label_dtype="int64")
    placeholder = spark.range(0, WORLD, 1, WORLD)

    def job(df: Any, consume: Callable[[Iterator[pa.RecordBatch]], int]) -> Callable[[], list[Any]]:
        return lambda: df.mapInArrow(timed_task(consume), RESULT, barrier=True).collect()

    return {"spark_array": job(array_df, array_rows(width)), "spark_cached": job(cached, array_rows(width)),
            "jvm_packed": job(packed_df, packed_rows(width)), "direct_parquet": job(placeholder, direct_rows(shards, layout))}


def main() -> None:
    args = parse_args()
    load_before = os.getloadavg()
    spark = session()
    directory = tempfile.mkdtemp(prefix="sparkdl-delivery-")
    names = write_table(spark, args.rows, args.features, directory)
    jobs = candidates(spark, directory, names)
    chosen = [c.strip() for c in args.candidates.split(",") if c.strip() in jobs]
    for name in chosen:  # Python workers, imports and the JIT once per candidate, unrecorded
        jobs[name]()
    per_rank: dict[str, list[float]] = {n: [] for n in chosen}
    whole: dict[str, list[float]] = {n: [] for n in chosen}
    rounds: list[dict[str, float]] = []
    for _ in range(args.repeats):
        figures = {}
        for name in chosen:
            started = time.perf_counter()
            results = jobs[name]()
            wall = time.perf_counter() - started
            rows = sum(r.rows for r in results)
            if rows != args.rows:
                raise SystemExit(f"{name} delivered {rows} rows, expected {args.rows}")
            per_rank[name] += [r.rows / r.seconds for r in results]
            whole[name].append(rows / wall)
            figures[name] = statistics.median(r.rows / r.seconds for r in results)
        rounds.append(figures)
    spark.stop()
    ratios = {f"{name} / spark_array": statistics.median(r[name] / r["spark_array"] for r in rounds)
              for name in chosen if name != "spark_array" and "spark_array" in chosen}
    print(json.dumps({"benchmark": "delivery", "rows": args.rows, "features": args.features, "ranks": WORLD,
                      "repeats": args.repeats,
                      "rows_per_s_per_rank": {n: round(statistics.median(v)) for n, v in per_rank.items()},
                      "rows_per_s_job": {n: round(statistics.median(v)) for n, v in whole.items()},
                      "ratios_per_rank": {k: round(v, 2) for k, v in ratios.items()},
                      "loadavg_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]}))


if __name__ == "__main__":
    main()
