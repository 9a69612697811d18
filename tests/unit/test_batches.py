"""sparkdl.data.batches: spool round trip, chunking, shuffling, equal steps per rank. No Spark."""
from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from sparkdl.data.batches import Spool, last_batch_size, steps_per_epoch, table_batches
from sparkdl.data.layout import FEATURES_COLUMN, LABEL_COLUMN, FeedLayout
from sparkdl.errors import ArrayLengthError, EmptyDataError, MissingColumnError, NullValuesError

D = 8


def make_data(n: int, d: int = D, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    features = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return features, np.arange(n, dtype=np.int64)  # label = row id, to track rows through batches


def list_array(features: np.ndarray, kind: str) -> pa.Array:
    n, d = features.shape
    values = pa.array(features.reshape(-1))
    if kind == "fixed_size_list":
        return pa.FixedSizeListArray.from_arrays(values, d)
    offsets = np.arange(0, (n + 1) * d, d)
    if kind == "large_list":
        return pa.LargeListArray.from_arrays(pa.array(offsets, pa.int64()), values)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values)


def spark_batches(features: np.ndarray, labels: np.ndarray | None, rows: int = 100,
                  kind: str = "list") -> Iterator[pa.RecordBatch]:
    """Record batches shaped like Spark's, plus a column the spool must ignore; single pass."""
    for start in range(0, len(features), rows):
        block = features[start : start + rows]
        columns = {"other": pa.array(np.zeros(len(block))), FEATURES_COLUMN: list_array(block, kind)}
        if labels is not None:
            columns[LABEL_COLUMN] = pa.array(labels[start : start + rows])
        yield pa.record_batch(columns)


def layout(label_dtype: str | None = "int64", d: int = D) -> FeedLayout:
    return FeedLayout(num_features=d, label_dtype=label_dtype)


def spool_of(tmp_path: Path, n: int, *, chunk_rows: int | None = None, kind: str = "list",
             labels: bool = True) -> tuple[Spool, np.ndarray, np.ndarray]:
    features, ids = make_data(n)
    lay = layout("int64" if labels else None)
    chunk_bytes = (chunk_rows or 1 << 20) * (4 * D + (8 if labels else 0))
    spool = Spool.write(spark_batches(features, ids if labels else None, kind=kind), lay, tmp_path,
                        chunk_bytes=chunk_bytes)
    return spool, features, ids


def epoch_ids(spool: Spool, epoch: int = 0, *, bs: int, steps: int, shuffle: bool, seed: int = 7,
              rank: int = 0, drop_last: bool = False, last: int | None = None) -> list[np.ndarray]:
    return [y.numpy().copy() for _, y in spool.batches(epoch, batch_size=bs, steps=steps, shuffle=shuffle,
                                                        seed=seed, rank=rank, drop_last=drop_last,
                                                        last_batch_size=last)]


@pytest.mark.parametrize("kind", ["list", "large_list", "fixed_size_list"])
def test_round_trip_values_and_labels(tmp_path: Path, kind: str) -> None:
    with spool_of(tmp_path, 1000, chunk_rows=300, kind=kind)[0] as spool:
        features, ids = make_data(1000)
        assert spool.num_rows == 1000
        got = list(spool.batches(0, batch_size=64, steps=16, shuffle=False, seed=0, rank=0,
                                 drop_last=False, last_batch_size=1000 - 15 * 64))
        x = torch.cat([b[0] for b in got])
        y = torch.cat([b[1] for b in got])
        assert x.dtype == torch.float32 and y.dtype == torch.int64
        np.testing.assert_array_equal(x.numpy(), features)
        np.testing.assert_array_equal(y.numpy(), ids)


def test_float_labels_and_no_labels(tmp_path: Path) -> None:
    features, _ = make_data(50)
    target = np.linspace(0, 1, 50, dtype=np.float32)
    with Spool.write(spark_batches(features, target), layout("float32"), tmp_path) as spool:
        x, y = next(spool.batches(0, batch_size=50, steps=1, shuffle=True, seed=1, rank=0, drop_last=True))
        assert y is not None and y.dtype == torch.float32
        np.testing.assert_array_equal(x.numpy(), features[np.searchsorted(target, y.numpy())])
    with Spool.write(spark_batches(features, None), layout(None), tmp_path) as spool:
        x, y = next(spool.batches(0, batch_size=10, steps=1, shuffle=False, seed=1, rank=0, drop_last=True))
        assert y is None and x.shape == (10, D)


