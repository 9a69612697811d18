"""What a JSON client sends reaches a served model (no Spark): the input example in JSON's types,
the signature MLflow infers from it widened where MLflow would refuse valid JSON, MLflow's own
parsing of JSON bodies against it, and the pyfunc narrowing what arrives to the trained dtypes."""
from __future__ import annotations

import decimal
import json

import numpy as np
import pandas as pd
import pytest

from sparkdl.data.layout import FIXED, FeedLayout, TensorColumn
from sparkdl.errors import ArrayLengthError, ColumnTypeError, MissingColumnError
from sparkdl.tracking.json_types import json_signature, json_typed
from sparkdl.tracking.serving import arrays_from_columns

mlflow_models = pytest.importorskip("mlflow.models")
pytestmark = pytest.mark.filterwarnings("ignore:Hint. Inferred schema contains integer:UserWarning")


def spark_like_frame() -> pd.DataFrame:
    """What toPandas gives for float/int/decimal/array/vector/string/binary/boolean columns."""
    from pyspark.ml.linalg import Vectors

    return pd.DataFrame({
        "f": np.array([0.5, 2.0], np.float32), "i": np.array([3, 4], np.int32),
        "d": [decimal.Decimal("1.25"), decimal.Decimal("2")], "ids": [np.array([1, 2], np.int32), np.array([], np.int32)],
        "w": [np.array([0.5, 2.0], np.float32), np.array([], np.float32)],
        "v": [Vectors.dense([1.0, 2.0]), Vectors.sparse(2, [1], [3.0])], "s": ["a", "b"], "b": [b"\x00\x01", b""],
        "t": [True, False]})


def test_the_example_and_signature_speak_json() -> None:
    example = json_typed(spark_like_frame())
    signature = json_signature(mlflow_models.infer_signature(example))
    types = {c.name: getattr(c.type, "name", None) or str(c.type) for c in signature.inputs.inputs}
    assert types == {"f": "double", "i": "long", "d": "double", "ids": "Array(long)", "w": "Array(Any)",
                     "v": "Array(Any)", "s": "string", "b": "binary", "t": "boolean"}
    assert example["v"].tolist() == [[1.0, 2.0], [0.0, 3.0]] and example["d"].tolist() == [1.25, 2.0]


@pytest.mark.parametrize("javascript", [False, True])
def test_mlflow_parses_json_bodies_against_the_signature(javascript: bool) -> None:
    """The serving example MLflow writes, and the same rows with whole floats written as integers
    (JavaScript, Go), both pass MLflow's parsing and schema checks."""
    from mlflow.models.utils import _enforce_schema
    from mlflow.utils.proto_json_utils import dataframe_from_parsed_json

    example = json_typed(spark_like_frame())
    schema = json_signature(mlflow_models.infer_signature(example)).inputs
    body = json.loads(mlflow_models.convert_input_example_to_serving_input(example))["dataframe_split"]
    if javascript:
        body["data"] = json.loads(json.dumps(body["data"]).replace(".0,", ",").replace(".0]", "]"))
        assert body["data"][1][0] == 2 and body["data"][0][4] == [0.5, 2]  # 2.0 went out as 2
        assert isinstance(body["data"][1][0], int)
    frame = _enforce_schema(dataframe_from_parsed_json(body, "split", schema), schema)
    assert frame["b"].tolist() == [b"\x00\x01", b""] and list(frame["w"][0]) == [0.5, 2.0]


def fixed(storage: str, shape: tuple[int, ...] = ()) -> FeedLayout:
    return FeedLayout(num_features=0, label_dtype=None,
                      inputs=(TensorColumn("c", "__sparkdl_in_0", FIXED, storage, "int64", shape),))


def test_json_numbers_narrow_to_the_trained_storage() -> None:
    (tokens,) = arrays_from_columns(fixed("int32", (3,)), {"c": [[1.0, 2.0, 3.0], [4, 5, 6]]})
    assert tokens.dtype == np.int32 and tokens.tolist() == [[1, 2, 3], [4, 5, 6]]
    (scalars,) = arrays_from_columns(fixed("float32"), pd.DataFrame({"c": [1, 2]}))
    assert scalars.dtype == np.float32 and scalars.tolist() == [1.0, 2.0]


@pytest.mark.parametrize("values, error, message", [
    ([[1.5, 2.0, 3.0]], ColumnTypeError, "holds fractions"),
    ([[1, 2]], ArrayLengthError, "holds 2 values per row, but the model was trained on 3"),
    ([[1, 2, 3], [1, 2]], ArrayLengthError, "arrays of different lengths"),
    ([[1, 2, 2**40]], ColumnTypeError, "outside int32's range"),
    ([["a", "b", "c"]], ColumnTypeError, "holds <U1 values"),
])
def test_what_cannot_become_the_trained_dtype_is_refused_naming_the_column(values: list, error: type,
                                                                           message: str) -> None:
    with pytest.raises(error, match=message) as raised:
        arrays_from_columns(fixed("int32", (3,)), {"c": values})
    assert "'c'" in str(raised.value)


def test_feature_columns_come_by_name_in_the_fits_order() -> None:
    layout = FeedLayout(num_features=4, label_dtype=None, source_feature_cols=("a", "v", "t"))
    (block,) = arrays_from_columns(layout, pd.DataFrame({"t": [True], "v": [[2, 3]], "a": [1]}))
    assert block.dtype == np.float32 and block.tolist() == [[1.0, 2.0, 3.0, 1.0]]
    with pytest.raises(MissingColumnError, match="'t' is missing"):
        arrays_from_columns(layout, {"a": [1], "v": [[2, 3]]})
    with pytest.raises(ColumnTypeError, match="input column 'v' holds list values, which are not numbers"):
        arrays_from_columns(layout, {"a": [1], "v": [[2, "x"]], "t": [True]})
