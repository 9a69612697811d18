"""sparkdl.compat.TorchDistributor against PySpark's own TorchDistributor, side by side in one session.

Three figures, each the median over --repeats rounds (the two distributors alternate within a round,
in a rotating order, so drift hits both alike):
  launch_s        wall time of `.run(noop)` with local_mode=False, num_processes=2: the barrier job,
                  each rank's process start and the result back (PySpark: torchrun's agent and worker,
                  its log server's 1 s wait; sparkdl: one child interpreter per task)
  pyspark_loader  epoch-1 rows/s of pyspark's `_get_spark_partition_data_loader` inside a
                  `_train_on_dataframe` function (rank 0 times one pass over its partition), under
                  PySpark's distributor and under sparkdl's
  fast_path       the same pass through `sparkdl.compat.partition_batches` (sparkdl's distributor)
Targets (issue 42): launch ratio sparkdl/PySpark <= 0.5; PySpark's loader under sparkdl at least as
fast as under PySpark (ratio ~1, within the machine's noise); the fast path >= 10x PySpark's loader.

Prints one JSON object as the last line of stdout (the load average before and after is in it: this
machine is shared). Nothing here asserts a timing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def noop() -> int:
    return 0


def time_pyspark_loader(batch_size: int) -> dict[str, float]:
    from pyspark.ml.torch.distributor import _get_spark_partition_data_loader

    from sparkdl.compat import partition_table

    rows = partition_table().num_rows  # outside the timed pass, as the fast path's torch import below
    started = time.perf_counter()
    seen = sum(len(batch[0]) for batch in _get_spark_partition_data_loader(rows, batch_size, num_workers=0))
    return {"rows": seen, "rows_per_s": seen / (time.perf_counter() - started)}


def time_fast_path(batch_size: int) -> dict[str, float]:
    import torch  # noqa: F401 - imported before the clock starts, as pyspark's loader imports it above

    from sparkdl.compat import partition_batches

    started = time.perf_counter()
    seen = sum(len(batch[0]) for batch in partition_batches(batch_size))
    return {"rows": seen, "rows_per_s": seen / (time.perf_counter() - started)}


def timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", default="local-cluster[2,1,1024]")
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--width", type=int, default=16, help="floats per row's feature array")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark import cloudpickle
    from pyspark.ml.torch.distributor import TorchDistributor as PySparkTorchDistributor
    from pyspark.sql import SparkSession, functions as F

    from sparkdl.compat import TorchDistributor

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # both ship this module's functions
    load_before = os.getloadavg()
    spark = (SparkSession.builder.master(args.master).appName("sparkdl-compat-bench")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    df = (spark.range(args.rows, numPartitions=2)
          .select(F.array(*[(F.col("id") * (i + 1) % 97).cast("double") for i in range(args.width)]).alias("features"),
                  (F.col("id") % 10).cast("long").alias("label")).cache())
    df.count()
    ours = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, tracking=False)
    theirs = PySparkTorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
    ours.run(noop)  # both warm the executors' Python workers once before anything is timed
    theirs.run(noop)
    rounds: dict[str, list[float]] = {k: [] for k in ("launch_sparkdl", "launch_pyspark", "loader_under_sparkdl",
                                                      "loader_under_pyspark", "fast_path")}
    for round_ in range(args.repeats):
        steps: list[tuple[str, Callable[[], float]]] = [
            ("launch_sparkdl", lambda: timed(lambda: ours.run(noop))),
            ("launch_pyspark", lambda: timed(lambda: theirs.run(noop))),
            ("loader_under_sparkdl", lambda: ours._train_on_dataframe(time_pyspark_loader, df, args.batch_size)["rows_per_s"]),
            ("loader_under_pyspark", lambda: theirs._train_on_dataframe(time_pyspark_loader, df, args.batch_size)["rows_per_s"]),
            ("fast_path", lambda: ours._train_on_dataframe(time_fast_path, df, args.batch_size)["rows_per_s"]),
        ]
        shift = round_ % len(steps)
        for name, step in steps[shift:] + steps[:shift]:
            rounds[name].append(step())
        print(json.dumps({"round": round_, **{k: v[-1] for k, v in rounds.items()}}), file=sys.stderr)
    median = {k: statistics.median(v) for k, v in rounds.items()}
    result = {
        "benchmark": "compat", "master": args.master, "rows": args.rows, "width": args.width,
        "batch_size": args.batch_size, "repeats": args.repeats, "cpus": os.cpu_count(),
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "median": median, "rounds": rounds,
        "launch_ratio_sparkdl_over_pyspark": median["launch_sparkdl"] / median["launch_pyspark"],
        "pyspark_loader_ratio_under_sparkdl": median["loader_under_sparkdl"] / median["loader_under_pyspark"],
        "fast_path_over_pyspark_loader": median["fast_path"] / median["loader_under_pyspark"],
        "targets": {"launch_ratio_max": 0.5, "pyspark_loader_ratio_min": 1.0, "fast_path_ratio_min": 10.0},
    }
    spark.stop()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
