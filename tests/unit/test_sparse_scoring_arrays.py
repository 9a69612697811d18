"""Scoring a sparse_cols model from pandas or a dict (MLflow pyfunc, serving): arrays_from_columns
maps raw ids to table rows by sparse_hash's rule, in the layout's input order, without Spark."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from sparkdl.data.layout import (DENSE_SOURCE, FIXED, INPUT_PREFIX, RAGGED, FeedLayout, SparseFeature,
                                 TensorColumn)
from sparkdl.data.sparse_hash import SparseIdError, integer_rows, string_rows, table_rows
from sparkdl.errors import ArrayLengthError, ColumnTypeError, MissingColumnError, NullValuesError
from sparkdl.tracking.serving import arrays_from_columns


def _layout(dense: bool = True, user_out_of_range: str = "hash") -> FeedLayout:
    """The layout sparse_feed builds for: dense a, b; user (int, one per row, table users of 10
    rows); city (string, table cities of 7); tags (int arrays weighted by tag_w, table tags of 5)."""
    inputs = [TensorColumn(DENSE_SOURCE, f"{INPUT_PREFIX}0", FIXED, "float32", "float32", (2,))] if dense else []
    inputs += [TensorColumn("user", "__sparkdl_sparse_0", FIXED, "int64", "int64", ()),
               TensorColumn("city", "__sparkdl_sparse_1", FIXED, "int64", "int64", ()),
               TensorColumn("tags", "__sparkdl_sparse_2", RAGGED, "int64", "int64", ()),
               TensorColumn("tag_w", "__sparkdl_sparse_w_2", RAGGED, "float32", "float32", ())]
    sparse = (SparseFeature("user", "users", 10, "integer", False, user_out_of_range),
              SparseFeature("city", "cities", 7, "string", False),
              SparseFeature("tags", "tags", 5, "integer", True, "hash", "tag_w"))
    return FeedLayout(num_features=2 if dense else 0, label_dtype=None, source_feature_cols=("a", "b") if dense else (),
                      inputs=tuple(inputs), sparse=sparse)


ROWS = {"a": [0.5, 1.5, -2.0], "b": [1.0, 2.0, 3.0],
        "user": [3, 9, 1234567],  # the last is outside [0, 10): hashed
        "city": ["paris", "", "日本"],
        "tags": [[0, 4, 99], [], [-7]],
        "tag_w": [[1.0, 0.5, 2.0], [], [0.25]]}


def _expected_tags() -> list[list[int]]:
    return [integer_rows(t, 5).tolist() if t else [] for t in ROWS["tags"]]


@pytest.mark.parametrize("frame", [False, True])
def test_sparse_arrays_follow_the_layout_and_the_hash_rule(frame: bool) -> None:
    columns = pd.DataFrame(ROWS) if frame else ROWS
    arrays = arrays_from_columns(_layout(), columns)
    assert len(arrays) == 5  # dense, user, city, tags, tag weights: layout.inputs order
    dense, user, city, tags, weights = arrays
    assert dense.dtype == np.float32 and dense.shape == (3, 2)
    np.testing.assert_array_equal(dense, np.array([[0.5, 1.0], [1.5, 2.0], [-2.0, 3.0]], np.float32))
    assert user.dtype == np.int64 and user.shape == (3,)
    assert user[:2].tolist() == [3, 9]
    assert user[2] == table_rows(np.array([1234567]), 10)[0] and 0 <= user[2] < 10
    assert city.dtype == np.int64
    assert city.tolist() == string_rows(ROWS["city"], 7).tolist()
    assert tags.type == pa.large_list(pa.int64())
    assert tags.to_pylist() == _expected_tags()
    assert tags.to_pylist()[0][:2] == [0, 4]  # in range: the ids themselves
    assert weights.type == pa.large_list(pa.float32())
    assert weights.to_pylist() == ROWS["tag_w"]  # aligned with the ids, position for position


def test_numpy_columns_and_no_dense_block() -> None:
    columns = {"user": np.array([1, 2, 3], np.int32), "city": np.array(["x", "y", "z"]),
               "tags": [np.array([1, 2]), np.array([3]), np.array([], np.int64)],
               "tag_w": [np.array([1.0, 1.0]), np.array([2.0]), np.array([])]}
    arrays = arrays_from_columns(_layout(dense=False), columns)
    assert len(arrays) == 4
    assert arrays[0].dtype == np.int64 and arrays[0].tolist() == [1, 2, 3]
    assert arrays[1].tolist() == string_rows(["x", "y", "z"], 7).tolist()
    assert arrays[2].to_pylist() == [[1, 2], [3], []]


def test_refuse_names_the_column() -> None:
    rows = dict(ROWS, user=[1, 2, 10])
    with pytest.raises(SparseIdError, match=r"sparse column 'user' \(table 'users'\): 1 id\(s\) outside .*\[0, 10\)"):
        arrays_from_columns(_layout(user_out_of_range="refuse"), rows)
    in_range = arrays_from_columns(_layout(user_out_of_range="refuse"), dict(ROWS, user=[1, 2, 9]))
    assert in_range[1].tolist() == [1, 2, 9]


@pytest.mark.parametrize("change, error, pattern", [
    ({"user": ["1", "2", "3"]}, ColumnTypeError, r"sparse column 'user' holds <U1 values.*integer ids"),
    ({"city": [1, 2, 3]}, ColumnTypeError, r"sparse column 'city' holds int64 values.*string ids"),
    ({"user": [1.0, None, 3.0]}, NullValuesError, r"sparse column 'user' holds null ids"),
    ({"tags": [[1], None, [2]]}, NullValuesError, r"sparse column 'tags' holds null ids"),
    ({"tag_w": [[1.0, 0.5], [], [0.25]]}, ArrayLengthError, r"weights column 'tag_w' .* sparse column 'tags'"),
    ({"user": [[1, 2], [3, 4], [5, 6]]}, ColumnTypeError, r"sparse column 'user' holds lists.*one id per row"),
    ({"tags": [[1], float("nan"), [2]]}, NullValuesError, r"sparse column 'tags' holds null ids"),
    ({"user": pd.array([3, None, 1], dtype="Int64")}, NullValuesError, r"sparse column 'user' holds null ids"),
    ({"tag_w": [[1.0, 0.5], None, [0.25]]}, NullValuesError, r"weights column 'tag_w' .* holds a null"),
    ({"tag_w": [[1.0, float("nan")], [], [0.25]]}, NullValuesError, r"weights column 'tag_w' .* NaN"),
])
def test_bad_values_name_the_column(change: dict, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        arrays_from_columns(_layout(), dict(ROWS, **change))


@pytest.mark.parametrize("missing", ["city", "tag_w", "a"])
def test_missing_column_named(missing: str) -> None:
    rows = {k: v for k, v in ROWS.items() if k != missing}
    with pytest.raises(MissingColumnError, match=f"input column '{missing}' is missing"):
        arrays_from_columns(_layout(), rows)
