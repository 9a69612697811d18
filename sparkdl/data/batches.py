"""Worker data path: Arrow batches -> local memory-mapped spool -> torch batches, equal steps per rank.

A mapInArrow iterator is single-pass, so `Spool.write` copies it once into a local Arrow IPC file
(features as fixed-size lists: one contiguous float32 block per chunk) that later epochs read from
the page cache. Collectives hang when ranks disagree on the step count, so every rank runs
`epoch_plan(all row counts)` steps (data/epochs.py) with equal batch sizes, smaller ranks wrapping around their
rows; equal samples per step also keep plain gradient averaging exact. No pyspark, pandas or
per-row Python here: this runs inside executors.
"""
from __future__ import annotations

import itertools
import mmap
import os
import weakref
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import pyarrow as pa

from sparkdl.data.arrow_rows import (Arrays, Block, ChunkWriter, SpoolColumn, incoming_arrays, slice_rows, spool_columns,
                                     spool_schema)
from sparkdl.data.assemble import Assemble, assembler
from sparkdl.data.layout import FIXED, FeedLayout
from sparkdl.data.epochs import BatchOptions, EpochPlan, check_batch_size, epoch_plan
from sparkdl.data.spool_space import check_free_space, out_of_space
from sparkdl.errors import EmptyDataError
from sparkdl.storage.private_dirs import HeldDirectory, hold_new_directory, make_dirs, open_no_follow, open_private
from sparkdl.tracking.phases import Clock, maybe_timed


_GROUP_BYTES = 1 << 19  # shuffled rows gathered per numpy call, see _gathered
_GROUP_BYTES_MAX = 16 << 20
SPOOL_PREFIX = "sparkdl-spool-"  # a worker's own directory under the spool root (private_dirs)
SPOOL_FILE = "rows.arrow"


def steps_per_epoch(row_counts: Sequence[int], batch_size: int, drop_last: bool) -> int:
    """Steps every rank runs this epoch, from all ranks' row counts (data/epochs.py's rule)."""
    return epoch_plan(row_counts, BatchOptions(batch_size, drop_last)).steps


def last_batch_size(row_counts: Sequence[int], batch_size: int, drop_last: bool) -> int:
    """Rows in the epoch's last step on every rank (0 without steps; data/epochs.py's rule)."""
    plan = epoch_plan(row_counts, BatchOptions(batch_size, drop_last))
    return plan.last_batch_sizes[0] if plan.last_batch_sizes else 0