def test_sliced_list_array_with_offsets_not_at_zero(tmp_path: Path) -> None:
    features, ids = make_data(30)
    column = list_array(features, "list").slice(10, 15)  # offsets start at 10 * D
    batch = pa.record_batch({FEATURES_COLUMN: column, LABEL_COLUMN: pa.array(ids[10:25])})
    fixed = pa.record_batch({FEATURES_COLUMN: list_array(features, "fixed_size_list").slice(25, 5),
                             LABEL_COLUMN: pa.array(ids[25:])})
    with Spool.write(iter([batch, fixed]), layout(), tmp_path) as spool:
        x, y = next(spool.batches(0, batch_size=20, steps=1, shuffle=False, seed=0, rank=0, drop_last=True))
        np.testing.assert_array_equal(x.numpy(), features[10:])
        np.testing.assert_array_equal(y.numpy(), ids[10:])


def test_wrong_row_length_names_the_column(tmp_path: Path) -> None:
    ragged = pa.array([[1.0] * D, [1.0] * (D - 1)], pa.list_(pa.float32()))
    with pytest.raises(ArrayLengthError, match=FEATURES_COLUMN):
        Spool.write(iter([pa.record_batch({FEATURES_COLUMN: ragged})]), layout(None), tmp_path)
    narrow = pa.array([[1.0] * (D - 1)], pa.list_(pa.float32(), D - 1))
    with pytest.raises(ArrayLengthError, match=FEATURES_COLUMN):
        Spool.write(iter([pa.record_batch({FEATURES_COLUMN: narrow})]), layout(None), tmp_path)
    assert list(tmp_path.iterdir()) == []  # the partial file is gone too


def test_missing_label_and_null_features(tmp_path: Path) -> None:
    features, _ = make_data(4)
    with pytest.raises(MissingColumnError, match=LABEL_COLUMN):
        Spool.write(spark_batches(features, None), layout("int64"), tmp_path)
    nulls = pa.array([[1.0] * D, None], pa.list_(pa.float32()))
    with pytest.raises(NullValuesError, match=FEATURES_COLUMN):
        Spool.write(iter([pa.record_batch({FEATURES_COLUMN: nulls})]), layout(None), tmp_path)


def test_rechunks_into_blocks_of_chunk_bytes(tmp_path: Path) -> None:
    with spool_of(tmp_path, 1000, chunk_rows=300)[0] as spool:  # input: batches of 100 rows
        reader = pa.ipc.open_file(str(spool.path))
        sizes = [reader.get_batch(i).num_rows for i in range(reader.num_record_batches)]
        assert sizes == [300, 300, 300, 100]
        assert reader.schema.field(FEATURES_COLUMN).type == pa.list_(pa.float32(), D)


@pytest.mark.parametrize("shuffle", [False, True])
def test_every_row_once_per_epoch_across_chunks(tmp_path: Path, shuffle: bool) -> None:
    with spool_of(tmp_path, 960, chunk_rows=250)[0] as spool:
        features, _ = make_data(960)
        for epoch in range(3):
            seen = []
            for x, y in spool.batches(epoch, batch_size=32, steps=30, shuffle=shuffle, seed=3, rank=0,
                                      drop_last=True):
                np.testing.assert_array_equal(x.numpy(), features[y.numpy()])  # rows stay whole
                seen.append(y.numpy())
            ids = np.concatenate(seen)
            np.testing.assert_array_equal(np.sort(ids), np.arange(960))
            assert (not np.array_equal(ids, np.arange(960))) == shuffle


def test_shuffle_is_deterministic_per_seed_epoch_and_rank(tmp_path: Path) -> None:
    spool, *_ = spool_of(tmp_path, 500, chunk_rows=128)
    with spool:
        same = epoch_ids(spool, 1, bs=50, steps=10, shuffle=True, seed=5, rank=2)
        np.testing.assert_array_equal(np.concatenate(same), np.concatenate(
            epoch_ids(spool, 1, bs=50, steps=10, shuffle=True, seed=5, rank=2)))
        for other in (dict(epoch=2, seed=5, rank=2), dict(epoch=1, seed=6, rank=2),
                      dict(epoch=1, seed=5, rank=3)):
            ids = epoch_ids(spool, other.pop("epoch"), bs=50, steps=10, shuffle=True, **other)
            assert not np.array_equal(np.concatenate(ids), np.concatenate(same))


