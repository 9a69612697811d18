"""Epoch 1 while the partition streams in (issue 20), through the public API on a real Spark session.

    .venv/bin/python benchmarks/streaming.py [--master local[2]] [--rows-per-rank 250000,1000000]
        [--features 64] [--repeats 3] [--overlap-rows 200000] [--hidden 1024]

time_to_first_step: for each --rows-per-rank, a cached DataFrame of that many rows x --features float
columns per rank (2 ranks, kept partitioning: no shuffle; --source parquet: a Parquet scan the ranks
read directly), side by side in one run:
  streamed: TorchEstimator.fit, 1 epoch (spool "auto" = "none"): the history's time_to_first_step_s
            (task start -> end of the first step) and spool_seconds (task start -> last row in);
  spooled:  what every fit did before: sparkdl.run, whose ranks spool the whole partition first;
            its train_fn takes one batch and returns the same two figures.
Target: streamed time to first step <= 3 s and independent of the partition size.

epoch_overlap: one rank (one torch thread) and a compute-heavy MLP (--hidden), --overlap-rows rows:
  delivery alone: sparkdl.run spooling the partition, nothing else (spool_seconds);
  compute alone:  epoch 2 of the streamed fit (rows from the spool's page cache);
  epoch 1:        epoch 1 of the same fit, training while the rows arrive.
Target: epoch 1 <= 1.15 x max(delivery alone, compute alone), where spooling first costs their sum.

delivery: Spark's own Arrow delivery of today's features column into a barrier stage, rows/s per
rank, for each --delivery-batch-rows value of spark.sql.execution.arrow.maxRecordsPerBatch.

Medians over --repeats. Prints one JSON object (with os.getloadavg() before and after) as the last
line. Nothing here asserts a timing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


SOURCE = {"kind": "cached", "dir": ""}


def dataframe(spark: Any, rows_per_rank: int, features: int, ranks: int) -> Any:
    """The rows cached in Spark's memory, or (--source parquet) written to Parquet once and read back
    uncached: the ranks then read their rows directly (data.delivery='auto')."""
    from pyspark.sql import functions as F

    columns = [F.rand(i).cast("float").alias(f"f{i}") for i in range(features)]
    df = spark.range(0, rows_per_rank * ranks, 1, ranks).select(*columns, (F.col("id") % 10).cast("int").alias("label"))
    if SOURCE["kind"] == "parquet":
        import tempfile

        path = tempfile.mkdtemp(prefix="streaming-", dir=SOURCE["dir"] or None)
        df.write.mode("overwrite").parquet(path)
        return spark.read.parquet(path)
    df = df.cache()
    df.count()
    return df


def mlp(features: int, hidden: int) -> Any:
    from torch import nn

    return lambda: nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 10))


SHUFFLE = {"on": True}


def streamed(df: Any, features: int, ranks: int, epochs: int = 1, hidden: int = 32,
             threads: int | None = None) -> list[dict[str, Any]]:
    from sparkdl import TorchEstimator

    options: dict[str, Any] = {"threads_per_worker": threads} if threads else {}
    options["shuffle"] = SHUFFLE["on"]
    model = TorchEstimator(model=mlp(features, hidden), feature_cols=[f"f{i}" for i in range(features)],
                           label_col="label", epochs=epochs, batch_size=256, num_workers=ranks,
                           strategy="data_parallel", optimizer="sgd", lr=0.01, tracking=False, progress=False,
                           **options).fit(df)
    return model.history


def first_batch(ctx: Any) -> dict[str, float]:
    next(iter(ctx.batches(0)))
    return {"time_to_first_step_s": time.perf_counter() - ctx.task_started, "spool_seconds": ctx.spool_seconds}


def spooled(df: Any, features: int, ranks: int) -> dict[str, float]:
    import sparkdl

    return sparkdl.run(first_batch, df=df, num_workers=ranks, feature_cols=[f"f{i}" for i in range(features)],
                       label_col="label", batch_size=256, progress=False)


def median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def time_to_first_step(spark: Any, sizes: list[int], features: int, repeats: int) -> list[dict[str, Any]]:
    out = []
    for rows in sizes:
        df = dataframe(spark, rows, features, 2)
        # Spark retires a Python worker idle for a minute (writing 20M rows takes longer): a fresh one
        # pays for importing torch (and torch._dynamo on the first optimizer), which is not the data path.
        streamed(dataframe(spark, 1000, features, 2), features, 2)
        runs: dict[str, list[float]] = {k: [] for k in ("streamed_ttfs", "streamed_spool", "spooled_ttfs",
                                                        "spooled_spool")}
        for _ in range(repeats):  # alternating, so that load drifts hit both alike
            record = streamed(df, features, 2)[0]
            runs["streamed_ttfs"].append(record["time_to_first_step_s"])
            runs["streamed_spool"].append(record["spool_seconds"])
            before = spooled(df, features, 2)
            runs["spooled_ttfs"].append(before["time_to_first_step_s"])
            runs["spooled_spool"].append(before["spool_seconds"])
        df.unpersist()
        out.append({"rows_per_rank": rows, "features": features,
                    "streamed_time_to_first_step_s": median(runs["streamed_ttfs"]),
                    "streamed_partition_in_s": median(runs["streamed_spool"]),
                    "spooled_first_time_to_first_step_s": median(runs["spooled_ttfs"]),
                    "spooled_first_spool_s": median(runs["spooled_spool"])})
        print(json.dumps(out[-1]), flush=True)
    return out


def epoch_overlap(spark: Any, rows: int, features: int, hidden: int, repeats: int) -> dict[str, Any]:
    df = dataframe(spark, rows, features, 1)
    delivery, compute, epoch1 = [], [], []
    for _ in range(repeats):
        delivery.append(spooled(df, features, 1)["spool_seconds"])
        history = streamed(df, features, 1, epochs=2, hidden=hidden, threads=1)
        epoch1.append(history[0]["seconds"])
        compute.append(history[1]["seconds"])
    df.unpersist()
    d, c, e = median(delivery), median(compute), median(epoch1)
    return {"rows": rows, "hidden": hidden, "delivery_alone_s": d, "compute_alone_s": c, "epoch1_s": e,
            "sum_s": round(d + c, 3), "epoch1_over_max": round(e / max(d, c), 3), "target_ratio": 1.15}


def _consume(batches: Any) -> Any:
    import pyarrow as pa

    started, rows = time.perf_counter(), 0
    for batch in batches:
        rows += batch.num_rows
    yield pa.RecordBatch.from_pydict({"rows": [rows], "seconds": [time.perf_counter() - started]})


def delivery(spark: Any, rows_per_rank: int, features: int, batch_rows: list[int], repeats: int) -> dict[str, Any]:
    """Spark's own Arrow delivery of today's features column (one array<float>) into a barrier
    stage, per spark.sql.execution.arrow.maxRecordsPerBatch: rows/s per rank."""
    from pyspark.sql import functions as F

    df = dataframe(spark, rows_per_rank, features, 2)
    features_col = df.select(F.array(*[f"f{i}" for i in range(features)]).alias("features")).cache()
    features_col.count()
    key = "spark.sql.execution.arrow.maxRecordsPerBatch"
    previous = spark.conf.get(key)
    rates: dict[int, list[float]] = {n: [] for n in batch_rows}
    try:
        for _ in range(repeats):
            for n in batch_rows:  # alternating
                spark.conf.set(key, str(n))
                got = features_col.mapInArrow(_consume, "rows long, seconds double", barrier=True).collect()
                rates[n].append(statistics.median(r["rows"] / r["seconds"] for r in got))
    finally:
        spark.conf.set(key, previous)
        features_col.unpersist(), df.unpersist()
    return {"rows_per_rank": rows_per_rank, "features": features,
            "rows_per_s_per_rank": {str(n): round(statistics.median(v)) for n, v in rates.items()}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--rows-per-rank", default="250000,1000000")
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--overlap-rows", type=int, default=200_000)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--skip-overlap", action="store_true")
    parser.add_argument("--skip-first-step", action="store_true")
    parser.add_argument("--no-shuffle", action="store_true", help="shuffle=False in every fit")
    parser.add_argument("--source", choices=("cached", "parquet"), default="cached",
                        help="time to first step and overlap: a cached DataFrame, or a Parquet scan read directly")
    parser.add_argument("--delivery-batch-rows", default="10000,50000,200000",
                        help="maxRecordsPerBatch values to compare Spark's delivery under ('' = skip)")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.rows_per_rank.split(",") if s]
    if not sizes or min(sizes) < 1 or min(args.features, args.repeats, args.overlap_rows, args.hidden) < 1:
        parser.error("--rows-per-rank, --features, --repeats, --overlap-rows and --hidden must be >= 1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(args.master).appName("sparkdl-bench-streaming")
             .config("spark.driver.memory", "8g").config("spark.ui.enabled", "false").getOrCreate())
    SHUFFLE["on"] = not args.no_shuffle
    SOURCE["kind"] = args.source
    load_before = os.getloadavg()
    streamed(dataframe(spark, 1000, args.features, 2), args.features, 2)  # warm-up: workers, imports, calibration
    result: dict[str, Any] = {"benchmark": "streaming", "master": args.master, "repeats": args.repeats,
                              "shuffle": SHUFFLE["on"], "source": args.source}
    if not args.skip_first_step:
        result["time_to_first_step"] = time_to_first_step(spark, sizes, args.features, args.repeats)
    batch_rows = [int(n) for n in args.delivery_batch_rows.split(",") if n]
    if batch_rows:
        result["delivery"] = delivery(spark, max(sizes), args.features, batch_rows, args.repeats)
        print(json.dumps(result["delivery"]), flush=True)
    if not args.skip_overlap:
        result["epoch_overlap"] = epoch_overlap(spark, args.overlap_rows, args.features, args.hidden, args.repeats)
    result["load_before"], result["load_after"] = [round(x, 2) for x in load_before], \
        [round(x, 2) for x in os.getloadavg()]
    spark.stop()
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
