"""Rows of the spool's columns -> the batch a model trains on. Runs inside executors (and on the
driver for the probe batch); no pyspark.

feature_cols layouts give `(features (B, d) float32, labels)`. input_cols layouts give
`(inputs, label, weight)`: inputs a tuple (positional forward arguments) or a dict (keywords) of
tensors with the batch as dim 0, each `(B, *shape)` in its column's dtype. With transform_fn the
raw columns (fixed ones as numpy arrays, binary as a list of bytes, strings as a list of str,
variable-length arrays as a list of numpy arrays) go through it first.
"""
from __future__ import annotations

import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Optional, Union

import numpy as np
import pyarrow as pa
import torch

from sparkdl.data.arrow_rows import Arrays
from sparkdl.data.layout import BINARY, FIXED, TEXT, FeedLayout, TensorColumn
from sparkdl.data.text import TOKEN_LABELS
from sparkdl.errors import ModelError

Assemble = Callable[[Arrays], Any]
# One batch as the model sees it: (inputs, label, weight); inputs one tensor, a tuple, or a dict (input_cols
# given as a dict); label and weight None where the run has none.
ModelInputs = Union[torch.Tensor, tuple[torch.Tensor, ...], dict[str, torch.Tensor]]
SampleBatch = tuple[ModelInputs, Optional[torch.Tensor], Optional[torch.Tensor]]
_NUMPY_DTYPES = {"bfloat16": "float32", "float16": "float16"}  # numpy has no bfloat16: converted in torch


def as_tensor(array: np.ndarray) -> torch.Tensor:
    if array.flags.writeable:
        return torch.from_numpy(array)
    # A view of the read-only mapping: sharing it is the point, so silence torch rather than copy.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
        return torch.from_numpy(array)


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _fixed(block: np.ndarray, column: TensorColumn) -> np.ndarray:
    return block.reshape(len(block), *column.shape) if column.shape else block


