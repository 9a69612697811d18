"""Arrow side of the spool: decode incoming mapInArrow batches into per-column row blocks, and write
them re-chunked into the spool's IPC file. Split from batches.py, which serves epochs from it.
No pyspark here: this runs inside executors.

Every layout is a list of spool columns (`spool_columns`): a fixed column (a number or a
fixed-length array per row) becomes one contiguous numpy block `(rows,)` or `(rows, width)` per
chunk, zero-copy from Arrow; binary, string and variable-length columns stay Arrow arrays.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Union

import numpy as np
import pyarrow as pa

from sparkdl.data.layout import BINARY, FIXED, RAGGED, TEXT, FeedLayout, TensorColumn
from sparkdl.errors import ArrayLengthError, ColumnTypeError, ConfigError, MissingColumnError, NullValuesError

Block = Union[np.ndarray, pa.Array]
Arrays = tuple  # one Block per spool column, in spool_columns order
_LABEL_DTYPES = ("int64", "float32")
_PREPARE_HINT = "feed the DataFrame through sparkdl.data.feed.prepare, which selects and casts columns"


@dataclass(frozen=True)
class SpoolColumn:
    name: str
    kind: str  # FIXED, BINARY, RAGGED or TEXT (layout.py)
    storage: str  # numpy dtype of the values (fixed and ragged columns)
    width: int = 1  # values per row of a fixed column
    scalar: bool = False  # one value per row: blocks of shape (rows,), not (rows, width)
    what: str = "feature"  # for messages: "feature", "label", "input", "weight"

    @property
    def row_bytes(self) -> int:
        return np.dtype(self.storage).itemsize * self.width if self.kind == FIXED else 0

    def arrow_type(self) -> pa.DataType:
        if self.kind == BINARY:
            return pa.large_binary()
        if self.kind == TEXT:
            return pa.large_string()
        element = pa.from_numpy_dtype(np.dtype(self.storage))
        if self.kind == RAGGED:
            return pa.large_list(element)
        return element if self.scalar else pa.list_(element, self.width)


def _from_tensor_column(column: TensorColumn, what: str) -> SpoolColumn:
    return SpoolColumn(column.column, column.kind, column.storage or "uint8", column.width, column.scalar, what)


def spool_columns(layout: FeedLayout) -> tuple[SpoolColumn, ...]:
    """The columns a rank receives and spools, in order: the inputs, then the label, then the weight."""
    if layout.tensor_inputs:
        columns = [_from_tensor_column(c, "input") for c in layout.inputs]
        if layout.label is not None:
            columns.append(_from_tensor_column(layout.label, "label"))
        if layout.weight_column is not None:
            columns.append(SpoolColumn(layout.weight_column, FIXED, "float32", 1, True, "weight"))
        return tuple(columns)
    columns = [SpoolColumn(layout.feature_column, FIXED, "float32", layout.num_features)]
    if layout.label_dtype not in (None, *_LABEL_DTYPES):
        raise ConfigError(f"label_dtype must be one of {sorted(_LABEL_DTYPES)}, got {layout.label_dtype!r}")
    if layout.label_dtype is not None:
        columns.append(SpoolColumn(layout.label_column, FIXED, layout.label_dtype, 1, True, "label"))
    if layout.weight_column is not None:
        columns.append(SpoolColumn(layout.weight_column, FIXED, "float32", 1, True, "weight"))
    return tuple(columns)


def slice_rows(block: Block, start: int, stop: int) -> Block:
    """Rows start:stop of one column block (a numpy view, or a zero-copy Arrow slice)."""
    return block[start:stop] if isinstance(block, np.ndarray) else block.slice(start, stop - start)


def _column(batch: pa.RecordBatch, name: str) -> pa.Array:
    index = batch.schema.get_field_index(name)
    if index < 0:
        raise MissingColumnError(f"column {name!r} is missing from the Arrow batches reaching the "
                                 f"worker (columns: {batch.schema.names})", hint=_PREPARE_HINT)
    return batch.column(index)


def _list_values(column: pa.Array, spec: SpoolColumn) -> pa.Array:
    """The values of a list, large_list or fixed_size_list column holding `spec.width` per row."""
    name, width = spec.name, spec.width
    if pa.types.is_fixed_size_list(column.type):
        if column.type.list_size != width and len(column):
            raise ArrayLengthError(f"column {name!r} holds arrays of length {column.type.list_size}, expected "
                                   f"{width}", hint="prepare the feed again for this DataFrame")
        # .values ignores the array's own offset (a sliced array): slice the values ourselves.
        return column.values.slice(column.offset * width, len(column) * width)
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        # .offsets already honours the array's offset, but need not start at 0 in .values.
        offsets = column.offsets.to_numpy()
        lengths = np.diff(offsets)
        bad = np.flatnonzero(lengths != width)
        if bad.size:
            raise ArrayLengthError(
                f"column {name!r}: {bad.size} row(s) of a batch do not hold {width} values "
                f"(the first holds {int(lengths[bad[0]])})",
                hint=f"every row's {spec.what} array must have the same length: pad or filter the rows")
        return column.values.slice(int(offsets[0]), len(column) * width)
    raise ColumnTypeError(f"column {name!r} has Arrow type {column.type}, expected a list of {spec.storage}",
                          hint=_PREPARE_HINT)


def _numeric(values: pa.Array, spec: SpoolColumn) -> np.ndarray:
    numeric = pa.types.is_floating(values.type) or pa.types.is_integer(values.type) or pa.types.is_boolean(values.type)
    if not numeric or (np.dtype(spec.storage).kind in "iu" and not pa.types.is_integer(values.type)):
        raise ColumnTypeError(f"column {spec.name!r} holds {values.type}, expected {spec.storage}", hint=_PREPARE_HINT)
    # What prepare sends stays a view; anything else is converted once, here.
    return values.to_numpy(zero_copy_only=False).astype(spec.storage, copy=False)


def _fixed_rows(column: pa.Array, spec: SpoolColumn) -> np.ndarray:
    """(rows,) or (rows, width) numpy view of one fixed column."""
    if column.null_count:
        raise NullValuesError(f"column {spec.name!r} holds {column.null_count} null {spec.what} rows",
                              hint=f"drop rows with null {spec.what}s before training (df.dropna())")
    if spec.scalar:
        return _numeric(column, spec)
    values = _list_values(column, spec)
    if values.null_count:
        raise NullValuesError(f"column {spec.name!r} holds {values.null_count} nulls inside its arrays",
                              hint="fill or drop rows whose arrays contain nulls")
    return _numeric(values, spec).reshape(len(column), spec.width)


def _variable_rows(column: pa.Array, spec: SpoolColumn) -> pa.Array:
    if column.null_count:
        raise NullValuesError(f"column {spec.name!r} holds {column.null_count} null values",
                              hint="drop or fill them before training")
    return column.cast(spec.arrow_type()) if column.type != spec.arrow_type() else column


def incoming_arrays(batch: pa.RecordBatch, layout: FeedLayout) -> Arrays:
    """One block per spool column of this record batch."""
    return tuple(_fixed_rows(_column(batch, c.name), c) if c.kind == FIXED else _variable_rows(_column(batch, c.name), c)
                 for c in spool_columns(layout))


def unpacked_batches(batches: Iterable[pa.RecordBatch], layout: FeedLayout) -> Iterator[pa.RecordBatch]:
    """Packed delivery (data/packed_delivery.py): each row of Spark's batches is a block of rows, one
    binary value per spool column holding its values row-major; each block becomes the record batch
    Spark's own rows would have made, viewing those bytes without a copy."""
    specs = spool_columns(layout)
    schema = spool_schema(layout)
    for batch in batches:
        columns = [_column(batch, spec.name) for spec in specs]
        for row in range(batch.num_rows):
            arrays = [_block_values(column, row, spec) for spec, column in zip(specs, columns)]
            if len({len(a) for a in arrays}) != 1:
                raise ConfigError(f"a packed block holds unequal row counts per column: {[len(a) for a in arrays]}",
                                  hint="set data.delivery='spark' and report this")
            if len(arrays[0]):
                yield pa.RecordBatch.from_arrays(arrays, schema=schema)


