"""Planner predictions on tensor-column models: a CNN on 1x8x8 digit images and a small causal
transformer on token ids, both profiled on the run's own sample rows (planner/profile.ModelInput).

For each model, `sparkdl.plan` (strategy="auto": calibrated cluster, driver-side profile) prices its
candidates; then each of data parallel and the planner's hybrid layout is trained for real
(`TorchEstimator`, 3 epochs) and its measured step time (the last epoch's seconds / steps, data
loading included) is set beside the prediction. Median over --repeats fits. Two workers on
local-cluster[2,1,2048] by default.

    python benchmarks/planner_tensors.py [--repeats 3] [--master local-cluster[2,1,2048]]

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
for path in (REPO, REPO / "tests" / "support"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def cnn() -> Any:
    from torch import nn

    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(512, 10))


def cases(spark: Any) -> dict[str, tuple[Any, Any, dict[str, Any]]]:
    from sparkdl_test_models import TOKEN_LEN, TOKEN_VOCAB, tiny_gpt

    from sparkdl.datasets import digits_images_dataframe, synthetic_tokens_dataframe

    images = digits_images_dataframe(spark).repartition(2).cache()
    tokens = synthetic_tokens_dataframe(spark, rows=2048, seq_len=TOKEN_LEN, vocab=TOKEN_VOCAB).repartition(2).cache()
    return {"cnn_images": (cnn, images, dict(input_cols=["pixels"], input_shapes={"pixels": [1, 8, 8]},
                                             label_col="label")),
            "token_transformer": (tiny_gpt, tokens, dict(input_cols=["tokens"], label_col="targets"))}


def measure(model: Any, df: Any, options: dict[str, Any], layout: dict[str, Any], repeats: int) -> dict[str, Any]:
    from sparkdl import TorchEstimator

    steps_ms = []
    for _ in range(repeats):
        fitted = TorchEstimator(model=model, **options, **layout, epochs=3, batch_size=32, num_workers=2,
                                tracking=False, progress=False).fit(df)
        last = fitted.history[-1]
        steps_ms.append(1e3 * last["seconds"] / last["steps"])
    return {"measured_step_ms": statistics.median(steps_ms), "runs_ms": [round(v, 3) for v in steps_ms]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--master", default="local-cluster[2,1,2048]")
    args = parser.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    import sparkdl

    spark = SparkSession.builder.master(args.master).config("spark.ui.enabled", "false").getOrCreate()
    started, out = time.perf_counter(), {}
    for name, (model, df, options) in cases(spark).items():
        plan = sparkdl.plan(model, df, num_workers=2, batch_size=32, epochs=3, tracking=False, **options)
        rows = {}
        for candidate in plan.candidates:
            if not candidate.feasible or candidate.strategy not in ("data_parallel", "hybrid") \
                    or dict(candidate.options).get("batch_balance") == "speed":
                continue
            label = candidate.label
            if label in rows:
                continue
            result = measure(model, df, options, dict(candidate.options), args.repeats)
            predicted = 1e3 * candidate.predicted_step_s
            rows[label] = {"predicted_step_ms": round(predicted, 3), **result,
                           "relative_error": round(abs(predicted - result["measured_step_ms"])
                                                   / result["measured_step_ms"], 3)}
        out[name] = {"chosen": plan.choice.label if plan.choice is not None else plan.strategy, "candidates": rows,
                     "ist": next((c.reason for c in plan.candidates if c.strategy == "ist"), None)}
    errors = [r["relative_error"] for case in out.values() for r in case["candidates"].values()]
    print(json.dumps({"benchmark": "planner_tensors", "master": args.master, "repeats": args.repeats,
                      "cases": out, "median_relative_error": statistics.median(errors) if errors else None,
                      "loadavg": os.getloadavg(), "wall_s": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    main()
