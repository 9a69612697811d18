"""Saving and loading sparkdl's pyspark.ml stages in Spark ML's own layout: metadata/ (the class,
uid and Params, so Pipeline.load and PipelineModel.load find the stage) and data/ (the module's
weightless skeleton and tensor files for a TorchModel; the model object, base config and the Params
JSON cannot hold for a TorchEstimator); all through sparkdl/storage/files.py."""
from __future__ import annotations

import dataclasses
import io
import json
import pickle
import time
from typing import Any

from pyspark.ml.util import DefaultParamsReader, MLReader, MLWriter

from sparkdl.data.layout import FeedLayout
from sparkdl.errors import SparkdlError
from sparkdl.spark.session import facts
from sparkdl.storage.files import (delete_tree, exists, join, list_names, locate, pyarrow_reaches, read_all,
                                   read_bytes, write_atomic, write_bytes)

FORMAT_VERSION = 2  # 1: module.pkl held the weights too, with state.pt beside it (still read)
ESTIMATOR_FORMAT = 1
WEIGHTS_DIR = "weights"


class StageWriter(MLWriter):
    """Writes one sparkdl stage; overwrite() deletes the old one through pyarrow where it reaches."""

    def __init__(self, instance: Any) -> None:
        super().__init__()
        self.instance = instance

    def _handleOverwrite(self, path: str) -> None:
        if pyarrow_reaches(path):
            delete_tree(locate(path))
            return
        super()._handleOverwrite(path)


class StageReader(MLReader):
    """Reads one sparkdl stage of class `cls`."""

    def __init__(self, cls: type) -> None:
        super().__init__()
        self.cls = cls


class TorchModelWriter(StageWriter):
    """Params metadata in Spark's own layout (so PipelineModel.load finds the class), the model in
    data/: the module's weightless skeleton (module.pkl), its weights as tensor files (weights/,
    written a piece at a time from the tensors, or copied from the ranks' files when the model was
    never loaded) and sparkdl.json; all through sparkdl/storage/files.py."""

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

def save_metadata(spark: Any, instance: Any, path: str, params: dict[str, Any], defaults: dict[str, Any],
                  extra: dict[str, Any]) -> None:
    """Spark ML's metadata in its own format (PipelineModel.load and Pipeline.load find the class by
    it), with the Params JSON can hold: written from this process (on a cluster, Spark's own writer
    would put a local path on an executor's disk, and needs a Hadoop connector for object stores)."""
    metadata = {"class": f"{type(instance).__module__}.{type(instance).__name__}",
                "timestamp": int(time.time() * 1000), "sparkVersion": spark.version, "uid": instance.uid,
                "paramMap": params, "defaultParamMap": defaults, **extra}
    text = json.dumps(metadata, separators=(",", ":"))
    write_bytes(spark, join(path, "metadata", "part-00000"), (text + "\n").encode("utf-8"))
    write_bytes(spark, join(path, "metadata", "_SUCCESS"), b"")


def jsonable_params(param_map: dict[Any, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the values JSON holds, the rest) of a Params map, by Param name."""
    plain = {p.name: v for p, v in param_map.items() if _jsonable(v)}
    return plain, {p.name: v for p, v in param_map.items() if p.name not in plain}


def _save_metadata(spark: Any, model: Any, path: str) -> None:
    params, _ = jsonable_params(model._paramMap)  # noqa: SLF001 - Spark's own Params maps
    defaults, _ = jsonable_params(model._defaultParamMap)  # noqa: SLF001
    save_metadata(spark, model, path, params, defaults, {"sparkdlFormat": FORMAT_VERSION})


def _load_metadata(spark: Any, path: str) -> dict[str, Any]:
    if not pyarrow_reaches(path):
        return DefaultParamsReader.loadMetadata(path, facts(spark).metadata_context())
    metadata = locate(path).child("metadata")
    parts = [n for n in list_names(metadata) if n.startswith("part-")]
    if not parts:
        raise FileNotFoundError(metadata.path)
    text = read_all(metadata.child(parts[0])).decode("utf-8").strip().splitlines()[0]
    return DefaultParamsReader._parseMetaData(text)  # noqa: SLF001 - Spark's own format


def _write_weights(spark: Any, directory: str, model: Any) -> None:
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


class TorchModelReader(StageReader):
    """TorchModel.load: the module from its skeleton and tensor files, the rest from sparkdl.json."""

    def load(self, path: str) -> Any:
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
        model = self.cls(module=module, layout=FeedLayout.from_dict(info["layout"]), output_kind=info["output_kind"],
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
        DefaultParamsReader.getAndSetParams(model, metadata)  # the score columns (none before format 2's Params)
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


class TorchEstimatorWriter(StageWriter):
    """TorchEstimator.save (a Pipeline's save too): its Params in the metadata where JSON holds them;
    the model object (pickled by value, with its weights), the base config and any Param JSON
    cannot hold (a callable loss, a tokenizer) in data/estimator.pkl. validation_df is not saved
    (a DataFrame belongs to its session)."""

    def saveImpl(self, path: str) -> None:
        from sparkdl.driver.shipping import ship_by_value
        from sparkdl.wire.codec import dumps_any

        estimator = self.instance
        if pyarrow_reaches(path) and exists(locate(path).child("metadata")):
            raise SparkdlError(f"{path!r} already holds a saved stage",
                               hint="estimator.write().overwrite().save(path) replaces it")
        if estimator.validation_df is not None:
            import warnings

            warnings.warn("sparkdl: TorchEstimator.save keeps no validation_df (a DataFrame belongs to its session); "
                          "pass validation_df= to the loaded estimator again, or use validation_fraction", stacklevel=3)
        params, pickled = jsonable_params(estimator._paramMap)  # noqa: SLF001 - Spark's own Params maps
        defaults, _ = jsonable_params(estimator._defaultParamMap)  # noqa: SLF001 - the base config has them all
        ship_by_value(estimator.model, None, spark=self.sparkSession)  # a notebook's classes travel by value
        payload = dumps_any({"model": estimator.model, "base": estimator.base_config, "params": pickled,
                             "plan": estimator.plan})
        write_bytes(self.sparkSession, join(path, "data", "estimator.pkl"), payload)
        save_metadata(self.sparkSession, estimator, path, params, defaults, {"sparkdlFormat": ESTIMATOR_FORMAT})

class TorchEstimatorReader(StageReader):
    """TorchEstimator.load (and Pipeline.load): the estimator with the Params it was saved with."""

    def load(self, path: str) -> Any:
        try:
            metadata = _load_metadata(self.sparkSession, path)
            saved = pickle.loads(read_bytes(self.sparkSession, join(path, "data", "estimator.pkl")))
        except Exception:  # noqa: BLE001 - Hadoop's "input path does not exist" arrives as a Py4J error
            raise SparkdlError(f"{path!r} is not a saved TorchEstimator (no metadata or data/estimator.pkl there)",
                               hint="pass the directory written by TorchEstimator.save(path)") from None
        estimator = self.cls(saved["model"], config=saved["base"], plan=saved["plan"])
        estimator._resetUid(metadata["uid"])  # a reloaded Pipeline keeps its stage uids
        for name, value in {**metadata["paramMap"], **saved["params"]}.items():
            estimator._set(**{name: value})
        return estimator
