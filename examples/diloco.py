"""DiLoCo: data parallel that synchronises every `sync_every` steps with an outer Nesterov step.

    python examples/diloco.py [--master local[2]] [--epochs 8] [--sync-every 50]

Each worker takes H steps alone (its own AdamW state), then the mean change is applied to the
shared weights; one model-sized allreduce every H steps (fp16 halves it again).
"""
from __future__ import annotations

import argparse

from pyspark.sql import SparkSession
from torch import nn

from sparkdl import TorchEstimator
from sparkdl.datasets import DIGITS_FEATURE_COLS, digits_dataframe


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--sync-every", type=int, default=50)
    args = parser.parse_args(argv)

    spark = SparkSession.builder.master(args.master).getOrCreate()
    model = TorchEstimator(model=mlp, feature_cols=DIGITS_FEATURE_COLS, label_col="label", sync="diloco",
                           sync_every=args.sync_every, outer_lr=0.7, outer_momentum=0.9, sync_dtype="fp16",
                           optimizer="adamw", lr=2e-3, batch_size=32, epochs=args.epochs, num_workers=2,
                           validation_fraction=0.2, seed=0, progress=False).fit(digits_dataframe(spark))
    last = model.history[-1]
    print(f"DiLoCo H={args.sync_every}: val accuracy {last['val_accuracy']:.3f}, "
          f"{sum(h['bytes_sent_all_ranks'] for h in model.history) / 1e6:.2f} MB sent by all ranks")
    return last


if __name__ == "__main__":
    main()
