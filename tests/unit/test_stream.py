"""Epoch 1 from a partition still arriving (data/stream.py, data/streaming_spool.py), without Spark."""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pytest

from sparkdl.data.batches import Spool
from sparkdl.data.epochs import BatchOptions, epoch_plan
from sparkdl.data.layout import FeedLayout
from sparkdl.data.stream import PartitionChangedError, StreamedPartition, cut, epoch_rows, shuffled
from sparkdl.data.streaming_spool import StreamingSpool

LAYOUT = FeedLayout(num_features=3, label_dtype="int64")


def _batches(rows: int, size: int, start: int = 0) -> list[pa.RecordBatch]:
    out = []
    for first in range(start, start + rows, size):
        n = min(size, start + rows - first)
        values = np.arange(first * 3, (first + n) * 3, dtype=np.float32)
        features = pa.FixedSizeListArray.from_arrays(pa.array(values), 3)
        out.append(pa.record_batch([features, pa.array(np.arange(first, first + n))],
                                   names=[LAYOUT.feature_column, LAYOUT.label_column]))
    return out


def _pieces(rows: np.ndarray, cuts: list[int]) -> Iterator[tuple[np.ndarray]]:
    bounds = [0, *cuts, len(rows)]
    return ((rows[a:b],) for a, b in zip(bounds[:-1], bounds[1:]))


def test_the_shuffle_buffer_depends_on_the_rows_not_on_how_they_arrive() -> None:
    rows = np.arange(1000)
    one = np.concatenate([p[0] for p in shuffled(_pieces(rows, [10, 500, 501]), 64, np.random.default_rng(3))])
    other = np.concatenate([p[0] for p in shuffled(_pieces(rows, [1, 2, 999]), 64, np.random.default_rng(3))])
    np.testing.assert_array_equal(one, other)
    assert sorted(one.tolist()) == rows.tolist()  # every row once
    assert not np.array_equal(one, rows)
    # a local shuffle: no row travels further back than the buffer holds
    assert max(np.flatnonzero(one == r)[0] - r for r in rows) < 1000


def test_the_shuffle_buffer_keeps_each_rows_columns_together() -> None:
    rows = np.arange(5000)
    features = np.stack([rows * 2, rows * 3], 1).astype(np.float32)
    pieces = ((features[a:a + 700], rows[a:a + 700]) for a in range(0, 5000, 700))
    out = list(shuffled(pieces, 1024, np.random.default_rng(0)))
    got, labels = np.concatenate([o[0] for o in out]), np.concatenate([o[1] for o in out])
    assert sorted(labels.tolist()) == rows.tolist()
    np.testing.assert_array_equal(got, np.stack([labels * 2, labels * 3], 1))  # every emission, the last too


def test_the_shuffle_buffer_takes_arrow_columns_too() -> None:
    rows = np.arange(300)
    texts = pa.array([str(v) for v in rows], pa.large_string())

    def pieces(cuts: list[int]):  # type: ignore[no-untyped-def]
        bounds = [0, *cuts, len(rows)]
        return ((rows[a:b], texts.slice(a, b - a)) for a, b in zip(bounds[:-1], bounds[1:]))

    one = list(shuffled(pieces([7, 150]), 40, np.random.default_rng(1)))
    other = list(shuffled(pieces([299]), 40, np.random.default_rng(1)))
    numbers = np.concatenate([p[0] for p in one])
    np.testing.assert_array_equal(numbers, np.concatenate([p[0] for p in other]))
    assert sorted(numbers.tolist()) == rows.tolist()
    assert [s for p in one for s in p[1].to_pylist()] == [str(v) for v in numbers]  # rows stay whole


def test_cut_gives_views_inside_a_piece_and_copies_across() -> None:
    rows = np.arange(10)
    batches = list(cut(_pieces(rows, [4]), [3, 3, 4]))
    assert [b[0].tolist() for b in batches] == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]
    assert np.shares_memory(batches[0][0], rows) and not np.shares_memory(batches[1][0], rows)


def test_a_short_shard_wraps_around_its_first_rows() -> None:
    rows = np.arange(5)
    wrapped = epoch_rows(_pieces(rows, [2]), lambda k: iter([(rows[:k],)]), [4, 4], shuffle=False, capacity=8,
                         rng=np.random.default_rng(0))
    assert [b[0].tolist() for b in wrapped] == [[0, 1, 2, 3], [4, 0, 1, 2]]


def _stream(tmp_path: Path | None, batches: list[pa.RecordBatch], expected: int, keep: int = 0,
            epochs_pass: bool = False) -> StreamingSpool:
    write = None if tmp_path is None else (lambda b: Spool.write(b, LAYOUT, tmp_path))
    partition = StreamedPartition(iter(batches), LAYOUT, write=write, keep_rows=keep)
    return StreamingSpool(partition, LAYOUT, expected, buffer_rows=32, one_pass=tmp_path is None)


def _labels(batches: Iterator) -> list[int]:
    return [int(v) for _, labels in batches for v in labels]


def test_epoch_one_streams_then_the_spool_replays_it_and_serves_later_epochs(tmp_path: Path) -> None:
    source = _stream(tmp_path, _batches(100, 7), expected=100)
    plan = epoch_plan([100, 100], BatchOptions(16))
    live = _labels(source.epoch_batches(0, plan, rank=1, shuffle=True, seed=5))
    assert sorted(live) == list(range(100))
    again = _labels(source.epoch_batches(0, plan, rank=1, shuffle=True, seed=5))
    assert again == live  # the same batches from the spool (a resumed epoch reads them so)
    resumed = _labels(source.epoch_batches(0, plan, rank=1, shuffle=True, seed=5, start=2))
    assert resumed == live[32:]
    later = _labels(source.epoch_batches(1, plan, rank=1, shuffle=True, seed=5))
    assert sorted(later) == list(range(100)) and later != live
    files = [p for p in tmp_path.iterdir() if p.is_dir()]  # the spool's own directory (and its lock file)
    assert len(files) == 1
    source.close()
    assert not list(tmp_path.iterdir())


