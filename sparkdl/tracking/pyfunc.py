"""The MLflow pyfunc of a sparkdl model, logged as code (MLflow's "models from code"): MLflow runs
this file to get the model object, so nothing is cloudpickled into the model's definition. Its
artifacts are the weightless skeleton (trained_model.skeleton_bytes of the serving.ServedModel) and
the directory of tensor files the ranks wrote; `load_context` joins them, one tensor at a time.
Loaded only by MLflow (it imports mlflow and pandas at the top).
"""
from __future__ import annotations

import os
from typing import Any

import mlflow
import pandas as pd
from mlflow.pyfunc import PythonModel

SKELETON_ARTIFACT = "skeleton"
WEIGHTS_ARTIFACT = "weights"


class SparkdlPyfunc(PythonModel):
    """`predict` answers what TorchModel.transform writes (class index, per-position classes,
    values), with class probabilities beside it."""

    served: Any = None

    def load_context(self, context: Any) -> None:
        from sparkdl.model.trained import module_from_files

        with open(context.artifacts[SKELETON_ARTIFACT], "rb") as stream:
            skeleton = stream.read()
        weights = context.artifacts[WEIGHTS_ARTIFACT]
        files = sorted(os.path.join(weights, name) for name in os.listdir(weights) if name.endswith(".safetensors"))
        self.served = module_from_files(skeleton, files)

    # The hint stays pd.DataFrame: MLflow reads it when logging, and warns on one it cannot use (Any).
    def predict(self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        """`model_input` as MLflow hands it after its schema check: a frame of the user's columns in
        JSON's types (sparkdl/tracking/json_types.py), a dict of numpy arrays (tensor specs), or an
        older model's feature matrix; ServedModel narrows each column to the dtype it trained with."""
        return pd.DataFrame(self.served.predict_columns(model_input))


mlflow.models.set_model(SparkdlPyfunc())
