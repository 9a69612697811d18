"""The spool interface over a partition that is still arriving: epoch 1 streams, later epochs (and a
second pass over epoch 1) read the spool written alongside. What WorkerContext reads its rows from
when the built-in loop streams (data/stream.py has the mechanics). No pyspark here.
"""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from sparkdl.data.assemble import Assemble, assembler
from sparkdl.data.batches import RowsInMemory, batch_sizes
from sparkdl.data.epochs import EpochPlan
from sparkdl.data.layout import FeedLayout
from sparkdl.data.stream import StreamedPartition, epoch_rows, skip
from sparkdl.errors import ConfigError

_ONE_PASS_HINT = "use spool='disk' (epoch 1 still streams; the spool serves later passes)"


class StreamingSpool:
    """`num_rows` is the driver's count of this rank's training rows (the steps are planned on it)."""

    def __init__(self, partition: StreamedPartition, layout: FeedLayout, expected_rows: int, buffer_rows: int,
                 one_pass: bool) -> None:
        self._partition, self._layout = partition, layout
        self._expected, self._buffer_rows, self._one_pass = expected_rows, buffer_rows, one_pass
        self._streamed = False

    @property
    def num_rows(self) -> int:
        return self._expected

    @property
    def seconds(self) -> float:
        """Receiving (and spooling) the whole partition, from the task's start."""
        self._partition.finish()
        return self._partition.seconds

    def finish(self) -> None:
        """Wait for the rest of the partition (rows no step needed are received and spooled too)."""
        self._partition.finish()

    def spool(self) -> Any:
        """The finished spool (after the whole partition arrived)."""
        if self._one_pass:
            raise ConfigError("spool='none' streams every row once: this pass needs the rows again",
                              hint=_ONE_PASS_HINT)
        self._partition.finish()
        return self._partition.spool

    def epoch_batches(self, epoch: int, plan: EpochPlan, *, rank: int, shuffle: bool, seed: int,
                      assemble: Assemble | None = None, start: int = 0) -> Iterator[Any]:
        """Epoch 0 from the rows as they arrive (the first call) or, the same batches, from the
        spool; later epochs from the spool, as Spool.epoch_batches gives them."""
        assemble = assemble or assembler(self._layout)
        if epoch:
            return self.spool().epoch_batches(epoch, plan, rank=rank, shuffle=shuffle, seed=seed, assemble=assemble,
                                              start=start)
        sizes = list(batch_sizes(plan.batch_size(rank), plan.steps, plan.full_steps_only, plan.last_batch_size(rank)))
        # Live only while the rows still stream: once something waited for the whole partition (a
        # later epoch, the validation rows, spool_seconds), epoch 0 reads the spool, the same batches.
        live = not self._streamed and self._partition.handing_over
        if live:
            self._streamed = True
            pieces, wrap = self._partition.pieces(), self._wrap_live(rank)
        else:
            spool = self.spool()
            pieces, wrap = spool.chunks(), lambda count: spool.first_rows(count, rank)
        rows = epoch_rows(pieces, wrap, sizes, shuffle=shuffle, capacity=self._buffer_rows,
                          rng=np.random.default_rng([seed, 0, rank]))
        batches = map(assemble, skip(rows, start))
        return _then(batches, self._partition.stop_handing_over) if live else batches

    def _wrap_live(self, rank: int) -> Any:
        partition = self._partition

        def wrap(count: int) -> Iterator[Any]:
            if self._one_pass:
                return partition.reserve.cycle(count, rank, partition.received_rows)
            partition.finish()
            return partition.spool.first_rows(count, rank)

        return wrap

    def validation(self) -> "LateValidation":
        return LateValidation(self)

    def close(self) -> None:
        self._partition.close()
        if self._partition.spool is not None:
            self._partition.spool.close()

    @property
    def partition(self) -> StreamedPartition:
        return self._partition

    @property
    def layout(self) -> FeedLayout:
        return self._layout


def _then(batches: Iterator[Any], done: Any) -> Iterator[Any]:
    """`batches`, then `done()` once they are used up (or the loop stops early): the reader thread
    goes on receiving the partition without handing rows over."""
    try:
        yield from batches
    finally:
        done()


class LateValidation:
    """This rank's validation rows, ready once the partition has arrived; kept in memory under either
    spool mode (validation rows are few by design)."""

    def __init__(self, source: StreamingSpool) -> None:
        self._source = source
        self._rows: Any = None

    def _ready(self) -> Any:
        if self._rows is None:
            partition = self._source.partition
            partition.finish()
            self._rows = RowsInMemory(partition.held_out, self._source.layout)
        return self._rows

    @property
    def num_rows(self) -> int:
        return self._ready().num_rows

    def epoch_batches(self, epoch: int, plan: EpochPlan, **options: Any) -> Iterator[Any]:
        return self._ready().epoch_batches(epoch, plan, **options)

    def close(self) -> None:
        self._rows = None
