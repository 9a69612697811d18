"""Driver side: one shard per rank, with every shard's training rows known before the job starts.

A rank that trains while its partition streams in (launch/stream.py) must know the step count of
epoch 1 up front, and so every rank's row count. Spark's round-robin repartition cannot say it: each
input partition starts dealing at a pseudo-random position, so shares differ by up to the number of
input partitions, not by one. `balanced` deals instead by `monotonically_increasing_id()` (partition
index p * 2^33 + row index i, stable for a deterministic input: row i goes to (i + p) mod W) into a key that hashes into exactly the
target partition, and `shard_row_counts` counts the keys *before* the shuffle (one narrow job over the
input, never the shuffle itself). A DataFrame that keeps its own partitioning is counted by partition.
"""
from __future__ import annotations

from typing import Any

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

SHARD_KEY = "__sparkdl_shard"
ORDER_KEY = "__sparkdl_order"
_SEED = 42  # HashPartitioning's Murmur3Hash seed (Spark's Partitioning.scala)
_MASK = 0xFFFFFFFF


def _rotl(value: int, bits: int) -> int:
    return ((value << bits) | (value >> (32 - bits))) & _MASK


def spark_int_hash(value: int, seed: int = _SEED) -> int:
    """Spark's Murmur3_x86_32.hashInt (the hash HashPartitioning takes of an int column), signed."""
    k1 = (value & _MASK) * 0xCC9E2D51 & _MASK
    k1 = _rotl(k1, 15) * 0x1B873593 & _MASK
    h1 = _rotl((seed & _MASK) ^ k1, 13)
    h1 = (h1 * 5 + 0xE6546B64) & _MASK
    h1 ^= 4
    h1 ^= h1 >> 16
    h1 = h1 * 0x85EBCA6B & _MASK
    h1 ^= h1 >> 13
    h1 = h1 * 0xC2B2AE35 & _MASK
    h1 ^= h1 >> 16
    return h1 - (1 << 32) if h1 & 0x80000000 else h1


def partition_keys(workers: int) -> tuple[int, ...]:
    """keys[t]: the smallest int that `repartition(workers, key)` sends to partition t."""
    keys: dict[int, int] = {}
    candidate = 0
    while len(keys) < workers:
        keys.setdefault(spark_int_hash(candidate) % workers, candidate)  # Python's % is pmod
        candidate += 1
    return tuple(keys[t] for t in range(workers))


def _key_expression(workers: int) -> Any:
    keys = ", ".join(str(k) for k in partition_keys(workers))
    # Row i of input partition p goes to (i + p) mod workers: partitions' odd rows spread over ranks.
    row, partition = f"(monotonically_increasing_id() & {(1 << 33) - 1})", "shiftright(monotonically_increasing_id(), 33)"
    dealt = f"pmod({row} + {partition}, {workers})"
    return F.expr(f"element_at(array({keys}), cast({dealt} as int) + 1)")


def balanced(df: DataFrame, workers: int, fixed_order: bool = False) -> tuple[DataFrame, DataFrame]:
    """(df dealt row by row over `workers` partitions, the unshuffled input with its shard key to
    count them by): every partition gets rows // workers rows, the first rows % workers one more.
    The rows of a shard arrive in the order the shuffle fetches them, which varies from run to run;
    `fixed_order` sorts each shard by the rows' input position (a sort per shard: a rank's first
    step then waits for its whole shard)."""
    keyed = df.withColumn(SHARD_KEY, _key_expression(workers))
    if not fixed_order:
        return keyed.repartition(workers, F.col(SHARD_KEY)).drop(SHARD_KEY), keyed
    ordered = keyed.withColumn(ORDER_KEY, F.monotonically_increasing_id())
    dealt = ordered.repartition(workers, F.col(SHARD_KEY)).sortWithinPartitions(ORDER_KEY)
    return dealt.drop(SHARD_KEY, ORDER_KEY), keyed


def shard_row_counts(df: DataFrame, workers: int, counted_from: DataFrame | None,
                     split_column: str | None) -> tuple[int, ...]:
    """Training rows of every rank's shard, in rank order. `counted_from`: the keyed input of
    `balanced` (None: `df` kept its partitioning and is counted by partition)."""
    if counted_from is not None:
        by = [F.col(SHARD_KEY).alias("k")]
        source = counted_from
        target = {k: t for t, k in enumerate(partition_keys(workers))}
    else:
        by, source, target = [F.spark_partition_id().alias("k")], df, {t: t for t in range(workers)}
    training = (F.col(split_column) == 0) if split_column else F.lit(True)
    rows = source.select(*by, training.alias("train")).filter("train").groupBy("k").count().collect()
    counts = [0] * workers
    for row in rows:
        counts[target[int(row["k"])]] += int(row["count"])
    return tuple(counts)


def dealt_counts(partition_rows: tuple[int, ...], workers: int) -> tuple[int, ...]:
    """The shards `balanced` makes of partitions holding `partition_rows` rows (no split column):
    row i of partition p goes to (i + p) mod workers."""
    counts = [0] * workers
    for p, rows in enumerate(partition_rows):
        for t in range(workers):
            first = (t - p) % workers
            counts[t] += 0 if first >= rows else (rows - 1 - first) // workers + 1
    return tuple(counts)


def partition_row_counts(df: DataFrame) -> dict[int, int]:
    """Rows per non-empty partition (one small job)."""
    rows = df.select(F.spark_partition_id().alias("p")).groupBy("p").count().collect()
    return {int(r["p"]): int(r["count"]) for r in rows}