def _block_values(column: pa.Array, row: int, spec: SpoolColumn) -> pa.Array:
    """One binary value of a packed block as the spool column's Arrow array (no copy)."""
    offsets = np.frombuffer(column.buffers()[1], np.int32 if column.type == pa.binary() else np.int64,
                            2, (column.offset + row) * (4 if column.type == pa.binary() else 8))
    start, stop = int(offsets[0]), int(offsets[1])
    data = column.buffers()[2].slice(start, stop - start)
    rows = (stop - start) // spec.row_bytes
    values = pa.Array.from_buffers(pa.from_numpy_dtype(np.dtype(spec.storage)), rows * spec.width, [None, data])
    return values if spec.scalar else pa.FixedSizeListArray.from_arrays(values, spec.width)


def split_validation(batches: Iterable[pa.RecordBatch], column: str,
                     held_out: list[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """The training rows of each batch (split column 0); its validation rows (1) go to `held_out`."""
    import pyarrow.compute as pc

    for batch in batches:
        is_validation = pc.equal(batch.column(batch.schema.get_field_index(column)), 1)
        held_out.append(batch.filter(is_validation))
        yield batch.filter(pc.invert(is_validation))


def spool_schema(layout: FeedLayout) -> pa.Schema:
    return pa.schema([pa.field(c.name, c.arrow_type(), False) for c in spool_columns(layout)])


class ChunkWriter:
    """Re-chunks Spark's small (10k-row) batches into contiguous blocks of about chunk_bytes, so
    reads touch few blocks and most in-order batches are zero-copy. The fixed columns' buffers are
    reused: the IPC writer has copied them into the file by the time write_batch returns."""

    def __init__(self, writer: pa.ipc.RecordBatchFileWriter, layout: FeedLayout, chunk_bytes: int):
        self._writer, self._schema, self._columns = writer, spool_schema(layout), spool_columns(layout)
        row_bytes = sum(c.row_bytes for c in self._columns)
        self._chunk_bytes = chunk_bytes
        self._capacity = max(1, chunk_bytes // max(1, row_bytes))
        self._fixed: list[np.ndarray] | None = None  # allocated on the first row
        self._variable: list[list[pa.Array]] = [[] for _ in self._columns]
        self._variable_bytes = 0
        self._fill = 0

    def add(self, *blocks: Block) -> None:
        rows = len(blocks[0])
        done = 0
        while done < rows:
            if self._fixed is None:  # so that a 0-row partition allocates nothing
                self._fixed = [np.empty((self._capacity,) if c.scalar else (self._capacity, c.width), c.storage)
                               if c.kind == FIXED else np.empty(0) for c in self._columns]
            take = min(rows - done, self._capacity - self._fill)
            for spec, block, buffer, pending in zip(self._columns, blocks, self._fixed, self._variable):
                if spec.kind == FIXED:
                    buffer[self._fill: self._fill + take] = block[done: done + take]
                else:
                    part = block.slice(done, take)
                    pending.append(part)
                    self._variable_bytes += part.nbytes
            self._fill, done = self._fill + take, done + take
            if self._fill == self._capacity or self._variable_bytes >= self._chunk_bytes:
                self.flush()

    def flush(self) -> None:
        if self._fill == 0 or self._fixed is None:
            return
        columns = []
        for spec, buffer, pending in zip(self._columns, self._fixed, self._variable):
            if spec.kind != FIXED:
                columns.append(pa.concat_arrays(pending))
                pending.clear()
            elif spec.scalar:
                columns.append(pa.array(buffer[: self._fill]))
            else:
                values = pa.array(buffer[: self._fill].reshape(-1))
                columns.append(pa.FixedSizeListArray.from_arrays(values, spec.width))
        self._writer.write_batch(pa.record_batch(columns, schema=self._schema))
        self._fill, self._variable_bytes = 0, 0
