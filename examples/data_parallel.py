"""Data parallel: every worker holds the whole model and gradients are averaged every step.

    python examples/data_parallel.py [--master local[2] | --remote sc://host:15002] [--epochs 10]

Trains an MLP on the bundled 8x8 digits through the Spark ML estimator (pass strategy="auto", the
default, to let the planner choose), then scores the held-out rows with transform().
"""
from __future__ import annotations

import argparse

from pyspark.sql import SparkSession
from torch import nn

from sparkdl import TorchEstimator
from sparkdl.datasets import DIGITS_FEATURE_COLS, digits_dataframe, train_test_split_digits


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--remote", help="a Spark Connect server instead (Databricks Connect, shared mode)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)

    builder = SparkSession.builder.remote(args.remote) if args.remote else SparkSession.builder.master(args.master)
    spark = builder.getOrCreate()  # an active session (notebook) wins
    train_idx, test_idx = train_test_split_digits(seed=0)
    train = digits_dataframe(spark, indices=train_idx)
    test = digits_dataframe(spark, indices=test_idx)

    estimator = TorchEstimator(model=mlp, feature_cols=DIGITS_FEATURE_COLS, label_col="label",
                               strategy="data_parallel", optimizer="adam", lr=3e-3, batch_size=32,
                               epochs=args.epochs, num_workers=args.workers, seed=0, progress=False)
    model = estimator.fit(train)
    rows = model.transform(test).select("label", "prediction").collect()
    accuracy = sum(r["label"] == r["prediction"] for r in rows) / len(rows)
    print(f"data parallel: loss {model.history[-1]['loss']:.4f}, test accuracy {accuracy:.3f}, "
          f"MLflow run {model.run_id}")
    return accuracy


if __name__ == "__main__":
    main()