class _Rows:
    """A partition's rows as per-chunk blocks, one list per spool column: numpy `(n_i,)` or
    `(n_i, width)` for fixed columns, Arrow arrays for binary and variable-length ones."""

    def __init__(self, columns: list[list[Block]], specs: Sequence[SpoolColumn]):
        self.columns, self.specs = columns, tuple(specs)
        # Chunk i holds global rows bounds[i]:bounds[i + 1].
        self.bounds = np.cumsum([0, *(len(block) for block in columns[0])], dtype=np.int64)
        self.num_rows = int(self.bounds[-1])
        # Bytes per row, variable columns (images, text) at their average: sizes the gather groups.
        variable = sum(sum(block.nbytes for block in blocks) for spec, blocks in zip(self.specs, columns)
                       if spec.kind != FIXED)
        self.row_bytes = max(1, sum(spec.row_bytes for spec in self.specs) + variable // max(1, self.num_rows))
        # The spool writes equal chunks and a smaller last one: then a division, far cheaper than a
        # search, finds a row's chunk. 0 for other layouts (say, a file written elsewhere).
        sizes = np.diff(self.bounds)
        equal = len(sizes) > 1 and np.all(sizes[:-1] == sizes[0]) and sizes[-1] <= sizes[0]
        self.chunk_rows = int(sizes[0]) if equal else 0

    @property
    def chunk_count(self) -> int:
        return len(self.columns[0])

    def take_ranges(self, ranges: list[tuple[int, int]]) -> Arrays:
        """Row ranges, in order: zero-copy views when they are one range inside one chunk."""
        if len(ranges) == 1:
            start, stop = ranges[0]
            chunk = int(np.searchsorted(self.bounds, start, side="right")) - 1
            if stop <= self.bounds[chunk + 1]:
                lo, hi = start - int(self.bounds[chunk]), stop - int(self.bounds[chunk])
                return tuple(slice_rows(blocks[chunk], lo, hi) for blocks in self.columns)
        # Straddling chunks or wrapping around: a copy either way, so reuse the gather.
        return self.gather(np.concatenate([np.arange(start, stop) for start, stop in ranges]))

    def gather(self, index: np.ndarray) -> Arrays:
        """Rows at any global indices, in index order: one numpy take per chunk touched."""
        if self.chunk_count == 1:
            return tuple(_take(blocks[0], index) for blocks in self.columns)
        chunk_of = (index // self.chunk_rows if self.chunk_rows
                    else np.searchsorted(self.bounds, index, side="right") - 1)
        # One stable sort splits the positions by chunk (a pass per chunk cost 16x on 16 chunks).
        order = np.argsort(chunk_of, kind="stable")
        ends = np.cumsum(np.bincount(chunk_of, minlength=self.chunk_count))
        parts = [(chunk, order[start:end]) for chunk, (start, end) in enumerate(zip([0, *ends[:-1]], ends))
                 if end > start]  # loops over chunks touched, not rows
        out = []
        for spec, blocks in zip(self.specs, self.columns):
            if spec.kind != FIXED:
                out.append(pa.chunked_array(blocks, type=spec.arrow_type()).take(pa.array(index)).combine_chunks())
                continue
            first = blocks[0]
            gathered = np.empty((len(index), *first.shape[1:]), first.dtype)
            for chunk, positions in parts:
                gathered[positions] = np.take(blocks[chunk], index[positions] - self.bounds[chunk], axis=0)
            out.append(gathered)
        return tuple(out)


def _take(block: Block, index: np.ndarray) -> Block:
    return np.take(block, index, axis=0) if isinstance(block, np.ndarray) else block.take(pa.array(index))


def batch_sizes(batch_size: int, steps: int, drop_last: bool, last: int | None) -> Iterator[int]:
    check_batch_size(batch_size)
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    final = batch_size if drop_last or last is None else last  # drop_last: every step is full
    if steps and not 1 <= final <= batch_size:
        raise ValueError(f"last_batch_size must be in [1, {batch_size}], got {final}")
    return itertools.chain(itertools.repeat(batch_size, max(steps - 1, 0)), [final][:steps])


def _in_order_ranges(num_rows: int, sizes: Iterable[int]) -> Iterator[list[tuple[int, int]]]:
    """Each batch's row ranges, cycling over 0..n-1 as often as the epoch needs."""
    position = 0
    for size in sizes:
        ranges = []
        while size:
            take = min(size, num_rows - position)
            ranges.append((position, position + take))
            position, size = (position + take) % num_rows, size - take
        yield ranges


def _shuffled_indices(num_rows: int, sizes: Iterable[int], rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Each batch's row indices, from successive permutations of the rank's rows."""
    permutation, position = rng.permutation(num_rows), 0
    for size in sizes:
        parts = []
        while size:
            if position == num_rows:  # a pass is done: wrap around with a fresh permutation
                permutation, position = rng.permutation(num_rows), 0
            take = min(size, num_rows - position)
            parts.append(permutation[position : position + take])
            position, size = position + take, size - take
        yield parts[0] if len(parts) == 1 else np.concatenate(parts)


def _iter_batches(rows: _Rows, epoch: int, *, batch_size: int, steps: int, shuffle: bool, seed: int,
                  rank: int, drop_last: bool, last_batch_size: int | None, assemble: Assemble,
                  start: int = 0) -> Iterator[Any]:
    """`start`: batches to pass over first (a resumed epoch): their rows are drawn, so the rest are
    the same batches, but never gathered or assembled (no copy, no transform_fn)."""
    # Checked now rather than at the first next(), so a bad rank fails before its training loop.
    sizes = batch_sizes(batch_size, steps, drop_last, last_batch_size)
    if steps and rows.num_rows == 0:
        raise EmptyDataError(f"rank {rank} received no rows, but every rank must run {steps} steps "
                             "this epoch", hint="use fewer workers, or repartition the DataFrame so "
                             "that every partition holds rows")
    if shuffle:
        rng = np.random.default_rng([seed, epoch, rank])
        indices = itertools.islice(_shuffled_indices(rows.num_rows, sizes, rng), start, None)
        # More chunks, more numpy calls per gather: gather more rows per call to keep each call large.
        budget = min(_GROUP_BYTES * max(1, rows.chunk_count // 4), _GROUP_BYTES_MAX)
        per_group = max(1, budget // (batch_size * rows.row_bytes))
        return map(assemble, _gathered(rows, indices, per_group))
    ranges = itertools.islice(_in_order_ranges(rows.num_rows, sizes), start, None)
    return (assemble(rows.take_ranges(r)) for r in ranges)


def _gathered(rows: _Rows, indices: Iterator[np.ndarray], per_group: int) -> Iterator[Arrays]:
    """Gathers a few batches per call (about _GROUP_BYTES: small enough to stay in cache), so the
    per-call cost hardly counts for small batches. Each batch slices a fresh, never reused array."""
    while group := list(itertools.islice(indices, per_group)):
        gathered = rows.gather(np.concatenate(group))
        ends = np.cumsum([len(index) for index in group]).tolist()
        for start, stop in zip([0, *ends[:-1]], ends):
            yield tuple(slice_rows(block, start, stop) for block in gathered)


class Spool:
    """One partition's rows in a local, memory-mapped Arrow IPC file, built by `Spool.write`.
    `close()` (or leaving a `with` block, or garbage collection) unmaps and deletes the file."""

    def __init__(self, path: str | Path, layout: FeedLayout, held: HeldDirectory | None = None) -> None:
        """`held`: the directory `path` lives in, removed (and its lock let go) with the file."""
        self._path = Path(path)
        self._layout = layout
        try:
            self._file = open_no_follow(self._path)
            rows = _map_rows(self._file, layout)
            self._num_rows: int | None = rows.num_rows
            self.chunk_count = rows.chunk_count
            self.chunk_rows = rows.chunk_rows  # 0 unless the chunks are equal (all but the last)
        except BaseException:
            if hasattr(self, "_file"):
                self._file.close()
            if held is not None:
                held.close()
            raise
        self._release = weakref.finalize(self, _close_and_delete, self._file, self._path, held)

    @classmethod
    def write(cls, batches: Iterable[pa.RecordBatch], layout: FeedLayout, directory: str | Path, *,
              chunk_bytes: int = 64 << 20, expected_bytes: int = 0, clock: Clock | None = None) -> Spool:
        """Consume `batches` (a single-pass mapInArrow iterator) into a new file under `directory`;
        `expected_bytes` (spool_space.spool_bytes of the rows expected) is checked against the free
        space first, and a disk that fills up anyway is named (SpoolSpaceError). `clock` sums the
        seconds of the free-space check, the conversion and the writes (phases.Clock)."""
        with maybe_timed(clock, "space_check"):
            # A directory of this worker's own (0700, random name, held by a lock while it lives;
            # private_dirs sweeps those of dead workers first) inside the user's or the private root.
            held = hold_new_directory(make_dirs(directory), SPOOL_PREFIX)
        try:
            if expected_bytes:
                with maybe_timed(clock, "space_check"):
                    check_free_space(directory, expected_bytes)
            final = _write_spool_file(batches, layout, Path(held.path), chunk_bytes, expected_bytes, directory, clock)
        except BaseException:
            held.close()
            raise
        return cls(final, layout, held)

    @property
    def path(self) -> Path:
        return self._path

    @property
    def num_rows(self) -> int:
        if self._num_rows is None:
            raise ValueError(f"spool {self._path} is closed")
        return self._num_rows

    def batches(self, epoch: int, *, batch_size: int, steps: int, shuffle: bool, seed: int, rank: int,
                drop_last: bool, last_batch_size: int | None = None, assemble: Assemble | None = None,
                start: int = 0) -> Iterator[Any]:
        """Exactly `steps` batches: (features float32 (b, d), labels (b,) or None) for a feature_cols
        layout, (inputs, label, weight) for input_cols (data/assemble.py; `assemble` replaces the
        default conversion, e.g. with transform_fn). Take `steps` and
        `last_batch_size` from `steps_per_epoch` and `last_batch_size` over all ranks' `num_rows`.
        Each batch stays valid while later ones are produced, and after close().

        Without shuffle, a batch inside one chunk is a zero-copy view of a private copy-on-write
        mapping made for this call: writing into it in place (x -= mean) changes only this epoch's
        pages, never the file or another epoch's batches. Shuffled batches are copies.
        """
        if self._num_rows is None:
            raise ValueError(f"spool {self._path} is closed")
        return _iter_batches(_map_rows(self._file, self._layout), epoch, batch_size=batch_size, steps=steps,
                             shuffle=shuffle, seed=seed, rank=rank, drop_last=drop_last, last_batch_size=last_batch_size,
                             assemble=assemble or assembler(self._layout), start=start)

    def epoch_batches(self, epoch: int, plan: EpochPlan, *, rank: int, shuffle: bool, seed: int,
                      assemble: Assemble | None = None, start: int = 0) -> Iterator[Any]:
        """The batches `plan` (data/epochs.py, over every rank's row counts) gives `rank` this epoch,
        from batch `start` on."""
        return self.batches(epoch, batch_size=plan.batch_size(rank), steps=plan.steps, shuffle=shuffle, seed=seed,
                            rank=rank, drop_last=plan.full_steps_only, last_batch_size=plan.last_batch_size(rank),
                            assemble=assemble, start=start)

    def chunks(self) -> Iterator[Arrays]:
        """The rows in the order they were written, chunk by chunk (views of a private mapping)."""
        if self._num_rows is None:
            raise ValueError(f"spool {self._path} is closed")
        return iter(zip(*_map_rows(self._file, self._layout).columns))

    def first_rows(self, count: int, rank: int) -> Iterator[Arrays]:
        """The first `count` rows in written order, from the start again as often as needed."""
        rows = _map_rows(self._file, self._layout)
        if count and rows.num_rows == 0:
            raise EmptyDataError(f"rank {rank} received no rows, but its steps need {count}",
                                 hint="use fewer workers, or repartition the DataFrame so that every "
                                      "partition holds rows")
        return (rows.take_ranges(r) for r in _in_order_ranges(rows.num_rows, [count]))

    def close(self) -> None:
        """Close and delete the file; batches handed out earlier stay readable. Idempotent."""
        self._num_rows = None
        self._release()

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _write_spool_file(batches: Iterable[pa.RecordBatch], layout: FeedLayout, where: Path, chunk_bytes: int,
                      expected_bytes: int, directory: str | Path, clock: Clock | None) -> Path:
    """The rows as an Arrow IPC file in `where`, a held directory of this worker's own."""
    final = where / SPOOL_FILE
    # A task killed mid-write leaves a .tmp name, never a truncated file that looks complete.
    partial = final.with_name(final.name + ".tmp")
    try:
        # Created exclusive, 0600, not through a link (the rows are the user's data).
        with open_private(partial) as sink, pa.ipc.new_file(sink, spool_schema(layout)) as out:
            chunks = ChunkWriter(out, layout, chunk_bytes)
            for batch in batches:
                with maybe_timed(clock, "conversion"):
                    arrays = incoming_arrays(batch, layout)
                with maybe_timed(clock, "spool_write"):
                    chunks.add(*arrays)
            with maybe_timed(clock, "spool_write"):
                chunks.flush()
        os.replace(partial, final)
    except BaseException as exc:
        written = partial.stat().st_size if partial.exists() else 0
        partial.unlink(missing_ok=True)
        full = out_of_space(exc, directory, expected_bytes, written)
        if full is not None:
            raise full from None
        raise
    return final


class RowsInMemory:
    """A spool's interface over record batches held in memory (validation rows under spool="none")."""

    def __init__(self, batches: Iterable[pa.RecordBatch], layout: FeedLayout) -> None:
        self._rows, self._layout = _rows_of(batches, layout), layout

    @property
    def num_rows(self) -> int:
        return self._rows.num_rows

    def epoch_batches(self, epoch: int, plan: EpochPlan, *, rank: int, shuffle: bool, seed: int,
                      assemble: Assemble | None = None, start: int = 0) -> Iterator[Any]:
        return _iter_batches(self._rows, epoch, batch_size=plan.batch_size(rank), steps=plan.steps, shuffle=shuffle,
                             seed=seed, rank=rank, drop_last=plan.full_steps_only,
                             last_batch_size=plan.last_batch_size(rank), assemble=assemble or assembler(self._layout),
                             start=start)

    def close(self) -> None:
        """Nothing to delete."""


def _rows_of(batches: Iterable[pa.RecordBatch], layout: FeedLayout) -> _Rows:
    """Zero-copy numpy views of fixed_size_list batches (of a mapped file: read on use, not now)."""
    specs = spool_columns(layout)
    columns: list[list[Block]] = [[] for _ in specs]
    for blocks in (incoming_arrays(batch, layout) for batch in batches if batch.num_rows):
        for column, block in zip(columns, blocks):
            column.append(block)
    return _Rows(columns, specs)


def _map_rows(stream: Any, layout: FeedLayout) -> _Rows:
    """Rows over a fresh private (copy-on-write) mapping: batches are zero-copy views, and a caller
    writing into one in place changes only its own pages, instead of faulting on a read-only map or
    leaking the change into later epochs. The mapping lives as long as any view of it."""
    mapping = mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_COPY)
    reader = pa.ipc.open_file(pa.BufferReader(pa.py_buffer(mapping)))
    return _rows_of(map(reader.get_batch, range(reader.num_record_batches)), layout)


def _close_and_delete(stream: Any, path: Path, held: HeldDirectory | None) -> None:
    # Mappings made from the file stay valid after it is closed and unlinked (POSIX).
    stream.close()
    path.unlink(missing_ok=True)
    if held is not None:
        held.close()


def table_batches(table: pa.Table, layout: FeedLayout, epoch: int, *, batch_size: int, steps: int,
                  shuffle: bool, seed: int, rank: int, drop_last: bool,
                  last_batch_size: int | None = None, assemble: Assemble | None = None) -> Iterator[Any]:
    """The batches `Spool.batches` yields, from a table already in memory (the in-memory limit).
    Its chunks are combined into one first (free when it has one); fixed_size_list is not copied."""
    rows = _rows_of(table.combine_chunks().to_batches(), layout)
    return _iter_batches(rows, epoch, batch_size=batch_size, steps=steps, shuffle=shuffle, seed=seed,
                         rank=rank, drop_last=drop_last, last_batch_size=last_batch_size,
                         assemble=assemble or assembler(layout))
