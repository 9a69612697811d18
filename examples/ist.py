"""IST (independent subnet training): each worker trains a disjoint 1/W of every hidden layer.

    python examples/ist.py [--master local[2]] [--epochs 8]

For wide MLPs on slow networks: subnets train alone for `ist_sync_every` steps, then the blocks are
written back; tens of times fewer bytes than data parallel (compare `bytes_sent_all_ranks`).
"""
from __future__ import annotations

import argparse

from pyspark.sql import SparkSession
from torch import nn

from sparkdl import TorchEstimator
from sparkdl.datasets import DIGITS_FEATURE_COLS, digits_dataframe


def wide() -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--epochs", type=int, default=8)
    args = parser.parse_args(argv)

    spark = SparkSession.builder.master(args.master).getOrCreate()
    model = TorchEstimator(model=wide, feature_cols=DIGITS_FEATURE_COLS, label_col="label", strategy="ist",
                           ist_sync_every=30, optimizer="adam", lr=2e-3, batch_size=32, epochs=args.epochs,
                           num_workers=2, validation_fraction=0.2, seed=0, progress=False).fit(digits_dataframe(spark))
    last = model.history[-1]
    sent = sum(h["bytes_sent_all_ranks"] for h in model.history)
    print(f"IST: val accuracy {last['val_accuracy']:.3f}, {sent / 1e6:.1f} MB sent by all ranks")
    return last


if __name__ == "__main__":
    main()
