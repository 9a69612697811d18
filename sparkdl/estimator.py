"""TorchEstimator and TorchModel: sparkdl as pyspark.ml stages (fit/transform, Pipelines, save/load)."""
from __future__ import annotations

import dataclasses
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
from sparkdl.spark.session import facts
from sparkdl.storage.files import (delete_tree, exists, join, list_names, locate, pyarrow_reaches, read_all,
                                   read_bytes, write_atomic, write_bytes)

FORMAT_VERSION = 2  # 1: module.pkl held the weights too, with state.pt beside it (still read)
WEIGHTS_DIR = "weights"


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
        model.fit_seconds = dict(result.extra.get("phases", {}))  # where the fit's wall time went (tracking/phases.py)
        model.model_transfer = dict(result.extra.get("model_transfer", {}))  # rank -> how its part came back
        model.model_return = {"bytes": int(result.extra.get("model_bytes", 0)),  # the parts' bytes, all ranks
                              "send_s": float(result.extra.get("model_send_s", 0.0))}  # the slowest rank's send
        if result.extra.get("model_parts") is not None:  # output.load_model=False: read on first use
            model._defer_loading(result.extra["model_parts"])
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
        self.model_transfer: dict[int, str] = {}  # rank -> "channel" / "storage" / "rows" (not saved)
        self.model_return: dict[str, Any] = {}  # bytes and seconds of the trip back (not saved)
        self._pending_parts: Any = None  # trained_model.ModelParts not loaded yet (output.load_model=False)
        self.generation: Any = None  # output_kind "text": model/generation.Generation (None: its defaults)

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
        return api.predict(dataset, self.torch_module(), self.layout, self.output_kind, self.prediction_col,
                           batch_size=self.inference_batch_size, gpus_per_task=self.inference_gpus,
                           served=self.served() if self.layout.tensor_inputs else None)

    def write(self) -> MLWriter:
        return _TorchModelWriter(self)

    @classmethod
    def read(cls) -> MLReader:
        return _TorchModelReader(cls)


class _TorchModelWriter(MLWriter):
    """Params metadata in Spark's own layout (so PipelineModel.load finds the class), the model in
    data/: the module's weightless skeleton (module.pkl), its weights as tensor files (weights/,
    written a piece at a time from the tensors, or copied from the ranks' files when the model was
    never loaded) and sparkdl.json; all through sparkdl/storage/files.py."""

    def __init__(self, instance: TorchModel) -> None:
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        from sparkdl.model.trained import skeleton_bytes

        model = self.instance
        if model._module is None or model.layout is None:
            raise SparkdlError("cannot save a TorchModel that holds no trained module")
        if pyarrow_reaches(path) and exists(locate(path).child("metadata")):
            raise SparkdlError(f"{path!r} already holds a saved model",
                               hint="model.write().overwrite().save(path) replaces it")
        info = {"format": FORMAT_VERSION, "layout": model.layout.to_dict(), "output_kind": model.output_kind,
                "output_shape": list(model.output_shape), "explicit_dtypes": list(model.explicit_dtypes),
                "history": model.history, "prediction_col": model.prediction_col, "run_id": model.run_id,
                "inference": {"gpus_per_task": model.inference_gpus, "batch_size": model.inference_batch_size},
                "options": {k: v for k, v in model.options.items() if _jsonable(v)},
                "generation": dataclasses.asdict(model.generation) if model.generation is not None else None}
        data = join(path, "data")
        _write_weights(self.sparkSession, join(data, WEIGHTS_DIR), model)
        files = [("module.pkl", skeleton_bytes(model._module)), ("sparkdl.json", json.dumps(info, indent=1).encode())]
        if model.transform_fn is not None:
            from sparkdl.wire.codec import dumps_any

            files.append(("transform_fn.pkl", dumps_any(model.transform_fn)))
        for name, payload in files:
            write_bytes(self.sparkSession, join(data, name), payload)
        _save_metadata(self.sparkSession, model, path)  # last: a half-saved model has none, and no loader takes it

    def _handleOverwrite(self, path: str) -> None:
        if pyarrow_reaches(path):
            delete_tree(locate(path))
            return
        super()._handleOverwrite(path)


def _save_metadata(spark: Any, model: TorchModel, path: str) -> None:
    """Spark ML's metadata (PipelineModel.load finds the class by it): written from this process where
    pyarrow reaches the path (on a cluster, Spark's own writer would put a local path on an executor's
    disk, and needs a Hadoop connector for object stores), else by Spark's writer."""
    extra = {"sparkdlFormat": FORMAT_VERSION}
    if not pyarrow_reaches(path):
        DefaultParamsWriter.saveMetadata(model, path, facts(spark).metadata_context(), extraMetadata=extra)
        return
    text = DefaultParamsWriter._get_metadata_to_save(model, spark, extra, None)  # noqa: SLF001 - Spark's own format
    metadata = locate(path).child("metadata")
    write_atomic(metadata.child("part-00000"), (text + "\n").encode("utf-8"))
    write_atomic(metadata.child("_SUCCESS"), b"")


