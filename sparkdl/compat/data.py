"""The rank's partition inside a `_train_on_dataframe` function, at sparkdl's speed.

PySpark's `_get_spark_partition_data_loader` turns every Arrow batch into pandas and yields one Python
list per row, which the DataLoader collates back into tensors. `partition_batches` reads the same
partition file (memory-mapped Arrow, written by the rank's task) once into column arrays and yields
each batch as tensors sliced from them: same rows, same order, same wrap-around past the partition's
end. Runs in the rank's child process; reads only the variables the task set.
"""
from __future__ import annotations

import os
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow as pa

from sparkdl.errors import ConfigError

PARTITION_FILE_VARIABLE = "SPARK_PARTITION_ARROW_DATA_FILE"


def partition_table() -> pa.Table:
    """This rank's partition as an Arrow table (memory-mapped: nothing is copied)."""
    path = os.environ.get(PARTITION_FILE_VARIABLE)
    if not path:
        raise ConfigError("partition_batches/partition_table read the rank's partition, which only a function run "
                          "by TorchDistributor._train_on_dataframe has",
                          hint="call it inside the function passed to sparkdl.compat.TorchDistributor(...)"
                               "._train_on_dataframe(fn, df)")
    with pa.memory_map(path) as source:
        return pa.ipc.open_stream(source).read_all()


def column_array(column: pa.ChunkedArray, name: str = "") -> np.ndarray:
    """One column as a numpy array of N rows: numbers as they are, arrays of equal length as (N, L),
    Spark ML vectors (dense or sparse) as dense (N, size) float64."""
    kind = column.type
    if pa.types.is_struct(kind) and {"type", "values"} <= {kind.field(i).name for i in range(kind.num_fields)}:
        return _vectors(column)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        combined = column.combine_chunks()
        if pa.types.is_fixed_size_list(kind):
            return _numbers(combined.flatten()).reshape(len(combined), kind.list_size)
        # From the offsets, not value_lengths()/flatten(): those import pyarrow.compute (~40 ms a rank)
        offsets = _numbers(combined.offsets)
        lengths = np.diff(offsets)
        if len(lengths) and lengths.min() != lengths.max():
            raise ConfigError(f"column {name!r} holds arrays of different lengths, which make no tensor",
                              hint="pad or cut them to one length first")
        width = int(lengths[0]) if len(lengths) else 0
        return _numbers(combined.values)[offsets[0]:offsets[-1]].reshape(len(combined), width)
    return _numbers(column.combine_chunks())


def _numbers(array: pa.Array) -> np.ndarray:
    """A numeric Arrow array as numpy: a view of its data buffer when it has no nulls (pyarrow's own
    to_numpy imports pandas, ~0.3 s of a fresh rank's first epoch)."""
    kind = array.type
    if array.null_count == 0 and (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
        code = "f" if pa.types.is_floating(kind) else "i" if pa.types.is_signed_integer(kind) else "u"
        dtype = np.dtype(f"{code}{kind.bit_width // 8}")
        return np.frombuffer(array.buffers()[1], dtype=dtype, count=len(array), offset=array.offset * dtype.itemsize)
    return array.to_numpy(zero_copy_only=False)


def _vectors(column: pa.ChunkedArray) -> np.ndarray:
    rows = column.to_pylist()
    size = max((int(r["size"]) if r["type"] == 0 else len(r["values"]) for r in rows), default=0)
    out = np.zeros((len(rows), size), dtype=np.float64)
    for i, row in enumerate(rows):
        if row["type"] == 1:
            out[i, :len(row["values"])] = row["values"]
        else:
            out[i, row["indices"]] = row["values"]
    return out


def partition_batches(batch_size: int, columns: Sequence[str] | None = None, num_samples: int | None = None,
                      as_tensors: bool = True) -> Iterator[list[Any]]:
    """Batches of this rank's partition: one array per column (in `columns` order, default all), as
    torch tensors (or numpy with as_tensors=False), like a batch of PySpark's partition data loader.
    `num_samples`: rows per pass, wrapping round to the first row as PySpark's loader does (default:
    the partition's row count)."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ConfigError(f"partition_batches: batch_size must be a positive integer, got {batch_size!r}")
    table = partition_table()
    names = list(columns) if columns is not None else table.column_names
    missing = [n for n in names if n not in table.column_names]
    if missing:
        raise ConfigError(f"partition_batches: no column {missing[0]!r} in the partition",
                          hint=f"the columns are {table.column_names}")
    # Writable copies once (Arrow's buffers are read-only, torch wants writable memory); batches are views.
    arrays = [np.array(column_array(table.column(n), n), copy=True) for n in names]
    rows = table.num_rows
    total = rows if num_samples is None else int(num_samples)
    if total and not rows:
        raise ConfigError("partition_batches: this rank's partition is empty")
    convert = _to_tensor if as_tensors else (lambda a: a)
    for start in range(0, total, batch_size):
        stop = min(start + batch_size, total)
        if stop <= rows:
            yield [convert(a[start:stop]) for a in arrays]
        else:
            index = np.arange(start, stop) % rows
            yield [convert(a[index]) for a in arrays]


def _to_tensor(array: np.ndarray) -> Any:
    import torch

    return torch.from_numpy(np.ascontiguousarray(array))
