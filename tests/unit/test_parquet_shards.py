"""Direct Parquet delivery, executor side: which rows each rank reads and how they are converted."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparkdl.data.arrow_rows import incoming_arrays
from sparkdl.data.layout import FeedLayout
from sparkdl.data.parquet_shards import ParquetPiece, ParquetShards, SourceColumn, assign_pieces, shard_batches
from sparkdl.errors import PartitionChangedError


def test_ranks_get_contiguous_ranges_equal_to_one_row() -> None:
    groups = [("a", 0, 5), ("a", 1, 3), ("b", 0, 4)]  # 12 rows
    pieces = assign_pieces(groups, 5)
    counts = [sum(p.rows for p in rank) for rank in pieces]
    assert counts == [2, 2, 3, 2, 3] and sum(counts) == 12
    flat = [(p.path, p.row_group, r) for rank in pieces for p in rank for r in range(p.start, p.stop)]
    assert flat == [(path, group, r) for path, group, rows in groups for r in range(rows)]  # each row once, in order
    assert pieces[2] == (ParquetPiece("a", 0, 4, 5), ParquetPiece("a", 1, 0, 2))  # a boundary splits a group


def test_more_ranks_than_groups_and_empty_ranges() -> None:
    pieces = assign_pieces([("a", 0, 2)], 3)
    assert [sum(p.rows for p in rank) for rank in pieces] == [0, 1, 1]


def _file(tmp_path: Path, rows: int = 25) -> tuple[str, pa.Table]:
    rng = np.random.default_rng(0)
    table = pa.table({"x": rng.normal(size=rows), "n": rng.integers(-3, 3, rows).astype(np.int32),
                      "b": rng.integers(0, 2, rows).astype(bool),
                      "arr": pa.array(list(rng.normal(size=(rows, 2)).astype(np.float32)), pa.list_(pa.float32())),
                      "y": rng.integers(0, 4, rows).astype(float), "w": rng.uniform(size=rows)})
    path = str(tmp_path / "f.parquet")
    pq.write_table(table, path, row_group_size=7)
    return path, table


def test_a_rank_reads_its_rows_in_the_feed_layout(tmp_path: Path) -> None:
    path, table = _file(tmp_path)
    groups = [(path, i, pq.ParquetFile(path).metadata.row_group(i).num_rows) for i in range(4)]
    pieces = assign_pieces(groups, 2)
    shards = ParquetShards(features=(SourceColumn("x"), SourceColumn("n"), SourceColumn("b"), SourceColumn("arr", 2)),
                           label="y", weight="w", pieces=pieces, files=1)
    layout = FeedLayout(num_features=5, label_dtype="int64", weight_column="__w")
    want = np.column_stack([table["x"].to_numpy(), table["n"].to_numpy(), table["b"].to_numpy(),
                            np.stack(table["arr"].to_numpy(zero_copy_only=False))]).astype(np.float32)
    start = 0
    for rank in range(2):
        blocks = [incoming_arrays(b, layout) for b in shard_batches(shards, rank, layout, batch_rows=4)]
        features = np.concatenate([b[0] for b in blocks])
        labels, weights = np.concatenate([b[1] for b in blocks]), np.concatenate([b[2] for b in blocks])
        stop = start + shards.row_counts[rank]
        np.testing.assert_array_equal(features, want[start:stop])
        assert labels.dtype == np.int64 and weights.dtype == np.float32
        np.testing.assert_array_equal(labels, table["y"].to_numpy()[start:stop].astype(np.int64))
        np.testing.assert_array_equal(weights, table["w"].to_numpy()[start:stop].astype(np.float32))
        start = stop
    assert start == 25


def test_a_file_shorter_than_planned_is_named(tmp_path: Path) -> None:
    path, _ = _file(tmp_path)
    shards = ParquetShards(features=(SourceColumn("x"),), label=None, weight=None,
                           pieces=((ParquetPiece(path, 0, 0, 9),),))
    with pytest.raises(PartitionChangedError, match="row group 0 .* holds 7 rows"):
        list(shard_batches(shards, 0, FeedLayout(num_features=1, label_dtype=None)))
