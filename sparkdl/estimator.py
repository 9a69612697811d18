"""TorchEstimator and TorchModel: sparkdl as pyspark.ml stages (fit/transform, Pipelines, save/load)."""
from __future__ import annotations

import io
import json
import pickle
from typing import Any

from pyspark.ml import Estimator, Model
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReadable, MLReader, MLWritable, MLWriter
from pyspark.sql import DataFrame

from sparkdl import api
from sparkdl.config import RunConfig
from sparkdl.data.layout import FeedLayout
from sparkdl.errors import SparkdlError
from sparkdl.session import facts
from sparkdl.storage import read_bytes, write_bytes

FORMAT_VERSION = 1


class TorchEstimator(Estimator, MLWritable):
    """`TorchEstimator(model=net, feature_cols=[...], label_col="label", ...).fit(df) -> TorchModel`.

    Keyword options are those of RunConfig (see conf/defaults.toml); unknown ones raise at once.
    """

    def __init__(self, model: Any = None, *, config: RunConfig | None = None, validation_df: DataFrame | None = None,
                 plan: Any = None, **options: Any) -> None:
        """`plan`: a kept plan (what sparkdl.plan returns, or its JSON text) to train with exactly,
        without planning again; `plan_from_run=<MLflow run id>` takes an earlier fit's plan.json."""
        super().__init__()
        self.model = model
        self.validation_df = validation_df
        self.config = RunConfig.from_kwargs(base=config, **options)
        self.plan = api.kept_plan(plan, self.config) if isinstance(plan, (str, bytes)) else plan

    def _fit(self, dataset: DataFrame) -> "TorchModel":
        result = api.fit(dataset, self.model, self.config, validation_df=self.validation_df, plan=self.plan)
        model = TorchModel(module=result.module, layout=result.layout, output_kind=result.output_kind,
                           history=result.history, prediction_col=self.config.data.prediction_col,
                           run_id=result.extra.get("mlflow_run_id"), options=result.config.flat())
        model.model_uri = result.extra.get("model_uri")  # the MLflow model (pyfunc-loadable)
        model.transform_fn = result.config.data.transform_fn
        model.explicit_dtypes = sorted(result.config.data.input_dtypes or {})
        model.output_shape = tuple(result.extra.get("output_shape", ()))
        model.plan = result.plan  # the layout it trained with: TorchEstimator(plan=model.plan) trains alike
        model.fit_seconds = dict(result.extra.get("phases", {}))  # where the fit's wall time went (phases.py)
        return model

    def write(self) -> MLWriter:
        raise SparkdlError("TorchEstimator is not saved; save the fitted TorchModel instead",
                           hint="model = estimator.fit(df); model.save(path)")


class TorchModel(Model, MLWritable, MLReadable):
    """A trained module plus what it needs to score a DataFrame like the one it was trained on."""

    def __init__(self, module: Any = None, layout: FeedLayout | None = None, output_kind: str = "class",
                 history: list[dict[str, Any]] | None = None, prediction_col: str = "prediction",
                 run_id: str | None = None, options: dict[str, Any] | None = None) -> None:
        super().__init__()
        self._module = module
        self.layout = layout
        self.output_kind = output_kind
        self.history = list(history or [])
        self.prediction_col = prediction_col
        self.run_id = run_id  # the MLflow run of the fit (None when tracking was off or failed)
        self.options = dict(options or {})
        self.model_uri: str | None = None
        self.fit_seconds: dict[str, float] = {}  # phase -> seconds of the fit that made it (not saved)
        self.plan: Any = None  # the ResolvedPlan of the fit (None after load)
        self.inference_gpus = 0.0  # GPUs per scoring task; a fraction shares a GPU between tasks
        self.inference_batch_size = 1024
        self.transform_fn: Any = None  # input_cols models: run on the scoring executors as in training
        self.explicit_dtypes: list[str] = []  # input columns whose dtype input_dtypes set
        self.output_shape: tuple[int, ...] = ()  # per row, of the module's output (input_cols models)

    def served(self) -> Any:
        """The module with what it scores with (serving.ServedModel): input layout, transform_fn, kind."""
        from sparkdl.serving import ServedModel

        return ServedModel(self._module, self.layout, self.output_kind, self.transform_fn,
                           frozenset(self.explicit_dtypes), tuple(self.output_shape), self.prediction_col)

    def torch_module(self) -> Any:
        return self._module

    def setInferenceGpus(self, gpus_per_task: float) -> "TorchModel":
        """Score under a task ResourceProfile with `gpus_per_task` GPUs (0.25: four tasks per GPU),
        so a CPU-default application can run transform on its executors' GPUs."""
        api.check_gpus_per_task(gpus_per_task)
        self.inference_gpus = float(gpus_per_task)
        return self

    def setInferenceBatchSize(self, batch_size: int) -> "TorchModel":
        """Rows per forward pass during transform (memory on the device against throughput)."""
        api.check_inference_batch_size(batch_size)
        self.inference_batch_size = batch_size
        return self

    def _transform(self, dataset: DataFrame) -> DataFrame:
        if self._module is None or self.layout is None:
            raise SparkdlError("this TorchModel holds no trained module", hint="fit an estimator or TorchModel.load(path)")
        return api.predict(dataset, self._module, self.layout, self.output_kind, self.prediction_col,
                           batch_size=self.inference_batch_size, gpus_per_task=self.inference_gpus,
                           served=self.served() if self.layout.tensor_inputs else None)

    def write(self) -> MLWriter:
        return _TorchModelWriter(self)

    @classmethod
    def read(cls) -> MLReader:
        return _TorchModelReader(cls)


