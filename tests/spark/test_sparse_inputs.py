"""Categorical inputs on a real Spark session (sparkdl/data/sparse_inputs.py): wrong types refused
before any job, Spark's rows equal the pure mapping (data/sparse_hash.py) bit for bit, refused ids
counted in one query, multi-hot weights kept aligned."""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from sparkdl.config.sparse import SparseInput, sparse_inputs
from sparkdl.data.sparse_hash import (SparseIdError, spark_xxhash64_long, spark_xxhash64_string, table_rows,
                                      xxhash64_longs)
from sparkdl.data.sparse_inputs import checked_sparse_columns, prepared_names, sparse_columns, sparse_schema
from sparkdl.errors import ArrayLengthError, ColumnTypeError, MissingColumnError, NullValuesError


def _jobs(spark: SparkSession, group: str) -> list[int]:
    return list(spark.sparkContext.statusTracker().getJobIdsForGroup(group))


@contextmanager
def _group(spark: SparkSession, group: str) -> Iterator[None]:
    """Jobs started on this thread inside the block are counted under `group`."""
    spark.sparkContext.setJobGroup(group, group)
    try:
        yield
    finally:
        spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)  # type: ignore[arg-type]


def _declared(*items: SparseInput):  # type: ignore[no-untyped-def]
    resolved = sparse_inputs(list(items))
    assert resolved is not None
    return resolved


def _rng_words(n: int) -> list[str]:
    rng = np.random.default_rng(1)
    alphabet = list("abcxyz0123456789-_ é日")
    return ["", "a", "user-42", "ünïcödé", "x" * 40] + \
        ["".join(rng.choice(alphabet, size=int(rng.integers(1, 70)))) for _ in range(n)]


@pytest.mark.parametrize("schema, column, weights, pattern, error", [
    ("ids double", "ids", None, r"(?s)sparse column 'ids' .* has type double.*cast\('long'\)", ColumnTypeError),
    ("ids boolean", "ids", None, r"sparse column 'ids' .* has type boolean", ColumnTypeError),
    ("ids array<array<bigint>>", "ids", None, r"(?s)has type array<array<bigint>>.*F.flatten", ColumnTypeError),
    ("ids map<string,int>", "ids", None, r"has type map<string,int>", ColumnTypeError),
    ("ids array<double>", "ids", None, r"has type array<double>", ColumnTypeError),
    ("ids bigint", "missing", None, r"sparse column 'missing' .* is not in the DataFrame", MissingColumnError),
    ("ids array<int>", "ids", "nowhere", r"weights column 'nowhere' .* is not in the DataFrame", MissingColumnError),
    ("ids bigint, w array<float>", "ids", "w", r"'ids' holds one id per row, but weights_col 'w'", ColumnTypeError),
    ("ids array<string>, w array<string>", "ids", "w",
     r"weights column 'w' of sparse column 'ids' has type array<string>, not an array of numbers", ColumnTypeError),
    ("ids array<string>, w double", "ids", "w", r"has type double, not an array of numbers", ColumnTypeError),
])
def test_wrong_types_are_refused_before_any_job(spark: SparkSession, schema: str, column: str, weights: str | None,
                                                pattern: str, error: type) -> None:
    # Computing any row of this frame fails, so an error naming the column proves no job ran.
    struct = spark.createDataFrame([], schema).schema
    df = spark.range(3).select(*[F.lit(None).cast(f.dataType).alias(f.name) for f in struct],
                               F.raise_error(F.lit("a job ran")).alias("poison"))
    group = f"sparse-types-{column}-{schema}"
    with _group(spark, group):
        with pytest.raises(error, match=pattern) as info:
            checked_sparse_columns(df, _declared(SparseInput(column, num_rows=10, weights_col=weights)))
    assert info.value.hint
    assert _jobs(spark, group) == []


def test_spark_rows_equal_the_pure_mapping(spark: SparkSession) -> None:
    words = _rng_words(295)  # 300 with the five fixed ones
    rng = np.random.default_rng(2)
    longs = [0, 1, 99, 100, -1, 2**31, -(2**31), 2**63 - 1, -(2**63)] + \
        [int(v) for v in rng.integers(-(2**62), 2**62, size=291)]
    ints = [int(v) for v in rng.integers(-(2**31), 2**31 - 1, size=len(longs))]
    shorts = [int(v) for v in rng.integers(-(2**15), 2**15 - 1, size=len(longs))]
    rows = [(words[i], longs[i], ints[i], shorts[i]) for i in range(len(longs))]
    df = spark.createDataFrame(rows, "word string, big bigint, small int, tiny smallint")
    inputs = _declared(SparseInput("word", num_rows=1000), SparseInput("big", num_rows=100),
                       SparseInput("small", num_rows=3000), SparseInput("tiny", num_rows=257))
    columns = checked_sparse_columns(df, inputs)
    got = df.select(F.xxhash64("word").alias("h_word"), F.xxhash64(F.col("big")).alias("h_big"),
                    *sparse_columns(columns)).collect()
    # Spark's own xxhash64, bit for bit
    assert [r["h_word"] for r in got] == [spark_xxhash64_string(w) for w in words]
    assert [r["h_big"] for r in got] == xxhash64_longs(longs).tolist() == [spark_xxhash64_long(v) for v in longs]
    # the prepared rows: in-range ids as they are, the others (and every string) hashed
    for index, (name, values, num_rows) in enumerate([("word", words, 1000), ("big", longs, 100),
                                                       ("small", ints, 3000), ("tiny", shorts, 257)]):
        spark_rows = [r[prepared_names(index)[0]] for r in got]
        assert spark_rows == table_rows(values, num_rows).tolist(), name
        assert all(0 <= v < num_rows for v in spark_rows)
    # an int column and a bigint column of the same ids land on the same rows (both widened to bigint)
    same = spark.createDataFrame([(v, v) for v in ints], "a int, b bigint")
    both = checked_sparse_columns(same, _declared(SparseInput("a", table="t", num_rows=3000), SparseInput("b", table="t")))
    pairs = same.select(*sparse_columns(both)).collect()
    assert all(r[0] == r[1] for r in pairs)


