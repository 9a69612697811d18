"""Executor side of TorchModel.transform: run the module over Arrow batches, append predictions.

Worker-side module: never imports pyspark.sql. The module arrives as cloudpickled bytes in a
broadcast variable and is unpickled once per Python worker, not once per task or batch.
"""
from __future__ import annotations

import os
import pickle
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import pyarrow as pa

# "text": generated continuations (language models fitted with a tokenizer); "embedding": pooled hidden states
OUTPUT_KINDS = ("class", "classes", "binary", "value", "values", "text", "embedding")
_MODULE_CACHE: dict[tuple[str, str], Any] = {}


def task_gpu_addresses() -> list[str]:
    """The GPU addresses Spark gave this task (its task or stage ResourceProfile); [] without any."""
    from pyspark import TaskContext

    context = TaskContext.get()
    gpu = context.resources().get("gpu") if context is not None else None
    return list(gpu.addresses) if gpu is not None else []


def inference_device(addresses: list[str], cuda_available: bool, visible: str | None = None) -> str:
    """The torch device for a task: its first assigned GPU when CUDA works, otherwise the CPU.
    Tasks sharing a GPU (fractional amounts) all get the same address and so the same device.
    `visible` is CUDA_VISIBLE_DEVICES as CUDA saw it when it started in this process (a training
    task may have narrowed it, and CUDA keeps that view for the life of the Python worker)."""
    if not addresses or not cuda_available:
        return "cpu"
    narrowed = [v.strip() for v in (visible or "").split(",") if v.strip()]
    if not narrowed:
        return f"cuda:{int(addresses[0])}"
    if addresses[0] in narrowed:
        return f"cuda:{narrowed.index(addresses[0])}"
    # This worker's CUDA cannot see the assigned GPU any more: score on the one it can see rather
    # than fail the task (the GPU is shared for this partition's duration).
    warnings.warn(f"sparkdl: GPU {addresses[0]} is not visible to this Python worker (CUDA started with "
                  f"CUDA_VISIBLE_DEVICES={visible}); scoring on GPU {narrowed[0]}")
    return "cuda:0"


# Kinds that also write a classifier's scores (rawPrediction, probability) beside the prediction.
SCORED_KINDS = ("class", "binary")


@dataclass(frozen=True)
class ScoreColumns:
    """The columns transform writes, as Spark ML's classifiers name them: the prediction (a double for
    "class", "binary" and "value"); for classifiers the raw scores and probabilities as arrays of
    doubles here, made vectors by the driver's plan (api.predict). "" leaves a column out."""

    prediction: str = "prediction"
    probability: str = "probability"
    raw_prediction: str = "rawPrediction"

    def scores(self, output_kind: str) -> tuple[str, ...]:
        """The score columns written beside the prediction for this kind, raw scores first."""
        if output_kind not in SCORED_KINDS:
            return ()
        return tuple(c for c in (self.raw_prediction, self.probability) if c)


def prediction_arrow_type(output_kind: str) -> pa.DataType:
    if output_kind in ("class", "binary", "value"):
        return pa.float64()
    if output_kind == "classes":
        return pa.list_(pa.int64())
    if output_kind == "text":
        return pa.string()
    return pa.list_(pa.float32())


def features_matrix(column: pa.Array | pa.ChunkedArray, num_features: int) -> np.ndarray:
    """(rows, num_features) float32 from a list<float> column, straight from its values buffer."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if column.null_count:
        raise ValueError(f"{column.null_count} row(s) have null features; fill or drop them before transform")
    lengths = np.diff(column.offsets.to_numpy(zero_copy_only=False))
    if len(lengths) and (lengths.min() != num_features or lengths.max() != num_features):
        raise ValueError(f"every row must have {num_features} feature values (the model was trained on "
                         f"{num_features}); found rows with {lengths.min()} to {lengths.max()}")
    values = column.flatten()
    if values.null_count:
        raise ValueError(f"{values.null_count} feature value(s) are null; fill or drop them before transform")
    flat = values.to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    return flat.reshape(len(column), num_features)


def to_predictions(output: Any, output_kind: str) -> pa.Array:
    if output_kind == "text":
        return pa.array(list(output), pa.string())
    out = output.detach().float().cpu()
    if output_kind == "class":  # a double, as Spark ML's classifiers write it
        return pa.array(out.argmax(dim=1).numpy().astype(np.float64))
    if output_kind == "binary":
        return pa.array((out.reshape(-1) > 0).numpy().astype(np.float64))
    if output_kind == "value":
        return pa.array(out.reshape(-1).double().numpy())
    if output_kind == "classes":  # (B, T, C) -> T class indices per row
        classes = out.argmax(dim=-1).reshape(out.shape[0], -1).numpy().astype(np.int64)
        offsets = pa.array(np.arange(0, classes.size + 1, max(1, classes.shape[1]), dtype=np.int32))
        return pa.ListArray.from_arrays(offsets, pa.array(classes.reshape(-1)))
    values = out.reshape(out.shape[0], -1).numpy()
    offsets = pa.array(np.arange(0, values.size + 1, values.shape[1], dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(values.reshape(-1), pa.float32()))


def class_scores(output: Any, output_kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(raw scores, probabilities), (rows, classes) float64: a "class" model's logits and their
    softmax; a "binary" model's one logit z as [-z, z] and [1 - sigmoid(z), sigmoid(z)], as Spark's
    LogisticRegression writes them (so BinaryClassificationEvaluator reads index 1)."""
    import torch

    out = output.detach().double().cpu()
    if output_kind == "binary":
        z = out.reshape(-1)
        p = torch.sigmoid(z)  # not softmax([-z, z]), which is sigmoid(2z)
        return torch.stack([-z, z], dim=1).numpy(), torch.stack([1 - p, p], dim=1).numpy()
    raw = out.reshape(out.shape[0], -1)
    return raw.numpy(), torch.softmax(raw, dim=1).numpy()


