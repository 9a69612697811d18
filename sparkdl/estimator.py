"""TorchEstimator and TorchModel: sparkdl as pyspark.ml stages (fit/transform, Params, tuning,
Pipelines, save/load; estimator_params.py declares the Params, estimator_io.py saves and loads)."""
from __future__ import annotations

from typing import Any

from pyspark.ml import Estimator, Model
from pyspark.ml.util import MLReadable, MLReader, MLWritable, MLWriter
from pyspark.sql import DataFrame

from sparkdl import api
from sparkdl.config import RunConfig
from sparkdl.data.layout import FeedLayout
from sparkdl.errors import SparkdlError
from sparkdl.estimator_params import RunConfigParams, ScoreColumnParams


class TorchEstimator(RunConfigParams, Estimator, MLWritable, MLReadable):
    """`TorchEstimator(model=net, feature_cols=[...], label_col="label", ...).fit(df) -> TorchModel`.

    Keyword options are those of RunConfig (see conf/defaults.toml), or Spark ML's column names
    (featuresCol, labelCol, predictionCol, probabilityCol, rawPredictionCol, weightCol); unknown
    ones raise at once. Each is a Spark ML Param (`est.lr`, `est.getLr()`, `est.setLr(0.1)`), so
    ParamGridBuilder, CrossValidator and TrainValidationSplit tune it, and a Pipeline saves it.
    """

    def __init__(self, model: Any = None, *, config: RunConfig | None = None, validation_df: DataFrame | None = None,
                 plan: Any = None, **options: Any) -> None:
        """`config`: the base every option's default comes from. `plan`: a kept plan (what
        sparkdl.plan returns, or its JSON text) to train with exactly, without planning again;
        `plan_from_run=<MLflow run id>` takes an earlier fit's plan.json."""
        super().__init__()
        self.model = model
        self.validation_df = validation_df
        self.base_config = config or RunConfig()
        self._config_defaults(self.base_config)
        self._set_options(options)
        self.plan = api.kept_plan(plan, self.config) if isinstance(plan, (str, bytes)) else plan

    @property
    def config(self) -> RunConfig:
        """The RunConfig a fit of this estimator runs with: the base config with every Param's value."""
        return self._run_config(self.base_config)

    def setParams(self, **options: Any) -> "TorchEstimator":
        """Set any options by name (sparkdl's or Spark ML's column names), as the constructor takes them."""
        self._set_options(options)
        return self

    def fitMultiple(self, dataset: DataFrame, paramMaps: Any) -> Any:
        """Spark ML's tuning entry (CrossValidator, TrainValidationSplit): one fit per ParamMap, as
        Spark's own iterator of (index, model), the points sharing what does not depend on their
        values: the session, its calibration, Python workers and imports (as any fits do), and the
        data stage (the stats job and the dealing of rows) wherever the points differ only in
        options that stage does not read (lr, epochs, the optimizer, the strategy; data.prepare)."""
        from pyspark.ml.base import _FitMultipleIterator

        from sparkdl.data.prepare import PreparedRuns

        estimator, shared = self.copy(), PreparedRuns()

        def fit_one(index: int) -> "TorchModel":
            return estimator.copy(paramMaps[index])._fit(dataset, shared)

        return _FitMultipleIterator(fit_one, len(paramMaps))

    def _fit(self, dataset: DataFrame, shared: Any = None) -> "TorchModel":
        config = self.config
        result = api.fit(dataset, self.model, config, validation_df=self.validation_df, plan=self.plan, shared=shared)
        model = TorchModel(module=result.module, layout=result.layout, output_kind=result.output_kind,
                           history=result.history, prediction_col=config.data.prediction_col,
                           run_id=result.extra.get("mlflow_run_id"), options=result.config.flat(),
                           probability_col=self.getProbabilityCol(), raw_prediction_col=self.getRawPredictionCol())
        model.model_uri = result.extra.get("model_uri")  # the MLflow model (pyfunc-loadable)
        model.transform_fn = result.config.data.transform_fn
        model.explicit_dtypes = sorted(result.config.data.input_dtypes or {})
        model.output_shape = tuple(result.extra.get("output_shape", ()))
        model.plan = result.plan  # the layout it trained with: TorchEstimator(plan=model.plan) trains alike
        model.fit_seconds = dict(result.extra.get("phases", {}))  # where the fit's wall time went (tracking/phases.py)
        model.model_transfer = dict(result.extra.get("model_transfer", {}))  # rank -> how its part came back
        model.model_return = {"bytes": int(result.extra.get("model_bytes", 0)),  # the parts' bytes, all ranks
                              "send_s": float(result.extra.get("model_send_s", 0.0))}  # the slowest rank's send
        if result.extra.get("model_parts") is not None:  # output.load_model=False: read on first use
            model._defer_loading(result.extra["model_parts"])
        return model

    def write(self) -> MLWriter:
        from sparkdl.estimator_io import TorchEstimatorWriter

        return TorchEstimatorWriter(self)

    @classmethod
    def read(cls) -> MLReader:
        from sparkdl.estimator_io import TorchEstimatorReader

        return TorchEstimatorReader(cls)


