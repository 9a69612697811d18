"""A click-through model on categorical columns: embedding tables sharded over the workers (DLRM).

    python examples/recommender.py [--master local[2]] [--epochs 3] [--placement auto|sharded|replicated]

A synthetic click log (two dense features, a user id, an item name, a list of tags with weights, a
click label) trains sparkdl's built-in DLRM: each categorical column looks its ids up in an
embedding table (strings and out-of-range ids are hashed onto the table's rows, the same way in Spark
and in serving), the tables live sharded over the workers (or replicated, when the planner finds
that cheaper), the dense layers train data parallel. Prints the plan, then the held-out AUC.
"""
from __future__ import annotations

import argparse

import numpy as np
from pyspark.sql import SparkSession
from torch import nn

import sparkdl
from sparkdl import TorchEstimator
from sparkdl.embeddings import DLRM, TableSpec

TABLES = (TableSpec("users", 200, 8), TableSpec("items", 64, 8), TableSpec("tags", 32, 8))
SPARSE = {"user": {"table": "users", "num_rows": 200}, "item": {"table": "items", "num_rows": 64},
          "tags": {"num_rows": 32, "weights_col": "tag_w"}}


def model() -> nn.Module:
    return DLRM(2, TABLES, bottom=[16, 8], top=[16], features={"user": "users", "item": "items", "tags": "tags"})


def click_log(spark: SparkSession, rows: int, seed: int = 0):  # type: ignore[no-untyped-def]
    """Every fourth item is popular, every third user clicks more, tag 7 helps, so does the first feature."""
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(rows):
        user, item = int(rng.integers(0, 150)), int(rng.integers(0, 60))
        tags = [int(t) for t in rng.integers(0, 20, size=int(rng.integers(0, 4)))]
        x0, x1 = float(rng.normal()), float(rng.normal())
        score = 2.5 * (item % 4 == 0) + 1.5 * (user % 3 == 0) + 1.5 * (7 in tags) + 0.8 * x0 - 2.0
        data.append((x0, x1, user, f"item-{item}", tags, [1.0] * len(tags), int(rng.random() < 1 / (1 + np.exp(-score)))))
    return spark.createDataFrame(data, "f0 double, f1 double, user bigint, item string, tags array<int>, "
                                       "tag_w array<double>, clicked int")


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--placement", default="auto", choices=["auto", "sharded", "replicated"])
    args = parser.parse_args(argv)
    spark = SparkSession.builder.master(args.master).getOrCreate()
    clicks = click_log(spark, args.rows)
    options = dict(feature_cols=["f0", "f1"], sparse_cols=SPARSE, label_col="clicked", loss="bce_with_logits",
                   num_workers=2, batch_size=64, epochs=args.epochs, lr=0.01, embedding_lr=0.1,
                   embedding_placement=args.placement, validation_fraction=0.2, metrics=["auc"],
                   tracking=False, progress=False)
    print(sparkdl.plan(model, clicks, **options).explain())
    fitted = TorchEstimator(model=model, **options).fit(clicks)
    # the click probability is probability[1]; prediction is 1.0 where it passes 0.5
    fitted.transform(clicks.limit(5)).select("user", "item", "tags", "probability", "prediction").show(truncate=False)
    auc = fitted.history[-1]["val_auc"]
    print(f"held-out AUC: {auc:.3f}")
    return auc


if __name__ == "__main__":
    main()