def test_refuse_counts_out_of_range_ids_in_one_query(spark: SparkSession) -> None:
    df = spark.createDataFrame([(i, [i, i + 1], [f"s{i}"]) for i in range(-2, 12)],
                               "id bigint, ids array<int>, names array<string>")
    with _group(spark, "sparse-one-query"):
        df.agg(F.count(F.lit(1))).collect()  # what one aggregate query costs in jobs (AQE may add its stages')
    with _group(spark, "sparse-refuse"):
        with pytest.raises(SparseIdError) as info:
            checked_sparse_columns(df, _declared(SparseInput("id", num_rows=10, out_of_range="refuse"),
                                                 SparseInput("names", num_rows=10, out_of_range="refuse")))
    message = str(info.value)
    assert "sparse column 'id' holds 4 id(s) outside the range [0, 10) of its table 'id', e.g. -2" in message
    assert "out_of_range='hash'" in message
    assert len(_jobs(spark, "sparse-refuse")) == len(_jobs(spark, "sparse-one-query")) >= 1
    # multi-hot: every element counts (-2,-1 | -1 | 10 | 10,11 | 11,12 -> 8 ids)
    with pytest.raises(SparseIdError, match=r"sparse column 'ids' holds 8 id\(s\) outside .* e.g. -2"):
        checked_sparse_columns(df, _declared(SparseInput("ids", num_rows=10, out_of_range="refuse")))
    # strings have no range: hashed, never refused; in-range ids pass
    inside = df.filter("id >= 0 AND id < 10")
    checked = checked_sparse_columns(inside, _declared(SparseInput("id", num_rows=10, out_of_range="refuse"),
                                                       SparseInput("names", num_rows=10, out_of_range="refuse")))
    assert [r[0] for r in inside.select(*sparse_columns(checked)).collect()] == list(range(10))
    # rows that changed after the check still cannot slip through: the row expression guards
    with pytest.raises(Exception, match="outside \\[0, 10\\)"):
        df.select(*sparse_columns(checked)).collect()


def test_multi_hot_rows_and_weights_stay_aligned(spark: SparkSession) -> None:
    rng = np.random.default_rng(3)
    rows = []
    for r in range(120):
        size = int(rng.integers(0, 6))
        ids = [int(v) for v in rng.integers(-50, 150, size=size)]
        rows.append((r, ids, [f"tag{v}" for v in ids], [float(v) + 0.5 for v in range(size)]))
    df = spark.createDataFrame(rows, "r int, ids array<bigint>, tags array<string>, w array<double>")
    inputs = _declared(SparseInput("ids", num_rows=100, weights_col="w"), SparseInput("tags", num_rows=64))
    columns = checked_sparse_columns(df, inputs)
    assert [(c.kind, c.multi_hot, c.weighted) for c in columns] == [("integer", True, True), ("string", True, False)]
    prepared = df.select("r", *sparse_columns(columns))
    ids_name, weights_name = prepared_names(0)
    assert prepared.schema[ids_name].dataType == T.ArrayType(T.LongType())
    assert prepared.schema[weights_name].dataType == T.ArrayType(T.FloatType())
    got = {row["r"]: row for row in prepared.collect()}
    for r, ids, tags, weights in rows:
        row = got[r]
        assert row[ids_name] == table_rows(np.array(ids, dtype=np.int64), 100).tolist()
        assert row[prepared_names(1)[0]] == table_rows(np.array(tags, dtype=object), 64).tolist()
        # weight j is still id j's weight
        assert len(row[weights_name]) == len(row[ids_name])
        assert row[weights_name] == [float(np.float32(w)) for w in weights]


@pytest.mark.parametrize("rows, schema, error, pattern", [
    ([([1, 2], [1.0])], "ids array<int>, w array<double>", ArrayLengthError,
     r"1 row\(s\) of sparse column 'ids' hold a different number of ids than of weights in 'w'"),
    ([([1, 2], [1.0, math.nan])], "ids array<int>, w array<double>", NullValuesError,
     r"weights column 'w' of sparse column 'ids' has 1 row\(s\) .* NaN or infinite"),
    ([([1, None], [1.0, 1.0])], "ids array<int>, w array<double>", NullValuesError,
     r"sparse column 'ids' has 1 row\(s\) with null arrays or null ids in them"),
    ([(None, None)], "ids array<int>, w array<double>", NullValuesError, r"sparse column 'ids' has 1 row"),
])
def test_bad_multi_hot_values_are_refused(spark: SparkSession, rows: list, schema: str, error: type,
                                          pattern: str) -> None:
    df: DataFrame = spark.createDataFrame(rows, schema)
    with pytest.raises(error, match=pattern) as info:
        checked_sparse_columns(df, _declared(SparseInput("ids", num_rows=10, weights_col="w")))
    assert info.value.hint


def test_null_scalar_ids_are_refused_with_a_fix(spark: SparkSession) -> None:
    df = spark.createDataFrame([("a",), (None,), (None,)], "user string")
    assert sparse_schema(df, _declared(SparseInput("user", num_rows=10)))[0].kind == "string"  # the type is fine
    with pytest.raises(NullValuesError, match=r"sparse column 'user' has 2 row\(s\) with null ids") as info:
        checked_sparse_columns(df, _declared(SparseInput("user", num_rows=10)))  # the values are not
    assert "'<missing>'" in str(info.value)