class TorchModel(ScoreColumnParams, Model, MLWritable, MLReadable):
    """A trained module plus what it needs to score a DataFrame like the one it was trained on.
    Its Params are the columns transform writes: predictionCol (a double for classifiers and
    regressors) and, for classifiers, probabilityCol and rawPredictionCol (vectors; "": left out)."""

    def __init__(self, module: Any = None, layout: FeedLayout | None = None, output_kind: str = "class",
                 history: list[dict[str, Any]] | None = None, prediction_col: str = "prediction",
                 run_id: str | None = None, options: dict[str, Any] | None = None,
                 probability_col: str = "probability", raw_prediction_col: str = "rawPrediction") -> None:
        super().__init__()
        self._score_defaults(prediction_col)
        self._set(probabilityCol=probability_col, rawPredictionCol=raw_prediction_col)
        self._module = module
        self.layout = layout
        self.output_kind = output_kind
        self.history = list(history or [])
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
        self.model_transfer: dict[int, str] = {}  # rank -> "channel" / "storage" / "rows" (not saved)
        self.model_return: dict[str, Any] = {}  # bytes and seconds of the trip back (not saved)
        self._pending_parts: Any = None  # trained_model.ModelParts not loaded yet (output.load_model=False)
        self.generation: Any = None  # output_kind "text": model/generation.Generation (None: its defaults)

    @property
    def prediction_col(self) -> str:
        return self.getPredictionCol()

    def _defer_loading(self, parts: Any) -> None:
        """Keep the trained weights in their files until the module is first used; the files go when
        no model (this one or a copy) holds the parts any more."""
        parts.remove_when_unused()
        self._pending_parts = parts

    @property
    def loaded(self) -> bool:
        """Whether the trained weights are in memory (False until first use after load_model=False)."""
        return self._pending_parts is None

    def served(self) -> Any:
        """The module with what it scores with (serving.ServedModel): input layout, transform_fn, kind."""
        from sparkdl.tracking.serving import ServedModel

        return ServedModel(self.torch_module(), self.layout, self.output_kind, self.transform_fn,
                           frozenset(self.explicit_dtypes), tuple(self.output_shape), self.prediction_col,
                           self.generation)

    def generating(self, max_new_tokens: int = 32, do_sample: bool = False, temperature: float = 1.0,
                   top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> "TorchModel":
        """A copy whose transform writes each row's prompt continued as text (a language model fitted
        with data.tokenizer): up to max_new_tokens, greedy, or sampled under `seed`."""
        from sparkdl.model.generation import Generation

        generation = Generation(max_new_tokens, do_sample, temperature, top_k, top_p, seed)
        generation.validate()
        return self._with_output("text", generation)

    def embedding(self) -> "TorchModel":
        """A copy whose transform writes one vector per row: the last hidden states averaged over the
        row's tokens (array<float>)."""
        return self._with_output("embedding", None)

    def scoring(self, output_kind: str) -> "TorchModel":
        """A copy writing another of the output kinds (tracking/inference.OUTPUT_KINDS), e.g. "values"
        for a language model's raw logits."""
        from sparkdl.tracking.inference import OUTPUT_KINDS

        if output_kind not in OUTPUT_KINDS:
            raise SparkdlError(f"output kind {output_kind!r} is not one of {list(OUTPUT_KINDS)}")
        return self._with_output(output_kind, self.generation)

    def _with_output(self, kind: str, generation: Any) -> "TorchModel":
        if kind in ("text", "embedding") and (self.layout is None or not self.layout.tensor_inputs):
            raise SparkdlError(f"{kind} output needs a model trained on input_cols (token or text columns)",
                               hint="fit with input_cols=[...] (and tokenizer=... for text)")
        model = self.copy()
        model.output_kind, model.generation, model.model_uri = kind, generation, None
        return model

    def torch_module(self) -> Any:
        """The trained module, its weights read from the ranks' files now if that was deferred."""
        parts = self._pending_parts
        if parts is not None:
            from sparkdl.model.trained import load_parts

            with parts.lock:  # two threads scoring at once load once
                if self._pending_parts is not None:
                    load_parts(self._module, parts.files)
                    self._module.eval()
                    self._pending_parts = None
        return self._module

    def save_adapter(self, path: str) -> list[str]:
        """The trained PEFT adapter in PEFT's own layout (adapter_config.json, adapter_model.safetensors)
        under `path`: `peft.PeftModel.from_pretrained(base, path)` loads it with peft alone."""
        from sparkdl.model.adapters import save_adapter

        return save_adapter(self.torch_module(), path)

    def merged(self) -> "TorchModel":
        """A TorchModel of the adapter merged into its base (peft's merge_and_unload): the plain model,
        scored without peft. This model is left as it is; the copy has no MLflow model of its own."""
        from sparkdl.model.adapters import merged_module

        model = self.copy()
        model._module, model._pending_parts, model.model_uri = merged_module(self.torch_module()), None, None
        return model

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
        return api.predict(dataset, self.torch_module(), self.layout, self.output_kind, self.score_columns(),
                           batch_size=self.inference_batch_size, gpus_per_task=self.inference_gpus,
                           served=self.served() if self.layout.tensor_inputs else None)

    def score_columns(self) -> Any:
        """The columns transform writes (tracking/inference.ScoreColumns) from this model's Params."""
        from sparkdl.tracking.inference import ScoreColumns

        return ScoreColumns(self.getPredictionCol(), self.getProbabilityCol(), self.getRawPredictionCol())

    def write(self) -> MLWriter:
        from sparkdl.estimator_io import TorchModelWriter

        return TorchModelWriter(self)

    @classmethod
    def read(cls) -> MLReader:
        from sparkdl.estimator_io import TorchModelReader

        return TorchModelReader(cls)


