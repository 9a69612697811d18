"""sparkdl: train PyTorch models on Spark DataFrames. The public surface only: fit, run, plan,
predict, TorchEstimator / TorchModel, RunConfig, ResolvedPlan, SparkdlError.

The packages under it, in the order a run flows (docs/architecture.md, "Layering", has the table of
what each may import): config -> data -> driver (checks, planning, the barrier job) -> wire ->
executor (the in-task main) -> strategies -> comm; beside them planner, model, tracking, storage, spark.
"""
from __future__ import annotations

from typing import Any

from sparkdl.config import RunConfig
from sparkdl.errors import SparkdlError, mask_credentials_with
from sparkdl.old_paths import install as _install_old_paths
from sparkdl.tracking.redaction import redact_text

_install_old_paths()  # the flat layout's module paths (sparkdl 0.1) still import: saved models name them
mask_credentials_with(redact_text)  # errors' texts masked as MLflow's copies are (errors imports nothing of sparkdl)

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # pyspark and torch load only when used, so `import sparkdl` stays fast and works without Spark.
    if name in ("TorchEstimator", "TorchModel"):
        from sparkdl import estimator

        return getattr(estimator, name)
    if name in ("run", "fit", "predict", "plan"):
        from sparkdl import api

        return getattr(api, name)
    if name == "HorovodRunner":  # Databricks' sparkdl.HorovodRunner, same import (sparkdl/compat)
        from sparkdl.compat.horovod_runner import HorovodRunner

        return HorovodRunner
    if name == "pretrained":  # a Hugging Face model directory loaded on the executors (model/pretrained.py)
        from sparkdl.model.pretrained import pretrained

        return pretrained
    if name == "ResolvedPlan":
        from sparkdl.planner.resolved import ResolvedPlan

        return ResolvedPlan
    if name == "errors":
        import sparkdl.errors as errors

        return errors
    raise AttributeError(f"module 'sparkdl' has no attribute {name!r}")


__all__ = ["RunConfig", "ResolvedPlan", "SparkdlError", "TorchEstimator", "TorchModel", "HorovodRunner", "run", "fit",
           "plan", "predict", "pretrained", "__version__"]