def test_unequal_partitions_get_identical_steps_and_batch_sizes(tmp_path: Path) -> None:
    counts = [1000, 100]
    steps = steps_per_epoch(counts, 64, drop_last=False)
    last = last_batch_size(counts, 64, drop_last=False)
    assert (steps, last) == (16, 1000 - 15 * 64)
    per_rank = []
    for rank, n in enumerate(counts):
        with spool_of(tmp_path, n, chunk_rows=70)[0] as spool:
            per_rank.append(epoch_ids(spool, 0, bs=64, steps=steps, shuffle=True, rank=rank, last=last))
    assert [len(b) for b in per_rank[0]] == [len(b) for b in per_rank[1]] == [64] * 15 + [40]
    big, small = np.concatenate(per_rank[0]), np.concatenate(per_rank[1])
    np.testing.assert_array_equal(np.sort(big), np.arange(1000))  # largest rank: each row once
    # The small rank wraps around its own rows: each pass is a full permutation, all rows used 10x.
    for p in range(10):
        np.testing.assert_array_equal(np.sort(small[p * 100 : (p + 1) * 100]), np.arange(100))
    assert not np.array_equal(small[:100], small[100:200])  # each pass is a fresh permutation


def test_in_order_wraps_around(tmp_path: Path) -> None:
    with spool_of(tmp_path, 5, chunk_rows=2)[0] as spool:
        ids = epoch_ids(spool, bs=4, steps=3, shuffle=False)
        assert [b.tolist() for b in ids] == [[0, 1, 2, 3], [4, 0, 1, 2], [3, 4, 0, 1]]
        # A batch larger than the partition cycles through it more than once.
        assert epoch_ids(spool, bs=12, steps=1, shuffle=False)[0].tolist() == [0, 1, 2, 3, 4] * 2 + [0, 1]


def test_drop_last_and_step_rule() -> None:
    assert steps_per_epoch([10, 3], 4, drop_last=True) == 2
    assert last_batch_size([10, 3], 4, drop_last=True) == 4
    assert steps_per_epoch([10, 3], 4, drop_last=False) == 3
    assert last_batch_size([10, 3], 4, drop_last=False) == 2
    assert steps_per_epoch([12], 4, drop_last=False) == 3 and last_batch_size([12], 4, False) == 4
    assert steps_per_epoch([3, 2], 4, drop_last=True) == 0
    assert steps_per_epoch([0, 0], 4, drop_last=False) == 0 == last_batch_size([0, 0], 4, False)


def test_drop_last_batches(tmp_path: Path) -> None:
    with spool_of(tmp_path, 10)[0] as spool:
        ids = epoch_ids(spool, bs=4, steps=steps_per_epoch([10], 4, True), shuffle=True, drop_last=True)
        assert [len(b) for b in ids] == [4, 4]
        ids = epoch_ids(spool, bs=4, steps=3, shuffle=True, last=last_batch_size([10], 4, False))
        assert [len(b) for b in ids] == [4, 4, 2]
        np.testing.assert_array_equal(np.sort(np.concatenate(ids)), np.arange(10))


def test_empty_partition(tmp_path: Path) -> None:
    with Spool.write(iter([]), layout(), tmp_path) as spool:
        assert spool.num_rows == 0
        assert list(spool.batches(0, batch_size=4, steps=0, shuffle=True, seed=0, rank=1,
                                  drop_last=False)) == []
        with pytest.raises(EmptyDataError, match="rank 1 received no rows") as err:
            spool.batches(0, batch_size=4, steps=3, shuffle=True, seed=0, rank=1, drop_last=False)
        assert "fewer workers" in str(err.value) and "repartition" in str(err.value)
    empty_batch = pa.record_batch({FEATURES_COLUMN: pa.array([], pa.list_(pa.float32())),
                                   LABEL_COLUMN: pa.array([], pa.int64())})
    with Spool.write(iter([empty_batch]), layout(), tmp_path) as spool:
        assert spool.num_rows == 0


