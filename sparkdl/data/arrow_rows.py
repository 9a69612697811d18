"""Arrow side of the spool: decode incoming mapInArrow batches into numpy row blocks, and write
them re-chunked into the spool's IPC file. Split from batches.py, which serves epochs from it.
No pyspark here: this runs inside executors."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from sparkdl.data.layout import FeedLayout
from sparkdl.errors import ArrayLengthError, ColumnTypeError, ConfigError, MissingColumnError, NullValuesError

Arrays = tuple[np.ndarray, np.ndarray | None]
_LABEL_DTYPES = {"int64": np.dtype(np.int64), "float32": np.dtype(np.float32)}
_PREPARE_HINT = "feed the DataFrame through sparkdl.data.feed.prepare, which selects and casts columns"


def _column(batch: pa.RecordBatch, name: str) -> pa.Array:
    index = batch.schema.get_field_index(name)
    if index < 0:
        raise MissingColumnError(f"column {name!r} is missing from the Arrow batches reaching the "
                                 f"worker (columns: {batch.schema.names})", hint=_PREPARE_HINT)
    return batch.column(index)


def _feature_rows(column: pa.Array, name: str, num_features: int) -> np.ndarray:
    """(rows, num_features) float32 view of a list, large_list or fixed_size_list column."""
    if column.null_count:
        raise NullValuesError(f"column {name!r} holds {column.null_count} null feature rows",
                              hint="drop rows with null features before training (df.dropna())")
    if pa.types.is_fixed_size_list(column.type):
        width = column.type.list_size
        if width != num_features and len(column):
            raise ArrayLengthError(f"column {name!r} holds arrays of length {width}, expected "
                                   f"{num_features}", hint="prepare the feed again for this DataFrame")
        # .values ignores the array's own offset (a sliced array): slice the values ourselves.
        values = column.values.slice(column.offset * width, len(column) * width)
    elif pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        # .offsets already honours the array's offset, but need not start at 0 in .values.
        offsets = column.offsets.to_numpy()
        lengths = np.diff(offsets)
        bad = np.flatnonzero(lengths != num_features)
        if bad.size:
            raise ArrayLengthError(
                f"column {name!r}: {bad.size} row(s) of a batch do not hold {num_features} values "
                f"(the first holds {int(lengths[bad[0]])})",
                hint="every row's feature array must have the same length: pad or filter the rows")
        values = column.values.slice(int(offsets[0]), len(column) * num_features)
    else:
        raise ColumnTypeError(f"column {name!r} has Arrow type {column.type}, expected a list of "
                              "float32", hint=_PREPARE_HINT)
    if not (pa.types.is_floating(values.type) or pa.types.is_integer(values.type)):
        raise ColumnTypeError(f"column {name!r} holds arrays of {values.type}, expected float32",
                              hint=_PREPARE_HINT)
    if values.null_count:
        raise NullValuesError(f"column {name!r} holds {values.null_count} nulls inside its arrays",
                              hint="fill or drop rows whose feature arrays contain nulls")
    # float32 (what prepare sends) stays a view; anything else is converted once, here.
    flat = values.to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    return flat.reshape(len(column), num_features)


def _label_rows(column: pa.Array, name: str, dtype: np.dtype) -> np.ndarray:
    if column.null_count:
        raise NullValuesError(f"column {name!r} holds {column.null_count} null labels",
                              hint="drop rows without a label before training")
    integral = pa.types.is_integer(column.type)
    if not (integral or pa.types.is_floating(column.type)) or (dtype.kind == "i" and not integral):
        raise ColumnTypeError(f"column {name!r} has Arrow type {column.type}, expected {dtype}",
                              hint=_PREPARE_HINT)
    return column.to_numpy(zero_copy_only=False).astype(dtype, copy=False)


def _label_dtype(layout: FeedLayout) -> np.dtype | None:
    if layout.label_dtype not in (None, *_LABEL_DTYPES):
        raise ConfigError(f"label_dtype must be one of {sorted(_LABEL_DTYPES)}, got {layout.label_dtype!r}")
    return None if layout.label_dtype is None else _LABEL_DTYPES[layout.label_dtype]


def incoming_arrays(batch: pa.RecordBatch, layout: FeedLayout) -> Arrays:
    features, labels, dtype = layout.feature_column, layout.label_column, _label_dtype(layout)
    rows = _feature_rows(_column(batch, features), features, layout.num_features)
    return rows, None if dtype is None else _label_rows(_column(batch, labels), labels, dtype)


def spool_schema(layout: FeedLayout) -> pa.Schema:
    fields = [pa.field(layout.feature_column, pa.list_(pa.float32(), layout.num_features), False)]
    dtype = _label_dtype(layout)
    if dtype is not None:
        fields.append(pa.field(layout.label_column, pa.from_numpy_dtype(dtype), False))
    return pa.schema(fields)


class ChunkWriter:
    """Re-chunks Spark's small (10k-row) batches into contiguous blocks of about chunk_bytes, so
    reads touch few blocks and most in-order batches are zero-copy. The one buffer is reused: the
    IPC writer has copied it into the file by the time write_batch returns."""

    def __init__(self, writer: pa.ipc.RecordBatchFileWriter, layout: FeedLayout, chunk_bytes: int):
        self._writer, self._schema, self._width = writer, spool_schema(layout), layout.num_features
        self._label_dtype = _label_dtype(layout)
        row_bytes = 4 * self._width + (self._label_dtype.itemsize if self._label_dtype else 0)
        self._capacity = max(1, chunk_bytes // max(1, row_bytes))
        self._features: np.ndarray | None = None
        self._labels: np.ndarray | None = None  # both allocated on the first row
        self._fill = 0

    def add(self, features: np.ndarray, labels: np.ndarray | None) -> None:
        done = 0
        while done < len(features):
            if self._features is None:  # so that a 0-row partition allocates nothing
                self._features = np.empty((self._capacity, self._width), np.float32)
                if self._label_dtype is not None:
                    self._labels = np.empty(self._capacity, self._label_dtype)
            take = min(len(features) - done, self._capacity - self._fill)
            self._features[self._fill : self._fill + take] = features[done : done + take]
            if self._labels is not None and labels is not None:
                self._labels[self._fill : self._fill + take] = labels[done : done + take]
            self._fill, done = self._fill + take, done + take
            if self._fill == self._capacity:
                self.flush()

    def flush(self) -> None:
        if self._fill == 0 or self._features is None:
            return
        values = pa.array(self._features[: self._fill].reshape(-1))
        columns = [pa.FixedSizeListArray.from_arrays(values, self._width)]
        if self._labels is not None:
            columns.append(pa.array(self._labels[: self._fill]))
        self._writer.write_batch(pa.record_batch(columns, schema=self._schema))
        self._fill = 0