def _load_metadata(spark: Any, path: str) -> dict[str, Any]:
    if not pyarrow_reaches(path):
        return DefaultParamsReader.loadMetadata(path, facts(spark).metadata_context())
    metadata = locate(path).child("metadata")
    parts = [n for n in list_names(metadata) if n.startswith("part-")]
    if not parts:
        raise FileNotFoundError(metadata.path)
    text = read_all(metadata.child(parts[0])).decode("utf-8").strip().splitlines()[0]
    return DefaultParamsReader._parseMetaData(text)  # noqa: SLF001 - Spark's own format


def _write_weights(spark: Any, directory: str, model: TorchModel) -> None:
    """The weights as tensor files under `directory`: streamed where pyarrow reaches the path,
    else (a Hadoop-only scheme) as one payload through the session."""
    from sparkdl.storage.files import atomic_output, locate, open_input, pyarrow_reaches
    from sparkdl.model.tensor_files import tensor_pieces

    pending = model._pending_parts
    sources = list(pending.files) if pending is not None else [None]
    for index, source in enumerate(sources):
        target = join(directory, f"part-{index}.safetensors")
        if source is None:
            total, pieces = tensor_pieces(model._module.state_dict())
        if not pyarrow_reaches(target):
            payload = read_bytes(spark, source) if source is not None else b"".join(bytes(p) for p in pieces)
            write_bytes(spark, target, payload)
            continue
        with atomic_output(locate(target)) as out:
            if source is None:
                for piece in pieces:
                    out.write(piece)
            else:
                with open_input(locate(source)) as stream:
                    while chunk := stream.read(4 << 20):
                        out.write(chunk)


class _TorchModelReader(MLReader):
    def __init__(self, cls: type) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> TorchModel:
        try:
            metadata = _load_metadata(self.sparkSession, path)
        except Exception:  # noqa: BLE001 - Hadoop's "input path does not exist" arrives as a Py4J error
            raise SparkdlError(f"{path!r} is not a saved TorchModel (no Spark ML metadata there)",
                               hint="pass the directory written by TorchModel.save(path)") from None
        data = join(path, "data")

        def read(name: str) -> bytes:
            try:
                return read_bytes(self.sparkSession, join(data, name))
            except FileNotFoundError:
                raise SparkdlError(f"{path!r} is not a saved TorchModel: data/{name} is missing",
                                   hint="pass the directory written by TorchModel.save") from None

        info = json.loads(read("sparkdl.json"))
        module = _read_module(self.sparkSession, data, int(info.get("format", 1)), read)
        module.eval()
        model = TorchModel(module=module, layout=FeedLayout.from_dict(info["layout"]), output_kind=info["output_kind"],
                           history=info["history"], prediction_col=info["prediction_col"],
                           run_id=info.get("run_id"), options=info.get("options"))
        inference = info.get("inference", {})
        model.inference_gpus = float(inference.get("gpus_per_task", 0.0))
        model.inference_batch_size = int(inference.get("batch_size", 1024))
        model.output_shape = tuple(info.get("output_shape", ()))
        model.explicit_dtypes = list(info.get("explicit_dtypes", []))
        if info.get("generation"):
            from sparkdl.model.generation import Generation

            model.generation = Generation(**info["generation"])
        if model.layout.transformed:
            model.transform_fn = pickle.loads(read("transform_fn.pkl"))
        model._resetUid(metadata["uid"])  # a reloaded PipelineModel must keep its stage uids
        return model


def _read_module(spark: Any, data: str, version: int, read: Any) -> Any:
    """The saved module: format 2's skeleton with its tensor files read into it one tensor at a
    time; format 1's pickled module with state.pt."""
    import torch

    if version < 2:
        module = pickle.loads(read("module.pkl"))
        module.load_state_dict(torch.load(io.BytesIO(read("state.pt")), weights_only=True))
        return module
    from sparkdl.storage.files import list_names, locate, pyarrow_reaches
    from sparkdl.model.trained import load_parts, load_skeleton, check_complete
    from sparkdl.model.tensor_files import read_tensors

    module = load_skeleton(read("module.pkl"))
    directory = join(data, WEIGHTS_DIR)
    if pyarrow_reaches(directory):
        files = [join(directory, n) for n in list_names(locate(directory)) if n.endswith(".safetensors")]
        load_parts(module, files)
        names = {n for f in files for n in _names(f)}
    else:  # a Hadoop-only scheme: whole files through the session
        taken: dict[str, Any] = {}
        for index in range(1 << 20):
            try:
                payload = read_bytes(spark, join(directory, f"part-{index}.safetensors"))
            except FileNotFoundError:
                break
            taken.update(read_tensors(io.BytesIO(payload)))
        module.load_state_dict(taken, strict=False, assign=True)
        names = set(taken)
    check_complete(module, names)
    return module


def _names(uri: str) -> list[str]:
    from sparkdl.storage.files import locate, open_input
    from sparkdl.model.tensor_files import read_header

    with open_input(locate(uri)) as stream:
        return [e.name for e in read_header(stream).entries]


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except TypeError:
        return False
