"""Hybrid: the model cut into pipeline stages, replicas of the pipeline trained data parallel.

    python examples/hybrid.py [--master local-cluster[2,2,1024]] [--workers 4] [--stages 2]

For models too large for one worker, or deep and narrow ones. The stage cuts balance each layer's
measured time; `max_memory_per_rank` makes the planner pick enough stages to fit.
"""
from __future__ import annotations

import argparse

from pyspark.sql import SparkSession
from torch import nn

from sparkdl import TorchEstimator
from sparkdl.datasets import DIGITS_FEATURE_COLS, digits_dataframe


def deep() -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(64, 128), nn.ReLU()]
    for _ in range(4):
        layers += [nn.Linear(128, 128), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(128, 10))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args(argv)

    spark = SparkSession.builder.master(args.master).getOrCreate()
    model = TorchEstimator(model=deep, feature_cols=DIGITS_FEATURE_COLS, label_col="label", strategy="hybrid",
                           stages=args.stages, microbatches=4 * args.stages, schedule="1f1b", optimizer="adam",
                           lr=2e-3, batch_size=32, epochs=args.epochs, num_workers=args.workers,
                           validation_fraction=0.2, seed=0, progress=False).fit(digits_dataframe(spark))
    last = model.history[-1]
    print(f"hybrid {args.stages} stages x {args.workers // args.stages} replicas: val accuracy "
          f"{last['val_accuracy']:.3f}, largest stage {last['max_param_bytes_per_rank'] / 1e6:.2f} MB of parameters")
    return last


if __name__ == "__main__":
    main()
