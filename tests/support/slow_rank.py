"""A slow executor for local-cluster tests, outside the library's hot path: a loss that sleeps on one
rank (the Spark task's partition id) before computing cross entropy: `seconds` per step, or per row
with `per_row` (a rank whose compute is that much slower, as batch_balance="dynamic" assumes). On
the driver (the probe) it never sleeps."""
from __future__ import annotations

import time

import torch


class SlowOnRank:
    def __init__(self, rank: int, seconds: float, per_row: bool = False) -> None:
        self.rank, self.seconds, self.per_row = rank, seconds, per_row

    def __call__(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from pyspark import TaskContext

        context = TaskContext.get()
        if context is not None and context.partitionId() == self.rank:
            time.sleep(self.seconds * (len(labels) if self.per_row else 1))
        return torch.nn.functional.cross_entropy(outputs, labels)