class _TorchModelWriter(MLWriter):
    """Params metadata in Spark's own layout (so PipelineModel.load finds the class), the model in
    data/: a cloudpickled module for its structure and a weights-only state file for its weights."""

    def __init__(self, instance: TorchModel) -> None:
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        import torch

        from sparkdl.launch.wire import dumps_any

        model = self.instance
        if model.torch_module() is None or model.layout is None:
            raise SparkdlError("cannot save a TorchModel that holds no trained module")
        DefaultParamsWriter.saveMetadata(model, path, facts(self.sparkSession).metadata_context(),
                                         extraMetadata={"sparkdlFormat": FORMAT_VERSION})
        state = io.BytesIO()
        torch.save({k: v.detach().cpu() for k, v in model.torch_module().state_dict().items()}, state)
        info = {"format": FORMAT_VERSION, "layout": model.layout.to_dict(), "output_kind": model.output_kind,
                "output_shape": list(model.output_shape), "explicit_dtypes": list(model.explicit_dtypes),
                "history": model.history, "prediction_col": model.prediction_col, "run_id": model.run_id,
                "inference": {"gpus_per_task": model.inference_gpus, "batch_size": model.inference_batch_size},
                "options": {k: v for k, v in model.options.items() if _jsonable(v)}}
        files = [("module.pkl", dumps_any(model.torch_module())), ("state.pt", state.getvalue()),
                 ("sparkdl.json", json.dumps(info, indent=1).encode())]
        if model.transform_fn is not None:
            files.append(("transform_fn.pkl", dumps_any(model.transform_fn)))
        for name, payload in files:
            write_bytes(self.sparkSession, f"{path.rstrip('/')}/data/{name}", payload)


class _TorchModelReader(MLReader):
    def __init__(self, cls: type) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> TorchModel:
        import torch

        try:
            metadata = DefaultParamsReader.loadMetadata(path, facts(self.sparkSession).metadata_context())
        except Exception:  # noqa: BLE001 - Hadoop's "input path does not exist" arrives as a Py4J error
            raise SparkdlError(f"{path!r} is not a saved TorchModel (no Spark ML metadata there)",
                               hint="pass the directory written by TorchModel.save(path)") from None
        def read(name: str) -> bytes:
            try:
                return read_bytes(self.sparkSession, f"{path.rstrip('/')}/data/{name}")
            except FileNotFoundError:
                raise SparkdlError(f"{path!r} is not a saved TorchModel: data/{name} is missing",
                                   hint="pass the directory written by TorchModel.save") from None

        info = json.loads(read("sparkdl.json"))
        module = pickle.loads(read("module.pkl"))
        module.load_state_dict(torch.load(io.BytesIO(read("state.pt")), weights_only=True))
        module.eval()
        model = TorchModel(module=module, layout=FeedLayout.from_dict(info["layout"]), output_kind=info["output_kind"],
                           history=info["history"], prediction_col=info["prediction_col"],
                           run_id=info.get("run_id"), options=info.get("options"))
        inference = info.get("inference", {})
        model.inference_gpus = float(inference.get("gpus_per_task", 0.0))
        model.inference_batch_size = int(inference.get("batch_size", 1024))
        model.output_shape = tuple(info.get("output_shape", ()))
        model.explicit_dtypes = list(info.get("explicit_dtypes", []))
        if model.layout.transformed:
            model.transform_fn = pickle.loads(read("transform_fn.pkl"))
        model._resetUid(metadata["uid"])  # a reloaded PipelineModel must keep its stage uids
        return model


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except TypeError:
        return False