def test_one_pass_writes_nothing_and_matches_disk_in_order(tmp_path: Path) -> None:
    plan = epoch_plan([23, 25], BatchOptions(10))  # rank 0 holds 2 rows fewer: it wraps around
    disk = _stream(tmp_path / "spool", _batches(23, 4), expected=23)
    none = _stream(None, _batches(23, 4), expected=23, keep=2)
    expected = list(range(23)) + [0, 1]
    assert _labels(disk.epoch_batches(0, plan, rank=0, shuffle=False, seed=0)) == expected
    assert _labels(none.epoch_batches(0, plan, rank=0, shuffle=False, seed=0)) == expected
    with pytest.raises(Exception, match="spool='none' streams every row once"):
        none.epoch_batches(1, plan, rank=0, shuffle=False, seed=0)
    disk.close(), none.close()


def test_one_pass_names_a_partition_that_changed() -> None:
    plan = epoch_plan([30, 30], BatchOptions(10))
    none = _stream(None, _batches(20, 4), expected=30, keep=0)
    with pytest.raises(PartitionChangedError, match="received 20 training rows"):
        _labels(none.epoch_batches(0, plan, rank=0, shuffle=False, seed=0))


def test_training_starts_before_the_partition_has_arrived(tmp_path: Path) -> None:
    release = threading.Event()

    def slow() -> Iterator[pa.RecordBatch]:
        yield from _batches(40, 20)
        release.wait(10)  # the rest arrives only once the first batch was trained on
        yield from _batches(60, 20, start=40)

    partition = StreamedPartition(slow(), LAYOUT, write=lambda b: Spool.write(b, LAYOUT, tmp_path))
    source = StreamingSpool(partition, LAYOUT, 100, buffer_rows=16, one_pass=False)
    batches = source.epoch_batches(0, epoch_plan([100], BatchOptions(10)), rank=0, shuffle=False, seed=0)
    started = time.perf_counter()
    first = next(batches)
    assert time.perf_counter() - started < 5 and first[1].tolist() == list(range(10))
    release.set()
    assert len(list(batches)) == 9
    assert source.seconds > 0
    source.close()


def test_an_error_while_receiving_reaches_the_loop(tmp_path: Path) -> None:
    def broken() -> Iterator[pa.RecordBatch]:
        yield from _batches(10, 10)
        raise OSError("connection to the JVM lost")

    partition = StreamedPartition(broken(), LAYOUT, write=lambda b: Spool.write(b, LAYOUT, tmp_path))
    source = StreamingSpool(partition, LAYOUT, 30, buffer_rows=16, one_pass=False)
    with pytest.raises(OSError, match="connection to the JVM lost"):
        list(source.epoch_batches(0, epoch_plan([30], BatchOptions(10)), rank=0, shuffle=False, seed=0))
    assert not list(tmp_path.iterdir())  # nothing half-written left behind


def test_a_later_epoch_asked_mid_pass_lets_the_live_pass_finish_from_the_spool(tmp_path: Path) -> None:
    """A custom loop may ask for epoch 1 (or its validation rows) while epoch 0 still streams: the
    partition is then received whole, and the rest of epoch 0 comes from the spool, same batches."""
    plan = epoch_plan([300], BatchOptions(16))
    reference = _labels(_stream(tmp_path / "a", _batches(300, 7), expected=300)
                        .epoch_batches(0, plan, rank=0, shuffle=True, seed=2))
    source = _stream(tmp_path / "b", _batches(300, 7), expected=300)
    live = source.epoch_batches(0, plan, rank=0, shuffle=True, seed=2)
    head = [next(live) for _ in range(3)]
    later = _labels(source.epoch_batches(1, plan, rank=0, shuffle=True, seed=2))  # waits for the whole partition
    assert sorted(later) == list(range(300))
    assert _labels(iter(head)) + _labels(live) == reference
    source.close()


def test_epoch_zero_after_the_partition_was_waited_for_reads_the_spool(tmp_path: Path) -> None:
    plan = epoch_plan([50], BatchOptions(8))
    reference = _labels(_stream(tmp_path / "a", _batches(50, 7), expected=50)
                        .epoch_batches(0, plan, rank=0, shuffle=True, seed=4))
    source = _stream(tmp_path / "b", _batches(50, 7), expected=50)
    assert source.seconds > 0  # waits until the last row is in (ctx.spool_seconds read before the pass)
    assert _labels(source.epoch_batches(0, plan, rank=0, shuffle=True, seed=4)) == reference
    source.close()


def test_the_clock_sums_phases_and_the_time_waiting_for_items() -> None:
    from sparkdl.tracking.phases import Clock

    clock = Clock()

    def slow() -> Iterator[int]:
        for i in range(3):
            time.sleep(0.02)
            yield i

    assert list(clock.iterate(slow(), "delivery")) == [0, 1, 2]
    with clock.timed("conversion"):
        time.sleep(0.01)
    clock.lap("first")
    snapshot = clock.snapshot()
    assert snapshot["delivery"] >= 0.05 and snapshot["conversion"] >= 0.009
    assert snapshot["first"] >= snapshot["delivery"]  # the lap covers everything since the clock started