def _vector_array(matrix: np.ndarray) -> pa.Array:
    offsets = pa.array(np.arange(0, matrix.size + 1, max(1, matrix.shape[1]), dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(matrix.reshape(-1), pa.float64()))


def output_columns(output: Any, output_kind: str, columns: ScoreColumns) -> dict[str, pa.Array]:
    """Every column transform writes for one batch of the module's output, by name."""
    written = {columns.prediction: to_predictions(output, output_kind)}
    if columns.scores(output_kind):
        raw, probability = class_scores(output, output_kind)
        for name, values in ((columns.raw_prediction, raw), (columns.probability, probability)):
            if name:
                written[name] = _vector_array(values)
    return written


def empty_columns(output_kind: str, columns: ScoreColumns) -> dict[str, pa.Array]:
    written = {columns.prediction: pa.array([], prediction_arrow_type(output_kind))}
    written.update({name: pa.array([], pa.list_(pa.float64())) for name in columns.scores(output_kind)})
    return written


def _appended(batch: pa.RecordBatch, columns: list[dict[str, pa.Array]]) -> pa.RecordBatch:
    """`batch` with the written columns of its chunks appended (concatenated per name)."""
    for name in columns[0]:
        parts = [c[name] for c in columns]
        batch = batch.append_column(name, pa.concat_arrays(parts) if len(parts) > 1 else parts[0])
    return batch


def _tensor_predictions(served: Any, module: Any, device: str, batches: Iterator[pa.RecordBatch],
                        columns: ScoreColumns, batch_size: int) -> Iterator[pa.RecordBatch]:
    """input_cols models: the prepared input columns through the training conversion (and
    transform_fn), then the model; the prepared columns are dropped again."""
    from dataclasses import replace

    from sparkdl.data.arrow_rows import incoming_arrays

    served = replace(served, module=module)
    layout = served.input_layout
    prepared = [c.column for c in layout.inputs]
    for batch in batches:
        kept = batch.select([n for n in batch.schema.names if n not in prepared])
        if batch.num_rows == 0:
            yield _appended(kept, [empty_columns(served.output_kind, columns)])
            continue
        out = served.scores(incoming_arrays(batch, layout), device, batch_size)
        yield _appended(kept, [output_columns(out, served.output_kind, columns)])


def make_predict_fn(module_broadcast: Any, model_key: str, feature_column: str, num_features: int,
                    output_kind: str, columns: ScoreColumns, batch_size: int,
                    served: Any = None) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """`model_key` is unique per transform call: a reused Python worker must never score with the
    module cached for an earlier model."""

    def sparkdl_predict(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import torch

        from sparkdl.model.calling import output_of

        device = inference_device(task_gpu_addresses(), torch.cuda.is_available(),
                                  os.environ.get("CUDA_VISIBLE_DEVICES"))
        if served is not None and served.layout.sparse:
            device = "cpu"  # embedding tables (maybe mapped files) are looked up where they are, never copied
        key = (model_key, device)
        if key not in _MODULE_CACHE:
            if _MODULE_CACHE:
                _MODULE_CACHE.clear()  # one model per worker at a time keeps executor (and GPU) memory bounded
                if torch.cuda.is_initialized():
                    torch.cuda.empty_cache()  # hand the evicted model's cached blocks back to the GPU
            module = pickle.loads(module_broadcast.value)
            module.eval()
            _MODULE_CACHE[key] = module.to(device)
        module = _MODULE_CACHE[key]
        if served is not None:
            yield from _tensor_predictions(served, module, device, batches, columns, batch_size)
            return
        for batch in batches:
            index = batch.schema.get_field_index(feature_column)
            matrix = features_matrix(batch.column(index), num_features)
            kept = batch.remove_column(index)
            outputs = []
            with torch.inference_mode(), warnings.catch_warnings():
                # The Arrow buffers are read-only; inference never writes to its input.
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                for start in range(0, max(len(matrix), 1), batch_size):
                    chunk = matrix[start: start + batch_size]
                    if len(chunk) == 0:
                        continue
                    out = output_of(module, torch.from_numpy(chunk).to(device))
                    outputs.append(output_columns(out, output_kind, columns))
            yield _appended(kept, outputs or [empty_columns(output_kind, columns)])

    return sparkdl_predict
