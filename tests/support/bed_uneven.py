"""Driver script of the uneven-hosts bed test (tests/spark/test_multihost_uneven.py), run on the
bed's driver host: one data-parallel fit with one rank per worker host, whose hosts the test process
gave different CPU capacities (tests/support/cpu_capacity.py). Writes the fit's epoch records (each
rank's speed, the waiting share, the ranks named slow) to OUT; the driver's own warning goes to its
stderr, which the test reads.

    python bed_uneven.py MASTER OUT [--workers 3] [--rows 24576] [--epochs 3] [--batch 1024] [--width 1024]

Large batches of a 1M-parameter MLP: a step is ~60 ms of one thread's compute against an allreduce
of 4 MB, so that the ranks' speeds reflect their hosts' CPU (an epoch lasts many of the CFS
bandwidth controller's 100 ms periods; the first epoch also warms up).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

FEATURES = [f"f{i}" for i in range(16)]
WIDTH = {"n": 1024}


def net() -> nn.Module:
    # Wide enough that a step's compute (not Python overhead or the allreduce) is most of its time.
    width = WIDTH["n"]
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 3))


def rows(count: int, seed: int = 3) -> list[tuple[Any, ...]]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(count, len(FEATURES)))
    y = (x[:, 0] > 0.4).astype(int) + (x[:, 1] + x[:, 2] > 0.8).astype(int)
    return [(*map(float, r), int(t)) for r, t in zip(x, y)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("master")
    parser.add_argument("out", type=Path)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--rows", type=int, default=24576)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args()
    WIDTH["n"] = args.width
    from pyspark.sql import SparkSession

    from sparkdl import TorchEstimator

    spark = (SparkSession.builder.master(args.master).appName("sparkdl-bed-uneven")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.executor.cores", "1").config("spark.task.cpus", "1").config("spark.executor.memory", "1g")
             .config("spark.cores.max", str(args.workers))  # one executor (one rank) on each worker host
             .config("spark.scheduler.minRegisteredResourcesRatio", "1.0")
             .config("spark.scheduler.maxRegisteredResourcesWaitingTime", "120s").getOrCreate())
    result: dict[str, Any] = {}
    try:
        df = spark.sparkContext.parallelize(rows(args.rows), args.workers).toDF(FEATURES + ["label"]).cache()
        df.count()
        started = time.monotonic()
        model = TorchEstimator(model=net, feature_cols=FEATURES, label_col="label", batch_size=args.batch, epochs=args.epochs,
                               num_workers=args.workers, optimizer="sgd", lr=0.05, seed=7, strategy="data_parallel",
                               threads_per_worker=1, tracking=False, progress=False).fit(df)
        keep = ("epoch", "seconds", "steps", "loss", "rows_per_compute_s_by_rank", "compute_seconds_by_rank",
                "wait_seconds_by_rank", "wait_fraction", "slow_ranks")
        result = {"fit_s": round(time.monotonic() - started, 1),
                  "history": [{k: r[k] for k in keep if k in r} for r in model.history]}
    except Exception as exc:  # noqa: BLE001 - the test reports it
        import traceback

        result = {"error": type(exc).__name__, "message": str(exc), "trace": traceback.format_exc()[-3000:]}
    finally:
        args.out.write_text(json.dumps(result, indent=1))
        spark.stop()


if __name__ == "__main__":
    main()
