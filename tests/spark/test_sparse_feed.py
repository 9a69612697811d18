"""sparse_cols runs through the driver's data stage (sparkdl/data/sparse_feed.py) on a real Spark
session: the prepared columns, their rows against the pure mapping (data/sparse_hash.py), the
layout the workers read, the checks (one statistics job; schema errors with none), validation rows,
and the same columns rebuilt for scoring."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from sparkdl.config import DataConfig
from sparkdl.config.sparse import SparseInput
from sparkdl.data.arrow_rows import incoming_arrays
from sparkdl.data.layout import (DENSE_SOURCE, FIXED, INPUT_PREFIX, LABEL_COLUMN, RAGGED, SPLIT_COLUMN,
                                 WEIGHT_COLUMN, SparseFeature, TensorColumn)
from sparkdl.data.sparse_feed import prepare_sparse, scoring_columns
from sparkdl.data.sparse_hash import SparseIdError, integer_rows, string_rows
from sparkdl.errors import ArrayLengthError, ColumnTypeError, MissingColumnError, NullValuesError

SCHEMA = ("f1 double, vec array<double>, user bigint, clicked int, city string, tags array<int>, "
          "tag_w array<double>, label int, w double")
ROWS = [  # w is unique per row: the key the checks below match rows by
    (0.5, [1.0, 2.0], 0, 1, "paris", [0, 4], [1.0, 0.5], 0, 1.0),
    (1.5, [3.0, 4.0], 3, 2, "", [], [], 1, 2.0),
    (2.5, [5.0, 6.0], 9, 3, "日本", [7, -2, 3], [0.25, 2.0, 1.0], 1, 3.0),
    (3.5, [7.0, 8.0], 10, 50, "paris", [99], [3.0], 0, 4.0),  # 10 and 50: outside users' [0, 10)
    (4.5, [9.0, 1.0], -1, 6, "x", [1], [1.0], 1, 5.0),
    (5.5, [2.0, 3.0], 123456789012, 7, "y", [2, 2], [1.0, 1.0], 0, 6.0),
]
DECLARED = [SparseInput("user", table="users", num_rows=10), SparseInput("clicked", table="users"),
            SparseInput("city", num_rows=7), SparseInput("tags", num_rows=5, weights_col="tag_w")]
PREPARED = [f"{INPUT_PREFIX}0", "__sparkdl_sparse_0", "__sparkdl_sparse_1", "__sparkdl_sparse_2",
            "__sparkdl_sparse_3", "__sparkdl_sparse_w_3", LABEL_COLUMN, WEIGHT_COLUMN]


@pytest.fixture(scope="module")
def clicks(spark: SparkSession) -> DataFrame:
    return spark.createDataFrame(ROWS, SCHEMA).cache()


def _data(**changes: Any) -> DataConfig:
    values: dict[str, Any] = dict(feature_cols=("f1", "vec"), label_col="label", weight_col="w",
                                  sparse_cols=DECLARED)
    values.update(changes)
    return DataConfig(**values)


@contextmanager
def _jobs(spark: SparkSession, group: str) -> Iterator[list[int]]:
    """The ids of the jobs started on this thread inside the block (filled in when it ends)."""
    found: list[int] = []
    spark.sparkContext.setJobGroup(group, group)
    try:
        yield found
    finally:
        spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)  # type: ignore[arg-type]
        found += spark.sparkContext.statusTracker().getJobIdsForGroup(group)


def _expected(row: tuple) -> tuple:
    f1, vec, user, clicked, city, tags, tag_w, label, w = row
    return ([f1, *vec], int(integer_rows([user], 10)[0]), int(integer_rows([clicked], 10)[0]),
            int(string_rows([city], 7)[0]), integer_rows(tags, 5).tolist() if tags else [], tag_w, label, w)


def test_prepared_columns_rows_and_layout(spark: SparkSession, clicks: DataFrame) -> None:
    prepared = prepare_sparse(clicks, _data(), classification=True, num_workers=2)
    df, layout = prepared.df, prepared.layout
    assert df.columns == PREPARED
    assert [f.dataType.simpleString() for f in df.schema.fields] == [
        "array<float>", "bigint", "bigint", "bigint", "array<bigint>", "array<float>", "bigint", "float"]
    got = sorted((tuple(r) for r in df.collect()), key=lambda r: r[-1])
    assert [(r[0], *r[1:]) for r in got] == [_expected(r) for r in ROWS]
    hashed = [r for r in got if r[-1] == 4.0][0]
    assert hashed[1] != 10 and 0 <= hashed[1] < 10 and hashed[2] == integer_rows([50], 10)[0]  # the shared table
    assert prepared.num_rows == len(ROWS) and prepared.num_validation_rows == 0
    assert layout.num_features == 3 and layout.label_dtype == "int64" and layout.num_classes == 2
    assert layout.source_feature_cols == ("f1", "vec") and layout.source_label_col == "label"
    assert (layout.weight_column, layout.source_weight_col) == (WEIGHT_COLUMN, "w")
    assert layout.inputs == (
        TensorColumn(DENSE_SOURCE, f"{INPUT_PREFIX}0", FIXED, "float32", "float32", (3,)),
        TensorColumn("user", "__sparkdl_sparse_0", FIXED, "int64", "int64", ()),
        TensorColumn("clicked", "__sparkdl_sparse_1", FIXED, "int64", "int64", ()),
        TensorColumn("city", "__sparkdl_sparse_2", FIXED, "int64", "int64", ()),
        TensorColumn("tags", "__sparkdl_sparse_3", RAGGED, "int64", "int64", ()),
        TensorColumn("tag_w", "__sparkdl_sparse_w_3", RAGGED, "float32", "float32", ()))
    assert layout.label == TensorColumn("label", LABEL_COLUMN, FIXED, "int64", "int64", ())
    assert layout.sparse == (SparseFeature("user", "users", 10, "integer", False),
                             SparseFeature("clicked", "users", 10, "integer", False),
                             SparseFeature("city", "city", 7, "string", False),
                             SparseFeature("tags", "tags", 5, "integer", True, "hash", "tag_w"))
    assert layout.dense_inputs == layout.inputs[:1]


def test_sample_is_what_the_workers_read(spark: SparkSession, clicks: DataFrame) -> None:
    """The prepared Spark types are what arrow_rows expects: the sample batch converts as a rank's would."""
    prepared = prepare_sparse(clicks, _data(), classification=True, num_workers=2)
    assert isinstance(prepared.sample, pa.Table) and prepared.sample.column_names == PREPARED
    batch = prepared.sample.combine_chunks().to_batches()[0]
    dense, user, clicked, city, tags, weights, label, weight = incoming_arrays(batch, prepared.layout)
    assert dense.dtype == np.float32 and dense.shape == (batch.num_rows, 3)
    assert user.dtype == np.int64 and user.shape == (batch.num_rows,) and label.dtype == np.int64
    assert tags.type == pa.large_list(pa.int64()) and weights.type == pa.large_list(pa.float32())
    assert [len(t) for t in tags.to_pylist()] == [len(w) for w in weights.to_pylist()]
    assert weight.dtype == np.float32


