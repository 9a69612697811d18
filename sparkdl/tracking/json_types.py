"""The types a JSON client sends, for a logged model's input example and signature: JSON has
numbers (int64 or float64 once parsed), strings, booleans and lists, and MLflow's scoring server
refuses a body it cannot convert "safely" to the signature (a float32 array column refuses float64,
int32 ids refuse int64, Array(double) refuses a row of whole numbers). The example is written in
JSON's types and the signature widened where MLflow would still refuse a valid body; the pyfunc
(serving.arrays_from_columns) narrows what arrives to the dtypes the model trained with."""
from __future__ import annotations

from typing import Any


def json_typed(frame: Any) -> Any:
    """`frame` with every column in a type JSON can carry and MLflow's schema checks accept from
    it: integers as int64 (long), floats and Decimals as float64 (double), arrays and Spark ML
    vectors as lists of Python numbers (Array(long) / Array(double)); strings, bytes and booleans
    as they are."""
    import pandas as pd

    return pd.DataFrame({name: _json_column(frame[name]) for name in frame.columns}, index=frame.index)


def _json_column(series: Any) -> Any:
    kind = series.dtype.kind
    if kind in "iu":
        return series.astype("int64")
    if kind == "f":
        return series.astype("float64")
    if kind == "O":
        return series.map(_json_value)
    return series


def _json_value(value: Any) -> Any:
    import decimal

    import numpy as np

    if hasattr(value, "toArray"):  # a pyspark.ml.linalg vector (dense or sparse): its dense values
        value = value.toArray()
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, (np.ndarray, list, tuple)):
        array = np.asarray(value)
        if array.dtype.kind in "iu":
            return array.astype(np.int64).tolist()
        if array.dtype.kind == "f":
            return array.astype(np.float64).tolist()
        return [_json_value(v) for v in value]
    if isinstance(value, np.generic):  # numpy scalars inside an object column
        return value.item()
    return value


def json_signature(signature: Any) -> Any:
    """`signature` (inferred from json_typed's example) with float-array columns as arrays of any
    value: MLflow's check reads a JSON row of whole numbers ([2, 3], as JavaScript and Go write
    2.0) as int64 and refuses it for Array(double); the pyfunc turns each row into float32 itself
    and refuses what is not a number naming the column (serving._floats). Tensor specs stay:
    MLflow casts their JSON to the spec's type."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import AnyType, Array, ColSpec, DataType, Schema

    inputs = signature.inputs
    if inputs is None or inputs.is_tensor_spec():
        return signature
    floats = (DataType.double, DataType.float)
    columns = [ColSpec(Array(AnyType()), c.name, c.required) if isinstance(c.type, Array) and c.type.dtype in floats
               else c for c in inputs.inputs]
    return ModelSignature(Schema(columns), signature.outputs, signature.params)
