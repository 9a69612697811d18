"""The fixed cost per fit of a tuning grid: a 4-point grid (lr x batch_size) fitted through Spark ML's
tuning entry (TorchEstimator.fitMultiple, what CrossValidator and TrainValidationSplit call per fold)
against the same 4 points fitted one by one (issue 52 item 1).

    .venv/bin/python benchmarks/grid_fixed_cost.py [--repeats 3] [--master local-cluster[2,1,1024]] [--tracking]

A fit's fixed cost is its wall time less its training job's (fit_seconds["job"]: the barrier job,
which a grid cannot share); both rows run in the same session, alternating, after one warm-up fit,
and the figures are medians over --repeats rounds. What the grid shares beyond what any two fits in
one session share (the session, cached calibration, reused Python workers and their imports) is the
data stage (one stats job and one dealing of the rows for the points that differ only in options it
does not read: lr here, not batch_size), and the model's probe where the points agree. One full
CrossValidator (2 folds: 9 fits) is timed too, for its fixed cost per fit. Prints JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

FEATURES = [f"f{i}" for i in range(8)]


def frame(spark: Any) -> Any:
    from sklearn.datasets import load_breast_cancer

    data = load_breast_cancer()
    x = data.data[:, :8]
    x = (x - x.mean(axis=0)) / x.std(axis=0)
    rows = [tuple(float(v) for v in row) + (float(label),) for row, label in zip(x, data.target)]
    return spark.createDataFrame(rows, FEATURES + ["label"]).repartition(2).cache()


def estimator(tracking: bool, tracking_uri: str | None) -> Any:
    import torch

    from sparkdl import TorchEstimator

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    return TorchEstimator(net, feature_cols=FEATURES, label_col="label", epochs=2, optimizer="adam", num_workers=2,
                          tracking=tracking, tracking_uri=tracking_uri, progress=False)


def fixed_seconds(wall: float, models: list[Any]) -> float:
    """Per fit: the wall time less the training jobs', over the fits."""
    return (wall - sum(m.fit_seconds.get("job", 0.0) for m in models)) / len(models)


def one_by_one(est: Any, df: Any, grid: list[Any]) -> tuple[float, float]:
    start = time.perf_counter()
    models = [est.fit(df, point) for point in grid]
    wall = time.perf_counter() - start
    return wall / len(grid), fixed_seconds(wall, models)


def as_a_grid(est: Any, df: Any, grid: list[Any]) -> tuple[float, float]:
    start = time.perf_counter()
    models = [model for _, model in est.fitMultiple(df, grid)]
    wall = time.perf_counter() - start
    return wall / len(grid), fixed_seconds(wall, models)


def cross_validator(est: Any, df: Any, grid: list[Any]) -> dict[str, float]:
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.ml.tuning import CrossValidator

    validator = CrossValidator(estimator=est, estimatorParamMaps=grid, numFolds=2, seed=7, collectSubModels=True,
                               evaluator=MulticlassClassificationEvaluator(metricName="logLoss"))
    start = time.perf_counter()
    tuned = validator.fit(df)
    wall = time.perf_counter() - start
    models = [m for fold in tuned.subModels for m in fold] + [tuned.bestModel]
    evaluation = wall - sum(sum(m.fit_seconds.values()) for m in models)  # transforms and evaluator jobs
    return {"wall_s": round(wall, 2), "fits": len(models),
            "fixed_s_per_fit": round(statistics.fmean(sum(m.fit_seconds.values()) - m.fit_seconds.get("job", 0.0)
                                                      for m in models), 3),
            "evaluation_s": round(evaluation, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--master", default="local-cluster[2,1,1024]")
    parser.add_argument("--tracking", action="store_true", help="log every fit to a local MLflow store")
    args = parser.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.ml.tuning import ParamGridBuilder
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(args.master).appName("grid-fixed-cost").config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    import tempfile

    store = f"sqlite:///{tempfile.mkdtemp()}/mlflow.db" if args.tracking else None
    df = frame(spark)
    est = estimator(args.tracking, store)
    grid = ParamGridBuilder().addGrid(est.lr, [0.05, 0.01]).addGrid(est.batch_size, [32, 64]).build()
    est.fit(df)  # warm-up: Python workers, imports, calibration
    rows: dict[str, list[tuple[float, float]]] = {"one_by_one": [], "grid": []}
    for round_ in range(args.repeats):
        order = ("one_by_one", "grid") if round_ % 2 == 0 else ("grid", "one_by_one")
        for name in order:
            rows[name].append((one_by_one if name == "one_by_one" else as_a_grid)(est, df, grid))
    result: dict[str, Any] = {"grid_points": len(grid), "repeats": args.repeats, "master": args.master,
                              "tracking": args.tracking, "load_avg_1m": round(os.getloadavg()[0], 2)}
    for name, values in rows.items():
        result[name] = {"wall_s_per_fit": round(statistics.median(v[0] for v in values), 3),
                        "fixed_s_per_fit": round(statistics.median(v[1] for v in values), 3)}
    result["fixed_cost_ratio_grid_to_separate"] = round(result["grid"]["fixed_s_per_fit"]
                                                        / result["one_by_one"]["fixed_s_per_fit"], 3)
    result["cross_validator_2_folds"] = cross_validator(est, df, grid)
    result["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result, indent=1))
    spark.stop()


if __name__ == "__main__":
    main()