def test_in_order_batches_are_zero_copy_views_of_the_mapping(tmp_path: Path) -> None:
    spool, features, _ = spool_of(tmp_path, 1000, chunk_rows=300)
    with spool:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch's non-writable warning is silenced, not copied away
            batches = list(spool.batches(0, batch_size=100, steps=10, shuffle=False, seed=0, rank=0,
                                         drop_last=True))
        # Consecutive in-order batches of one chunk are adjacent slices of the one mapped block:
        # no copy was made.
        (x0, y0), (x1, y1) = batches[0], batches[1]
        assert x1.data_ptr() == x0.data_ptr() + x0.numel() * x0.element_size()
        assert y1.data_ptr() == y0.data_ptr() + y0.numel() * y0.element_size()
        assert not x0.numpy().flags.owndata
        # Rows 300..399 lie in chunk 1 (a view); a batch across chunks is a fresh copy.
        assert not batches[3][0].numpy().flags.owndata
        straddling = list(spool.batches(0, batch_size=250, steps=2, shuffle=False, seed=0, rank=0,
                                        drop_last=True))[1][0]  # rows 250..499 span chunks 0 and 1
        np.testing.assert_array_equal(straddling.numpy(), features[250:500])
        shuffled = next(spool.batches(0, batch_size=100, steps=1, shuffle=True, seed=0, rank=0,
                                      drop_last=True))[0]
        assert shuffled.numpy().flags.writeable


def test_close_removes_file_and_keeps_handed_out_batches_valid(tmp_path: Path) -> None:
    spool, features, _ = spool_of(tmp_path, 100)
    path = spool.path
    assert path.exists() and path.suffix == ".arrow"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no .tmp left behind
    x, _ = next(spool.batches(0, batch_size=10, steps=1, shuffle=False, seed=0, rank=0, drop_last=True))
    spool.close()
    spool.close()  # idempotent
    assert not path.exists() and not list(tmp_path.iterdir())  # its directory and lock file too
    np.testing.assert_array_equal(x.numpy(), features[:10])  # Arrow keeps the region mapped
    with pytest.raises(ValueError, match="closed"):
        spool.num_rows  # noqa: B018


def test_garbage_collected_spool_deletes_its_file(tmp_path: Path) -> None:
    spool, *_ = spool_of(tmp_path, 10)
    path = spool.path
    del spool
    assert not path.exists()


def test_table_batches_match_spool_batches(tmp_path: Path) -> None:
    features, ids = make_data(777)
    table = pa.Table.from_batches(list(spark_batches(features, ids, kind="fixed_size_list")))
    counts = [777, 500]
    kwargs = dict(batch_size=50, steps=steps_per_epoch(counts, 50, False), seed=9, rank=0,
                  drop_last=False, last_batch_size=last_batch_size(counts, 50, False))
    chunk_bytes = 100 * (4 * D + 8)
    with Spool.write(spark_batches(features, ids), layout(), tmp_path, chunk_bytes=chunk_bytes) as spool:
        for shuffle in (False, True):
            for (xs, ys), (xt, yt) in zip(spool.batches(3, shuffle=shuffle, **kwargs),
                                          table_batches(table, layout(), 3, shuffle=shuffle, **kwargs),
                                          strict=True):
                assert torch.equal(xs, xt) and torch.equal(ys, yt)


def test_batch_count_matches_steps_for_many_shapes(tmp_path: Path) -> None:
    with spool_of(tmp_path, 37, chunk_rows=5)[0] as spool:
        for bs in (1, 3, 37, 64):
            steps = math.ceil(100 / bs)
            got = epoch_ids(spool, bs=bs, steps=steps, shuffle=bs % 2 == 1, last=100 - (steps - 1) * bs)
            assert sum(len(b) for b in got) == 100 and len(got) == steps


@pytest.mark.parametrize("sizes", [(7, 50, 13, 30), (30, 30, 40)])
def test_spool_opens_a_file_with_uneven_chunks(tmp_path: Path, sizes: tuple[int, ...]) -> None:
    """Chunks of other sizes than the spool writes take the searched (not divided) chunk lookup."""
    features, ids = make_data(100)
    schema = pa.schema([(FEATURES_COLUMN, pa.list_(pa.float32(), D)), (LABEL_COLUMN, pa.int64())])
    path = tmp_path / "uneven.arrow"
    bounds = np.cumsum([0, *sizes])
    with pa.ipc.new_file(str(path), schema) as out:
        for start, stop in zip(bounds[:-1], bounds[1:]):
            out.write_batch(pa.record_batch([list_array(features[start:stop], "fixed_size_list"),
                                             pa.array(ids[start:stop])], schema=schema))
    with Spool(path, layout()) as spool:
        assert spool.chunk_rows == 0
        for shuffle in (False, True):
            for x, y in spool.batches(0, batch_size=33, steps=7, shuffle=shuffle, seed=2, rank=0,
                                      drop_last=True):
                np.testing.assert_array_equal(x.numpy(), features[y.numpy()])
    assert not path.exists()