def test_no_dense_columns_string_multi_hot_regression(spark: SparkSession) -> None:
    df = spark.createDataFrame([(["a", "b"], 1.5), ([], 2.0), (["c"], -1.0)], "genres array<string>, y double")
    data = DataConfig(feature_cols=(), label_col="y", sparse_cols={"genres": {"num_rows": 11}})
    prepared = prepare_sparse(df, data, classification=False, num_workers=1)
    assert prepared.df.columns == ["__sparkdl_sparse_0", LABEL_COLUMN]
    assert prepared.df.schema[LABEL_COLUMN].dataType.simpleString() == "float"
    layout = prepared.layout
    assert layout.num_features == 0 and layout.dense_inputs == () and layout.label_dtype == "float32"
    assert layout.inputs == (TensorColumn("genres", "__sparkdl_sparse_0", RAGGED, "int64", "int64", ()),)
    assert layout.sparse == (SparseFeature("genres", "genres", 11, "string", True),)
    assert layout.source_input_cols == ("genres",)
    got = {r[1]: r[0] for r in prepared.df.collect()}
    assert got == {1.5: string_rows(["a", "b"], 11).tolist(), 2.0: [], -1.0: string_rows(["c"], 11).tolist()}


def test_refused_ids_raise_after_the_one_statistics_job(spark: SparkSession, clicks: DataFrame) -> None:
    refused = [SparseInput("user", num_rows=10, out_of_range="refuse"), *DECLARED[2:]]
    with _jobs(spark, "sparse-feed-one-aggregate") as one:
        clicks.agg(F.count(F.lit(1))).collect()
    with _jobs(spark, "sparse-feed-refuse") as jobs, \
            pytest.raises(SparseIdError, match=r"sparse column 'user' holds 3 id\(s\) outside the range \[0, 10\)"):
        prepare_sparse(clicks, _data(sparse_cols=refused), classification=True, num_workers=2)
    assert len(jobs) == len(one)  # the statistics' aggregation, nothing more


@pytest.mark.parametrize("rows, error, pattern", [
    ([(None, [1], [1.0]), (2, [1], [1.0])], NullValuesError, r"sparse column 'user' has 1 row\(s\) with null ids"),
    ([(1, [1, 2], [1.0]), (2, [1], [1.0])], ArrayLengthError,
     r"1 row\(s\) of sparse column 'tags' hold a different number of ids than of weights in 'tag_w'"),
    ([(1, [1, None], [1.0, 1.0]), (2, [1], [1.0])], NullValuesError, r"sparse column 'tags' has 1 row\(s\) with null"),
])
def test_bad_values_named(spark: SparkSession, rows: list, error: type, pattern: str) -> None:
    df = spark.createDataFrame([(*r, 0.5, 1) for r in rows], "user bigint, tags array<int>, tag_w array<float>, "
                                                             "f1 double, label int")
    data = _data(feature_cols=("f1",), weight_col=None, sparse_cols=[DECLARED[0], DECLARED[3]])
    with pytest.raises(error, match=pattern):
        prepare_sparse(df, data, classification=True, num_workers=1)


