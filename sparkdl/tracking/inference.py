"""Executor side of TorchModel.transform: run the module over Arrow batches, append predictions.

Worker-side module: never imports pyspark.sql. The module arrives as cloudpickled bytes in a
broadcast variable and is unpickled once per Python worker, not once per task or batch.
"""
from __future__ import annotations

import os
import pickle
import warnings
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


def prediction_arrow_type(output_kind: str) -> pa.DataType:
    if output_kind in ("class", "binary"):
        return pa.int64()
    if output_kind == "value":
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
    if output_kind == "class":
        return pa.array(out.argmax(dim=1).numpy().astype(np.int64))
    if output_kind == "binary":
        return pa.array((out.reshape(-1) > 0).numpy().astype(np.int64))
    if output_kind == "value":
        return pa.array(out.reshape(-1).double().numpy())
    if output_kind == "classes":  # (B, T, C) -> T class indices per row
        classes = out.argmax(dim=-1).reshape(out.shape[0], -1).numpy().astype(np.int64)
        offsets = pa.array(np.arange(0, classes.size + 1, max(1, classes.shape[1]), dtype=np.int32))
        return pa.ListArray.from_arrays(offsets, pa.array(classes.reshape(-1)))
    values = out.reshape(out.shape[0], -1).numpy()
    offsets = pa.array(np.arange(0, values.size + 1, values.shape[1], dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(values.reshape(-1), pa.float32()))


def _tensor_predictions(served: Any, module: Any, device: str, batches: Iterator[pa.RecordBatch],
                        prediction_col: str, batch_size: int) -> Iterator[pa.RecordBatch]:
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
            yield kept.append_column(prediction_col, pa.array([], prediction_arrow_type(served.output_kind)))
            continue
        out = served.scores(incoming_arrays(batch, layout), device, batch_size)
        yield kept.append_column(prediction_col, to_predictions(out, served.output_kind))


def make_predict_fn(module_broadcast: Any, model_key: str, feature_column: str, num_features: int,
                    output_kind: str, prediction_col: str, batch_size: int,
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
            yield from _tensor_predictions(served, module, device, batches, prediction_col, batch_size)
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
                    outputs.append(to_predictions(output_of(module, torch.from_numpy(chunk).to(device)), output_kind))
            predictions = pa.concat_arrays(outputs) if outputs else pa.array([], prediction_arrow_type(output_kind))
            yield kept.append_column(prediction_col, predictions)

    return sparkdl_predict
