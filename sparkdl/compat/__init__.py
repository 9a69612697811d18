"""compat: code written for PySpark's TorchDistributor, Databricks' HorovodRunner and horovod.spark.run
runs on sparkdl unchanged (docs/migrating.md).

Owns: torch_distributor.py (TorchDistributor, DeepspeedTorchDistributor), horovod_runner.py
(HorovodRunner), horovod.py (`run`, horovod.spark.run's signature), data.py (partition_batches: the
rank's partition at sparkdl's speed), launcher.py (where a call runs: barrier tasks, or children of the
driver; MLflow). Every rank runs in a fresh child process with the torchrun (or Horovod) variables
set and no process group (wire/child.py, executor/child_rank.py). A public surface: may import
every package.
"""
from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # pyspark loads only when used, as for `import sparkdl`.
    if name in ("TorchDistributor", "DeepspeedTorchDistributor"):
        from sparkdl.compat import torch_distributor

        return getattr(torch_distributor, name)
    if name == "HorovodRunner":
        from sparkdl.compat.horovod_runner import HorovodRunner

        return HorovodRunner
    if name in ("partition_batches", "partition_table"):
        from sparkdl.compat import data

        return getattr(data, name)
    raise AttributeError(f"module 'sparkdl.compat' has no attribute {name!r}")


__all__ = ["TorchDistributor", "DeepspeedTorchDistributor", "HorovodRunner", "partition_batches", "partition_table"]
