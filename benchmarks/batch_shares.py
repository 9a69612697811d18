"""Data parallel on ranks of different speeds: equal batches against batches shared by speed (DT-FM).

Two workers on local[2], one declared 4x slower than the other (`launch.emulate_speed=[1, 0.25]`:
its forward + backward is stretched to 4x its real time). The same fit runs with
`batch_balance="equal"` (batch_size rows each: the fast rank waits for the slow one at every
allreduce) and `batch_balance="speed"` (the global batch split 4:1, losses weighted so the update is
the same mean over all rows), interleaved, `--repeats` times each. Reported: the median step time of
the last epoch of each, their ratio, the planner's predicted step times for both (`sparkdl.plan`),
and the final training loss of each (same rows per step, so it should match closely).

Prints one JSON object as the last line of stdout. Nothing here asserts anything.
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
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SPEEDS = [1.0, 0.25]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32768)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args()


def mlp() -> Any:
    from torch import nn

    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def main() -> None:
    args = parse_args()
    os.environ["PYSPARK_PYTHON"] = sys.executable
    import numpy as np
    from pyspark.sql import SparkSession

    import sparkdl
    from sparkdl import TorchEstimator

    spark = (SparkSession.builder.master("local[2]").appName("sparkdl-bench-shares")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    started = time.perf_counter()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.rows, 64)).astype(np.float32)
    teacher = rng.normal(size=(64, 10))
    y = (x @ teacher).argmax(axis=1)
    columns = [f"x{i}" for i in range(64)]
    df = spark.createDataFrame([(*map(float, row), int(label)) for row, label in zip(x, y)],
                               columns + ["label"]).repartition(2).cache()
    df.count()
    common = dict(feature_cols=columns, label_col="label", batch_size=args.batch_size, epochs=args.epochs,
                  num_workers=2, threads_per_worker=1, optimizer="sgd", lr=0.05, momentum=0.9, seed=0,
                  emulate_speed=SPEEDS, tracking=False, progress=False, strategy="data_parallel")
    plan = sparkdl.plan(mlp, df, **{**common, "strategy": "auto", "emulate_network": {"latency_ms": 0.0,
                                                                                      "gbps": 1000.0}})
    predicted = {c.label: c.predicted_step_s for c in plan.candidates}
    runs: dict[str, list[dict[str, float]]] = {"equal": [], "speed": []}
    for repeat in range(args.repeats):
        for balance in ("equal", "speed"):
            model = TorchEstimator(model=mlp, batch_balance=balance, **common).fit(df)
            last = model.history[-1]
            runs[balance].append({"step_s": last["seconds"] / last["steps"], "loss": last["loss"],
                                  "steps": last["steps"], "rows_per_rank": last.get("batch_rows_per_rank")})
            print(f"repeat {repeat} {balance}: {1e3 * runs[balance][-1]['step_s']:.1f} ms/step, "
                  f"loss {last['loss']:.4f}", file=sys.stderr)
    step = {b: statistics.median(r["step_s"] for r in runs[b]) for b in runs}
    loss = {b: statistics.median(r["loss"] for r in runs[b]) for b in runs}
    predicted_equal = predicted.get("data_parallel")
    predicted_speed = predicted.get("data_parallel(batch_balance=speed)")
    result = {
        "benchmark": "batch_shares", "master": "local[2]", "workers": 2, "emulated_speeds": SPEEDS,
        "rows": args.rows, "batch_per_worker": args.batch_size, "epochs": args.epochs, "repeats": args.repeats,
        "model": "MLP 64-256-256-10", "step_s": step, "loss": loss,
        "speed_over_equal_step": round(step["speed"] / step["equal"], 3),
        "predicted_step_s": {"equal": predicted_equal, "speed": predicted_speed},
        "predicted_speed_over_equal": round(predicted_speed / predicted_equal, 3)
        if predicted_equal and predicted_speed else None,
        "planner_choice": plan.choice.label,
        "rows_per_rank_speed": runs["speed"][0]["rows_per_rank"],
        "runs": runs, "seconds": round(time.perf_counter() - started, 1),
    }
    spark.stop()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
