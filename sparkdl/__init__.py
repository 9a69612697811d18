"""sparkdl: train PyTorch models on Spark DataFrames (public surface only)."""
from __future__ import annotations

from typing import Any

from sparkdl.config import RunConfig
from sparkdl.errors import SparkdlError

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # pyspark and torch load only when used, so `import sparkdl` stays fast and works without Spark.
    if name in ("TorchEstimator", "TorchModel"):
        from sparkdl import estimator

        return getattr(estimator, name)
    if name in ("run", "fit", "predict", "plan"):
        from sparkdl import api

        return getattr(api, name)
    if name == "ResolvedPlan":
        from sparkdl.resolved_plan import ResolvedPlan

        return ResolvedPlan
    if name == "errors":
        import sparkdl.errors as errors

        return errors
    raise AttributeError(f"module 'sparkdl' has no attribute {name!r}")


__all__ = ["RunConfig", "ResolvedPlan", "SparkdlError", "TorchEstimator", "TorchModel", "run", "fit", "plan", "predict", "__version__"]