def _raw(block: Any, column: TensorColumn) -> Any:
    """What transform_fn receives for one column."""
    if column.kind == FIXED:
        values = _fixed(block, column)
        return values.astype(_NUMPY_DTYPES.get(column.dtype, column.dtype), copy=False)
    if column.kind in (BINARY, TEXT):
        return block.to_pylist()
    offsets = block.offsets.to_numpy()  # ragged: one numpy view per row
    values = block.values.to_numpy(zero_copy_only=False)
    return [values[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


def _to_tensor(value: Any, column: TensorColumn, explicit: bool) -> torch.Tensor:
    """A transform_fn output (or a fixed column) as a tensor of the column's dtype."""
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        value = torch.stack(list(value))
    elif isinstance(value, (list, tuple)):
        value = np.stack(value) if value and isinstance(value[0], np.ndarray) else np.asarray(value)
    tensor = value if isinstance(value, torch.Tensor) else as_tensor(np.ascontiguousarray(value))
    if explicit and column.dtype:
        return tensor.to(_torch_dtype(column.dtype))
    return tensor.float() if tensor.dtype == torch.float64 else tensor  # numpy's default float: the model's is 32


class TensorAssembler:
    """Spool rows -> (inputs, label, weight) for an input_cols layout; `transform_seconds` sums the
    time spent in transform_fn (reported in the history)."""

    def __init__(self, layout: FeedLayout, transform_fn: Callable[[dict], dict] | None = None,
                 explicit_dtypes: frozenset[str] = frozenset()) -> None:
        self.layout = layout
        self.transform_fn = transform_fn
        self.explicit = explicit_dtypes  # columns whose dtype input_dtypes set (transform outputs follow it)
        self.transform_seconds = 0.0
        self._names = [c.source for c in layout.inputs]

    def __call__(self, arrays: Arrays) -> tuple[Any, torch.Tensor | None, torch.Tensor | None]:
        columns = self.layout.inputs
        raw = {c.source: _raw(block, c) for c, block in zip(columns, arrays)}
        if self.transform_fn is not None:
            raw = self._transformed(raw)
            tensors = [_to_tensor(raw[c.source], c, c.source in self.explicit) for c in columns]
        else:
            tensors = [_to_tensor(raw[c.source], c, True) for c in columns]
        rest = list(arrays[len(columns):])
        label = weight = None
        if self.layout.label is not None:
            label = _to_tensor(_fixed(rest.pop(0), self.layout.label), self.layout.label, True)
        elif self.transform_fn is not None and TOKEN_LABELS in raw:
            label = as_tensor(np.ascontiguousarray(raw[TOKEN_LABELS]))  # a text's own tokens (data/text.py)
        if self.layout.weight_column is not None:
            weight = as_tensor(rest.pop(0))
        inputs: Any = {c.key: t for c, t in zip(columns, tensors)} if self.layout.keyword_inputs else tuple(tensors)
        if self.layout.keyword_inputs and self.transform_fn is not None:
            for name in getattr(self.transform_fn, "extra_outputs", ()):  # a tokenizer's attention mask, ...
                if name in raw:
                    inputs[name] = as_tensor(np.ascontiguousarray(raw[name]))
        if self.layout.label_keyword is not None and label is not None:
            inputs[self.layout.label_keyword] = label  # loss="model": the model computes its loss from them
        return inputs, label, weight

    def _transformed(self, raw: dict[str, Any]) -> dict[str, Any]:
        started = time.perf_counter()
        try:
            out = self.transform_fn(raw)
        except Exception as exc:  # noqa: BLE001 - the user's function can raise anything
            raise ModelError(f"transform_fn raised {type(exc).__name__}: {exc}",
                             hint="call it yourself on a dict of the input columns to debug it") from exc
        self.transform_seconds += time.perf_counter() - started
        if not isinstance(out, dict):
            raise ModelError(f"transform_fn returned {type(out).__name__}, not a dict of the model inputs",
                             hint=f"return a dict with the keys {self._names}")
        missing = [n for n in self._names if n not in out]
        if missing:
            raise ModelError(f"transform_fn returned no value for input column(s) {missing} (it returned "
                             f"{sorted(out)})", hint=f"return a dict with the keys {self._names}")
        rows = len(next(iter(raw.values()))) if raw else 0
        if getattr(self.transform_fn, "packing", False):  # rows joined and cut into blocks: a count of its own
            rows = len(out[self._names[0]])
        for name in self._names:
            try:
                got = len(out[name])
            except TypeError:
                got = 0  # a 0-d value: no batch dimension at all
            if got != rows:
                raise ModelError(f"transform_fn returned {got} rows for input column {name!r}, but the batch "
                                 f"holds {rows}", hint="return one entry per input row, the batch as dim 0")
        return out


class SparseAssembler:
    """Spool rows -> ((dense, {column: Bag}), label, weight) for a sparse_cols layout: dense the
    (B, num_features) float32 features (B x 0 without feature_cols), one Bag of table rows per
    categorical column (one id per row, or a multi-hot list with optional weights)."""

    def __init__(self, layout: FeedLayout) -> None:
        self.layout = layout

    def __call__(self, arrays: Arrays) -> tuple[Any, torch.Tensor | None, torch.Tensor | None]:
        from sparkdl.embeddings.bags import Bag

        layout, rest = self.layout, list(arrays)
        dense = None
        if layout.dense_inputs:
            dense = as_tensor(_fixed(rest.pop(0), layout.dense_inputs[0]))
        sparse: dict[str, Bag] = {}
        for feature in layout.sparse:
            ids_block = rest.pop(0)
            weights_block = rest.pop(0) if feature.source_weights is not None else None
            if not feature.multi_hot:
                ids = as_tensor(np.ascontiguousarray(ids_block, dtype=np.int64))
                sparse[feature.source] = Bag(ids, torch.arange(ids.numel(), dtype=torch.int64))
                continue
            ids, offsets = _list_parts(ids_block, np.int64)
            weights = as_tensor(_list_parts(weights_block, np.float32)[0]) if weights_block is not None else None
            sparse[feature.source] = Bag(as_tensor(ids), as_tensor(offsets[:-1]), weights)
        rows = next(iter(sparse.values())).num_bags if sparse else 0
        if dense is None:
            dense = torch.zeros(rows, 0)
        label = weight = None
        if layout.label is not None:
            label = _to_tensor(_fixed(rest.pop(0), layout.label), layout.label, True)
        if layout.weight_column is not None:
            weight = as_tensor(rest.pop(0))
        return (dense, sparse), label, weight


def _list_parts(block: Any, dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets from 0) of a (possibly sliced) Arrow list array, as contiguous numpy."""
    offsets = block.offsets.to_numpy().astype(np.int64)
    values = block.values.to_numpy(zero_copy_only=False)[offsets[0]:offsets[-1]]
    return np.ascontiguousarray(values, dtype=dtype), offsets - offsets[0]


def feature_batch(arrays: Arrays) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(features, labels) of a feature_cols layout, zero-copy views of the spool."""
    return as_tensor(arrays[0]), as_tensor(arrays[1]) if len(arrays) > 1 and arrays[1] is not None else None


class WeightedFeatureBatch:
    """(features, labels, weights) of a feature_cols layout with weight_col (labels None without one)."""

    def __init__(self, has_label: bool) -> None:
        self.has_label = has_label

    def __call__(self, arrays: Arrays) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        label = as_tensor(arrays[1]) if self.has_label else None
        return as_tensor(arrays[0]), label, as_tensor(arrays[-1])


def assembler(layout: FeedLayout, transform_fn: Callable[[dict], dict] | None = None,
              explicit_dtypes: frozenset[str] = frozenset()) -> Assemble:
    if layout.sparse:
        return SparseAssembler(layout)
    if layout.tensor_inputs:
        return TensorAssembler(layout, transform_fn, explicit_dtypes)
    return WeightedFeatureBatch(layout.label_dtype is not None) if layout.weight_column else feature_batch


def prefetched(batches: Iterator[Any], depth: int) -> Iterator[Any]:
    """`batches` produced `depth` ahead on a background thread (decoding overlaps the step); an
    exception there is raised here, at the batch it stopped at. Closing the iterator early (a
    break, an exception in the step) stops the thread within ~0.1 s and drops what it made."""
    if depth <= 0:
        yield from batches
        return
    ready: queue.Queue = queue.Queue(maxsize=depth)
    done, stop = object(), threading.Event()

    def hand_over(item: tuple[bool, Any]) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in batches:
                if not hand_over((True, item)):
                    return
            hand_over((True, done))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            hand_over((False, exc))

    worker = threading.Thread(target=produce, name="sparkdl-prefetch", daemon=True)
    worker.start()
    try:
        while True:
            ok, item = ready.get()
            if not ok:
                raise item
            if item is done:
                return
            yield item
    finally:
        stop.set()
        while not ready.empty():  # release what was made ahead (views of the spool's mapping)
            ready.get_nowait()
        worker.join(timeout=5)


def sample_batch(table: pa.Table, layout: FeedLayout, transform_fn: Callable[[dict], dict] | None,
                 explicit_dtypes: frozenset[str] = frozenset()) -> SampleBatch:
    """The probe batch of the driver: a few prepared rows through the workers' own conversion."""
    from sparkdl.data.arrow_rows import incoming_arrays

    batch = table.combine_chunks().to_batches()[0] if table.num_rows else None
    if batch is None:
        raise ModelError("no rows to probe the model with", hint="the DataFrame must hold rows")
    return assembler(layout, transform_fn, explicit_dtypes)(incoming_arrays(batch, layout))
