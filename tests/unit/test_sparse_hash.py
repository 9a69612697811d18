"""sparkdl/data/sparse_hash.py: XXH64 and the id -> table row rule, without Spark (the Spark
comparison on a few hundred values is tests/spark/test_sparse_inputs.py)."""
from __future__ import annotations

import numpy as np
import pytest

from sparkdl.data.sparse_hash import (SparseIdError, integer_rows, spark_xxhash64_long, spark_xxhash64_string,
                                      string_rows, table_rows, xxh64, xxhash64_longs)
from sparkdl.errors import SparkdlError


def _signed(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


@pytest.mark.parametrize("data, seed, expected", [
    # the reference implementation's published values (seed 0), one per code path: empty, the
    # 1-byte tail, 4-byte step + tail, the 8-byte lanes, and the 32-byte stripes
    (b"", 0, 0xEF46DB3751D8E999),
    (b"a", 0, 0xD24EC4F1A98C6E5B),
    (b"abc", 0, 0x44BC2CF5AD770999),
    (b"Nobody inspects the spammish repetition", 0, 0xFBCEA83C8A378BF1),
])
def test_xxh64_matches_the_published_values(data: bytes, seed: int, expected: int) -> None:
    assert xxh64(data, seed) == expected


def test_spark_documented_example() -> None:
    """Spark's documentation: SELECT xxhash64('Spark', array(123), 2) = 5602566077635097486. Spark
    chains the arguments (each hash seeds the next) and hashes ints as 4 bytes."""
    h = xxh64(b"Spark", 42)
    for value in (123, 2):
        h = xxh64(value.to_bytes(4, "little"), h)
    assert _signed(h) == 5602566077635097486


def test_vectorised_longs_equal_the_byte_algorithm() -> None:
    values = [0, 1, -1, 7, 2**31, -(2**31) - 1, 2**63 - 1, -(2**63), 123456789012345]
    rng = np.random.default_rng(0)
    values += [int(v) for v in rng.integers(-(2**63), 2**63 - 1, size=200, dtype=np.int64)]
    expected = [spark_xxhash64_long(v) for v in values]
    assert xxhash64_longs(values).tolist() == expected
    assert spark_xxhash64_long(5) == _signed(xxh64((5).to_bytes(8, "little"), 42))


def test_in_range_ids_are_their_own_rows_the_others_hashed_into_range() -> None:
    ids = np.array([0, 3, 9, 10, -1, 10**12, -(2**63)])
    rows = integer_rows(ids, 10)
    assert rows[:3].tolist() == [0, 3, 9]
    assert ((rows >= 0) & (rows < 10)).all()
    assert rows[3:].tolist() == [spark_xxhash64_long(int(v)) % 10 for v in ids[3:]]
    assert rows.dtype == np.int64


def test_refuse_names_the_count_and_an_example() -> None:
    with pytest.raises(SparseIdError, match=r"2 id\(s\) outside .*\[0, 10\), e.g. 10") as info:
        integer_rows([1, 10, 11], 10, out_of_range="refuse")
    assert isinstance(info.value, SparkdlError)
    assert integer_rows([1, 9], 10, out_of_range="refuse").tolist() == [1, 9]


def test_strings_hash_their_utf8_bytes_with_a_non_negative_remainder() -> None:
    words = ["", "a", "user-42", "ünïcödé", "日本", "x" * 100]
    rows = string_rows(words, 1000)
    assert rows.tolist() == [spark_xxhash64_string(w) % 1000 for w in words]
    assert spark_xxhash64_string("ünïcödé") == _signed(xxh64("ünïcödé".encode("utf-8"), 42))
    assert (rows >= 0).all() and (rows < 1000).all()
    # stable: the same string, the same row, whatever else is in the batch
    assert string_rows(["user-42"], 1000)[0] == rows[2]


def test_table_rows_keeps_the_shape_and_refuses_mixed_ids() -> None:
    assert table_rows(np.array([[1, 2], [30, 4]]), 10)[0].tolist() == [1, 2]
    assert table_rows(["a", "b"], 10).tolist() == string_rows(["a", "b"], 10).tolist()
    assert table_rows([], 5).shape == (0,)
    with pytest.raises(TypeError, match="all integers or all strings"):
        table_rows(np.array([1, "a"], dtype=object), 10)
    with pytest.raises(ValueError, match="num_rows must be a positive integer"):
        integer_rows([1], 0)