@pytest.mark.parametrize("change, error, pattern", [
    ({"feature_cols": ("f1", "nope")}, MissingColumnError, r"column 'nope' is not in the DataFrame"),
    ({"feature_cols": ("city",)}, ColumnTypeError, r"feature column 'city' has type string"),
    ({"sparse_cols": [SparseInput("f1", num_rows=3)]}, ColumnTypeError, r"sparse column 'f1' .* has type double"),
    ({"sparse_cols": [SparseInput("gone", num_rows=3)]}, MissingColumnError, r"sparse column 'gone'"),
    ({"label_col": "city"}, ColumnTypeError, r"label column 'city' has type string"),
])
def test_schema_errors_before_any_job(spark: SparkSession, clicks: DataFrame, change: dict, error: type,
                                      pattern: str) -> None:
    with _jobs(spark, f"sparse-feed-schema-{pattern[:12]}") as jobs, pytest.raises(error, match=pattern):
        prepare_sparse(clicks, _data(**change), classification=True, num_workers=2)
    assert jobs == []


def test_validation_rows(spark: SparkSession, clicks: DataFrame) -> None:
    held = prepare_sparse(clicks, _data(validation_fraction=0.5), classification=True, num_workers=2, seed=3)
    assert held.layout.split_column == SPLIT_COLUMN and SPLIT_COLUMN in held.df.columns
    assert (held.num_rows, held.num_validation_rows) == (3, 3)
    extra = clicks.limit(2).withColumn("label", F.lit(4))
    both = prepare_sparse(clicks, _data(), classification=True, num_workers=2, validation_df=extra)
    assert (both.num_rows, both.num_validation_rows, both.layout.num_classes) == (6, 2, 5)
    assert sorted(r[SPLIT_COLUMN] for r in both.df.select(SPLIT_COLUMN).collect()) == [0] * 6 + [1] * 2
    strings = clicks.withColumn("tags", F.col("tags").cast("array<string>"))
    with pytest.raises(ColumnTypeError, match=r"sparse column 'tags' of validation_df holds arrays of string ids"):
        prepare_sparse(clicks, _data(), classification=True, num_workers=2, validation_df=strings)


def test_scoring_builds_the_training_columns(spark: SparkSession, clicks: DataFrame) -> None:
    layout = prepare_sparse(clicks, _data(), classification=True, num_workers=2).layout.for_scoring()
    columns = scoring_columns(clicks, layout)
    assert list(columns) == [c.column for c in layout.inputs]
    scored = clicks.withColumns(columns).select("w", *columns).collect()
    assert sorted((tuple(r) for r in scored), key=lambda r: r[0]) == \
        [(r[-1], *_expected(r)[:-2]) for r in ROWS]
    with pytest.raises(MissingColumnError, match=r"sparse column 'city'"):
        scoring_columns(clicks.drop("city"), layout)
    with pytest.raises(ColumnTypeError, match=r"sparse column 'city' holds one integer id per row, but the model was "
                                              r"trained on one string id per row"):
        scoring_columns(clicks.withColumn("city", F.lit(3)), layout)


def test_predict_takes_a_sparse_layout(spark: SparkSession, clicks: DataFrame) -> None:
    import torch

    from sparkdl.api import predict

    layout = prepare_sparse(clicks, _data(), classification=True, num_workers=2).layout.for_scoring()
    scored = predict(clicks, torch.nn.Linear(3, 2), layout, "class")  # lazy: nothing scored here
    assert scored.columns == [*clicks.columns, "prediction"]
    with pytest.raises(ColumnTypeError, match=r"sparse column 'user' holds one string id per row, but the model"):
        predict(clicks.withColumn("user", F.lit("u1")), torch.nn.Linear(3, 2), layout, "class")
    with pytest.raises(MissingColumnError, match=r"column 'tag_w' is not in the DataFrame"):
        predict(clicks.drop("tag_w"), torch.nn.Linear(3, 2), layout, "class")


def test_on_invalid_skip_drops_rows_with_nonfinite_dense_features(spark: SparkSession) -> None:
    df = spark.createDataFrame([(1.0, 3, 0), (float("nan"), 4, 1), (2.0, 5, 1)], "f1 double, user bigint, label int")
    data = DataConfig(feature_cols=("f1",), label_col="label", on_invalid="skip", sparse_cols=[DECLARED[0]])
    prepared = prepare_sparse(df, data, classification=True, num_workers=1)
    assert (prepared.num_rows, prepared.dropped_rows) == (2, 1)
    assert sorted(r["__sparkdl_sparse_0"] for r in prepared.df.collect()) == [3, 5]
    with pytest.raises(NullValuesError, match=r"feature column 'f1' has 1 row\(s\) with NaN"):
        prepare_sparse(df, replace(data, on_invalid="error"), classification=True, num_workers=1)
