"""data/shards.py's arithmetic: Spark's int hash, keys per target partition, dealt counts."""
from __future__ import annotations

from sparkdl.data.shards import dealt_counts, partition_keys, spark_int_hash


def test_the_hash_is_sparks_murmur3_of_an_int() -> None:
    # F.hash(F.lit(v).cast("int")) printed by Spark 4 for these values
    values = [0, 1, 2, 3, 17, -5, 123456, 2**31 - 1]
    assert [spark_int_hash(v) for v in values] == [933211791, -559580957, 1765031574, -1823081949, -1355542311,
                                                  1369497261, 1905992991, 133916647]


def test_each_target_partition_has_its_own_key() -> None:
    for workers in (1, 2, 3, 8, 64):
        keys = partition_keys(workers)
        assert [spark_int_hash(k) % workers for k in keys] == list(range(workers))


def test_dealt_counts_spread_every_partition_over_the_ranks() -> None:
    counts = dealt_counts((5, 5, 5), 2)
    assert sum(counts) == 15 and max(counts) - min(counts) <= 1
    assert dealt_counts((0, 7), 3) == (2, 3, 2)
    assert dealt_counts((4,), 4) == (1, 1, 1, 1)