def test_gathering_several_batches_at_once_changes_nothing(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from sparkdl.data import batches

    spool, features, _ = spool_of(tmp_path, 500, chunk_rows=64)
    with spool:
        whole = epoch_ids(spool, 4, bs=24, steps=25, shuffle=True, last=20)
        monkeypatch.setattr(batches, "_GROUP_BYTES", 3 * 24 * 4 * D)  # 3 batches per gather
        grouped = epoch_ids(spool, 4, bs=24, steps=25, shuffle=True, last=20)
        for x, y in spool.batches(4, batch_size=24, steps=25, shuffle=True, seed=7, rank=0,
                                  drop_last=False, last_batch_size=20):
            np.testing.assert_array_equal(x.numpy(), features[y.numpy()])
        monkeypatch.setattr(batches, "_GROUP_BYTES", 1)  # one batch per gather
        single = epoch_ids(spool, 4, bs=24, steps=25, shuffle=True, last=20)
    assert [len(b) for b in grouped] == [24] * 24 + [20]
    for a, b, c in zip(whole, grouped, single, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_in_place_writes_to_zero_copy_batches_do_not_crash_or_touch_the_file(tmp_path) -> None:
    import numpy as np
    import pyarrow as pa

    from sparkdl.data.batches import Spool
    from sparkdl.data.layout import FeedLayout

    layout = FeedLayout(num_features=2, label_dtype="int64")
    values = pa.array(np.arange(8, dtype=np.float32))
    batch = pa.RecordBatch.from_arrays(
        [pa.ListArray.from_arrays(pa.array([0, 2, 4, 6, 8], pa.int32()), values), pa.array([0, 1, 0, 1])],
        names=[layout.feature_column, layout.label_column])
    with Spool.write([batch], layout, tmp_path) as spool:
        before = spool.path.read_bytes()
        features, _ = next(spool.batches(0, batch_size=4, steps=1, shuffle=False, seed=0, rank=0, drop_last=False))
        features.mul_(2)  # a read-only mapping would kill the process here
        assert features[1, 1].item() == 6.0
        assert spool.path.read_bytes() == before


def test_in_place_writes_do_not_leak_into_the_next_epoch(tmp_path) -> None:
    import numpy as np
    import pyarrow as pa

    from sparkdl.data.batches import Spool
    from sparkdl.data.layout import FeedLayout

    layout = FeedLayout(num_features=1, label_dtype=None)
    batch = pa.RecordBatch.from_arrays(
        [pa.ListArray.from_arrays(pa.array([0, 1, 2], pa.int32()), pa.array(np.ones(2, np.float32)))],
        names=[layout.feature_column])
    with Spool.write([batch], layout, tmp_path) as spool:
        for epoch in range(3):
            features, _ = next(spool.batches(epoch, batch_size=2, steps=1, shuffle=False, seed=0, rank=0,
                                             drop_last=False))
            assert features.tolist() == [[1.0], [1.0]]
            features.add_(100)


def test_a_resumed_epoch_starts_at_its_batch_with_the_same_rows(tmp_path: Path) -> None:
    spool, _, _ = spool_of(tmp_path, 500, chunk_rows=64)
    with spool:
        for shuffle in (False, True):
            whole = [y.numpy().copy() for _, y in spool.batches(2, batch_size=24, steps=25, shuffle=shuffle, seed=7,
                                                                rank=0, drop_last=False, last_batch_size=20)]
            rest = [y.numpy().copy() for _, y in spool.batches(2, batch_size=24, steps=25, shuffle=shuffle, seed=7,
                                                               rank=0, drop_last=False, last_batch_size=20, start=9)]
            assert len(rest) == 16
            for a, b in zip(whole[9:], rest, strict=True):
                np.testing.assert_array_equal(a, b)
