"""A custom training loop with sparkdl.run: your code on every rank, sparkdl's data and collectives.

    python examples/custom_loop.py [--master local[2]] [--epochs 5]

`train_fn(ctx)` runs once per worker: `ctx.batches(epoch)` yields this rank's torch batches (every
rank gets the same number of steps), `ctx.comm` averages across ranks. Rank 0's return value comes
back to the driver.
"""
from __future__ import annotations

import argparse

from pyspark.sql import SparkSession

import sparkdl
from sparkdl.datasets import digits_dataframe


def train_fn(ctx, epochs: int) -> dict:  # type: ignore[no-untyped-def]
    import torch
    from torch import nn

    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for epoch in range(epochs):
        total, rows = 0.0, 0
        for features, labels in ctx.batches(epoch):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(features), labels)
            loss.backward()
            for param in model.parameters():  # average the gradients over the ranks
                ctx.comm.allreduce(param.grad, op="avg")
            optimizer.step()
            total, rows = total + float(loss) * len(labels), rows + len(labels)
        sums = torch.tensor([total, float(rows)], dtype=torch.float64)
        ctx.comm.allreduce(sums, op="sum")
        losses.append(float(sums[0] / sums[1]))
    return {"rank": ctx.rank, "world_size": ctx.world_size, "losses": losses}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args(argv)

    spark = SparkSession.builder.master(args.master).getOrCreate()
    epochs = args.epochs
    result = sparkdl.run(lambda ctx: train_fn(ctx, epochs), df=digits_dataframe(spark), num_workers=2,
                         batch_size=32, progress=False)
    print(f"custom loop on {result['world_size']} ranks: loss per epoch "
          + ", ".join(f"{loss:.3f}" for loss in result["losses"]))
    return result


if __name__ == "__main__":
    main()
