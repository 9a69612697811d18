"""Epoch 1 straight from Spark's iterator: training starts with the first batch that arrives.

Each rank's step count comes from the driver's row counts (data/shards.py), so no rank waits for its
whole partition. A reader thread receives the partition, splits validation rows off, writes the spool
for later epochs alongside (spool="disk"; "none" writes nothing) and hands the training rows to the
loop. Epoch 1's order is a pure function of the rows in arrival order (`epoch_rows`): a seeded
shuffle buffer that fills to `capacity` rows and then emits a random half, whatever the sizes of the
Arrow batches. The same function over the finished spool (or over a partition Spark delivers again
to a retried attempt) gives the same batches, so resuming mid-epoch stays exact. No pyspark here.
"""
from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from sparkdl.data.arrow_rows import Arrays, incoming_arrays, slice_rows, split_validation
from sparkdl.data.layout import FeedLayout
from sparkdl.errors import ConfigError, EmptyDataError, PartitionChangedError
from sparkdl.tracking.phases import Clock, maybe_timed

__all__ = ["PartitionChangedError", "StreamedPartition", "cut", "epoch_rows", "rows_after", "shuffled", "skip"]

_STREAM_BUFFER_BYTES = 64 << 20  # the default shuffle buffer: about this much of a rank's rows
_QUEUED_BATCHES = 16  # Arrow batches received ahead of the loop (10k rows each by default)


def length(arrays: Arrays) -> int:
    return len(arrays[0])


def concat(pieces: Sequence[Arrays]) -> Arrays:
    if len(pieces) == 1:
        return pieces[0]
    return tuple(np.concatenate(blocks) if isinstance(blocks[0], np.ndarray) else pa.concat_arrays(blocks)
                 for blocks in zip(*pieces))


def take(arrays: Arrays, index: np.ndarray) -> Arrays:
    return tuple(np.take(b, index, axis=0) if isinstance(b, np.ndarray) else b.take(pa.array(index)) for b in arrays)


def slice_arrays(arrays: Arrays, start: int, stop: int) -> Arrays:
    return tuple(slice_rows(block, start, stop) for block in arrays)


