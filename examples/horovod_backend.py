"""The Horovod backend: the same estimator, with Horovod's ring allreduce instead of torch.distributed.

    make horovod && python examples/horovod_backend.py [--master local[2]] [--epochs 5]

sparkdl starts Horovod inside the barrier tasks (no horovodrun, no MPI): `backend="horovod"` is the
only change. Data parallel only (Horovod has no point-to-point messages for hybrid pipelines).
"""
from __future__ import annotations

import argparse

from pyspark.sql import SparkSession
from torch import nn

from sparkdl import TorchEstimator
from sparkdl.datasets import DIGITS_FEATURE_COLS, digits_dataframe


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args(argv)

    spark = SparkSession.builder.master(args.master).getOrCreate()
    model = TorchEstimator(model=mlp, feature_cols=DIGITS_FEATURE_COLS, label_col="label", backend="horovod",
                           strategy="data_parallel", optimizer="adam", lr=3e-3, batch_size=32, epochs=args.epochs,
                           num_workers=2, validation_fraction=0.2, seed=0, progress=False).fit(digits_dataframe(spark))
    last = model.history[-1]
    print(f"horovod backend: val accuracy {last['val_accuracy']:.3f}")
    return last


if __name__ == "__main__":
    main()