def default_buffer_rows(row_bytes: int, batch_size: int) -> int:
    """About 64 MiB of rows, and never fewer than four batches."""
    return max(4 * batch_size, _STREAM_BUFFER_BYTES // max(row_bytes, 1))


def shuffled(pieces: Iterable[Arrays], capacity: int, rng: np.random.Generator) -> Iterator[Arrays]:
    """Rows of `pieces` in a seeded local shuffle: the buffer fills to exactly its size, emits a
    random half and takes new rows into the emptied places; at the end it emits what it holds,
    permuted. It starts at 1/16 of `capacity` and doubles with each fill, so the first batch waits
    for a sliver of the buffer, not all of it. Depends only on the row sequence, never on how it is
    cut into pieces."""
    source = iter(pieces)
    first = next(source, None)
    if first is None:
        return iter(())
    rows = itertools.chain([first], source)
    if all(isinstance(block, np.ndarray) for block in first):
        return _shuffled_in_place(rows, max(int(capacity), 2), rng)
    return _shuffled_by_concat(rows, max(int(capacity), 2), rng)


def _first_size(capacity: int) -> int:
    return max(capacity // 16, 2)


def _shuffled_in_place(pieces: Iterable[Arrays], capacity: int, rng: np.random.Generator) -> Iterator[Arrays]:
    """Fixed columns: one preallocated block per column; each row is copied in once and out once
    (a concat-and-split buffer copied it four times, which cost epoch 1 a third of its speed)."""
    buffer: list[np.ndarray] | None = None
    size = _first_size(capacity)
    free, filled = np.arange(size), 0  # the places to fill next, in order
    for piece in pieces:
        if buffer is None:
            buffer = [np.empty((capacity, *block.shape[1:]), block.dtype) for block in piece]
        position, rows = 0, length(piece)
        while position < rows:
            step = min(len(free) - filled, rows - position)
            places = free[filled: filled + step]
            for column, block in zip(buffer, piece):
                column[places] = block[position: position + step]
            filled, position = filled + step, position + step
            if filled == len(free):
                out = rng.permutation(size)[: size - size // 2]
                yield tuple(column[out] for column in buffer)
                grown = min(size * 2, capacity)
                free, filled, size = np.concatenate([out, np.arange(size, grown)]), 0, grown
    if buffer is not None:
        held = np.setdiff1d(np.arange(size), free[filled:], assume_unique=True)
        if len(held):
            order = held[rng.permutation(len(held))]  # one order for every column
            yield tuple(column[order] for column in buffer)


def _shuffled_by_concat(pieces: Iterable[Arrays], capacity: int, rng: np.random.Generator) -> Iterator[Arrays]:
    """Any columns (Arrow blocks for bytes and variable-length rows): concatenate, permute, split."""
    size = _first_size(capacity)
    held: list[Arrays] = []
    count = 0
    for piece in pieces:
        position, rows = 0, length(piece)
        while position < rows:
            step = min(size - count, rows - position)
            held.append(slice_arrays(piece, position, position + step))
            count, position = count + step, position + step
            if count == size:
                buffer, order = concat(held), rng.permutation(size)
                keep = size // 2
                yield take(buffer, order[: size - keep])
                held, count = [take(buffer, order[size - keep:])], keep
                size = min(size * 2, capacity)
    if count:
        yield take(concat(held), rng.permutation(count))


def cut(rows: Iterable[Arrays], sizes: Iterable[int]) -> Iterator[Arrays]:
    """Batches of `sizes` rows from a row sequence in pieces: a view when a batch lies in one piece."""
    pending: list[Arrays] = []
    available = 0
    source = iter(rows)
    for size in sizes:
        while available < size:
            piece = next(source, None)
            if piece is None:
                raise EmptyDataError(f"the epoch needs a batch of {size} rows, but only {available} were left",
                                     hint="this is a bug: the epoch plan and the rows disagree")
            if length(piece):
                pending.append(piece)
                available += length(piece)
        parts, needed = [], size
        while needed:
            head = pending[0]
            if length(head) <= needed:
                parts.append(pending.pop(0))
                needed -= length(head)
            else:
                parts.append(slice_arrays(head, 0, needed))
                pending[0] = slice_arrays(head, needed, length(head))
                needed = 0
        available -= size
        yield concat(parts)


def epoch_rows(pieces: Iterable[Arrays], wrap: Callable[[int], Iterator[Arrays]], sizes: Sequence[int], *,
               shuffle: bool, capacity: int, rng: np.random.Generator) -> Iterator[Arrays]:
    """Epoch 1's batches: the rows as they arrive, then (a shard smaller than the epoch needs) its
    first rows again from `wrap(k)`, through the shuffle buffer when `shuffle`, cut into `sizes`."""
    needed = int(sum(sizes))
    seen = [0]

    def counted() -> Iterator[Arrays]:
        for piece in pieces:
            seen[0] += length(piece)
            yield piece
        if seen[0] < needed:
            yield from wrap(needed - seen[0])

    rows = shuffled(counted(), capacity, rng) if shuffle else counted()
    return cut(rows, sizes)


class Reserve:
    """Copies of a partition's first rows, for spool="none" ranks whose epoch wraps around."""

    def __init__(self, rows: int) -> None:
        self.rows, self.pieces, self.count = max(rows, 0), [], 0

    def keep(self, arrays: Arrays) -> None:
        if self.count < self.rows:
            part = slice_arrays(arrays, 0, min(length(arrays), self.rows - self.count))
            self.pieces.append(tuple(np.array(b) if isinstance(b, np.ndarray) else b for b in part))
            self.count += length(part)

    def cycle(self, rows: int, rank: int, received: int) -> Iterator[Arrays]:
        """The first `rows` rows, from the start again as often as needed."""
        if not self.count or (rows > self.count and self.count < received):
            raise PartitionChangedError(
                f"rank {rank} received {received} training rows and its steps need {rows} more, but "
                f"spool='none' kept only {self.count} of its first rows to wrap around (the driver counted "
                "more rows for it: the DataFrame changed between the count and the job, or batch_balance="
                "'speed' gave it a larger share)",
                hint="make the DataFrame deterministic (cache or checkpoint it first), or use spool='disk'")
        return cut(itertools.cycle(self.pieces), [rows])


class StreamedPartition:
    """One rank's partition as it arrives: a reader thread splits off validation rows, hands the
    training rows over (bounded, so memory stays flat) and, with a `write` callable (spool="disk"),
    writes them to the spool alongside. `write(batches) -> Spool` consumes an iterator."""

    def __init__(self, batches: Iterable[pa.RecordBatch], layout: FeedLayout, *,
                 write: Callable[[Iterator[pa.RecordBatch]], Any] | None,
                 keep_rows: int = 0, clock: Clock | None = None) -> None:
        self._batches, self._layout, self._write, self._clock = batches, layout, write, clock
        self._queue: queue.Queue = queue.Queue(maxsize=_QUEUED_BATCHES)
        self._handing_over = threading.Event()
        self._handing_over.set()
        self._hand_over_lock = threading.Lock()
        self._stop = threading.Event()
        self._end = object()
        self.reserve = Reserve(keep_rows if write is None else 0)
        self.held_out: list[pa.RecordBatch] = []
        self.received_rows = 0
        self.spool: Any = None
        self.seconds = 0.0
        self._error: BaseException | None = None
        self._started = time.perf_counter()
        self._thread = threading.Thread(target=self._receive, name="sparkdl-stream", daemon=True)
        self._thread.start()

    def _training_batches(self) -> Iterator[pa.RecordBatch]:
        split = self._layout.split_column
        batches = self._batches if split is None else split_validation(self._batches, split, self.held_out)
        for batch in batches:
            if self._stop.is_set():
                return
            if not batch.num_rows:
                continue
            with maybe_timed(self._clock, "conversion"):
                arrays = incoming_arrays(batch, self._layout)
            self.reserve.keep(arrays)
            yield batch  # the spool writes it before the loop may touch (and write into) its rows
            self.received_rows += batch.num_rows
            with maybe_timed(self._clock, "handover_wait"):
                self._hand_over(arrays)

    def _hand_over(self, item: Any) -> None:
        # Under the lock stop_handing_over drains with: no item may slip in after a drain, or the
        # loop would take it for the next rows while the spool resumes after what it counted.
        while not self._stop.is_set():
            with self._hand_over_lock:
                if not self._handing_over.is_set():
                    return
                try:
                    self._queue.put_nowait(item)
                    return
                except queue.Full:
                    pass
            time.sleep(0.01)  # the loop is behind: it takes a batch every step

    def _receive(self) -> None:
        try:
            if self._write is not None:
                self.spool = self._write(self._training_batches())
            else:
                for _ in self._training_batches():
                    pass
        except BaseException as exc:  # noqa: BLE001 - raised on the loop's thread
            self._error = exc
        finally:
            self.seconds = time.perf_counter() - self._started
            self._hand_over(self._end)

    @property
    def handing_over(self) -> bool:
        """Rows still go to the loop as they arrive (nothing has asked for the whole partition yet)."""
        return self._handing_over.is_set()

    def pieces(self) -> Iterator[Arrays]:
        """The training rows as they arrive, once; an error while receiving is raised here. When
        something waits for the whole partition meanwhile (finish(): a custom loop asking for a later
        epoch or its validation rows before this pass ends), the rest of the rows come from the spool,
        in the same order; without a spool (spool="none") that is an error."""
        handed = 0
        try:
            while True:
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    if self._handing_over.is_set():
                        continue
                    break  # handing over stopped: the rest is in the spool
                if item is self._end:
                    self.finish()
                    return
                handed += length(item)
                yield item
        finally:
            self.stop_handing_over()
        self.finish()
        if self.spool is None:
            raise ConfigError("the rows of epoch 1 stopped streaming before the pass ended, and spool='none' "
                              "keeps no copy to finish it from", hint="use spool='disk'")
        yield from rows_after(self.spool.chunks(), handed)

    def stop_handing_over(self) -> None:
        """The loop needs no more rows: the reader keeps receiving (and spooling) without handing over."""
        with self._hand_over_lock:
            self._handing_over.clear()
            while True:
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    return

    def finish(self) -> None:
        """Wait until the whole partition arrived (and is spooled); raises what went wrong."""
        self.stop_handing_over()
        self._thread.join()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Stop receiving (a failed rank), within about one Arrow batch."""
        self._stop.set()
        self.stop_handing_over()
        self._thread.join(timeout=30)


def rows_after(pieces: Iterable[Arrays], count: int) -> Iterator[Arrays]:
    """The rows of `pieces` after the first `count`."""
    for piece in pieces:
        rows = length(piece)
        if count >= rows:
            count -= rows
            continue
        yield slice_arrays(piece, count, rows) if count else piece
        count = 0


def skip(batches: Iterator[Arrays], start: int) -> Iterator[Arrays]:
    """A resumed epoch: the first `start` batches are drawn (the rows after them stay the same) but
    never assembled."""
    return itertools.islice(batches, start, None)
