"""Column kinds and the SQL text of the driver's checks: which feature columns are scalars, arrays or
vectors, the one features expression, and what makes a row invalid. Split from feed.py, which
runs the stats job and prepares the DataFrame with these."""
from __future__ import annotations

from typing import Sequence

from pyspark.ml.functions import vector_to_array
from pyspark.ml.linalg import VectorUDT
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from sparkdl.errors import ColumnTypeError


def feature_kind(df: DataFrame, name: str) -> str:
    """"scalar", "array" or "vector"; anything else raises naming the column and its type."""
    dtype = df.schema[name].dataType
    if isinstance(dtype, T.NumericType) or isinstance(dtype, T.BooleanType):
        return "scalar"
    if isinstance(dtype, T.ArrayType) and isinstance(dtype.elementType, T.NumericType):
        return "array"
    if isinstance(dtype, VectorUDT):
        return "vector"
    raise ColumnTypeError(
        f"feature column {name!r} has type {dtype.simpleString()}, which is not numeric",
        hint="use numeric scalar columns, one array<numeric> column or a Spark ML vector; "
             "encode strings first (e.g. StringIndexer, OneHotEncoder)")


def label_type(df: DataFrame, name: str) -> T.DataType:
    dtype = df.schema[name].dataType
    if not isinstance(dtype, (T.NumericType, T.BooleanType)):
        raise ColumnTypeError(
            f"label column {name!r} has type {dtype.simpleString()}, which is not numeric",
            hint="index string labels first, e.g. pyspark.ml.feature.StringIndexer")
    return dtype


def features_expression(df: DataFrame, feature_cols: Sequence[str]) -> Column:
    """One array<float> column from any mix of scalar, array and vector columns, in the given order."""
    parts: list[Column] = []
    scalars: list[str] = []  # a run of scalar columns becomes one array, not one array each
    for name in feature_cols:
        kind = feature_kind(df, name)
        if kind == "scalar":
            scalars.append(f"cast({quoted(name)} as float)")  # SQL text: one py4j call for the run
            continue
        if scalars:
            parts.append(F.expr(f"array({', '.join(scalars)})"))
            scalars = []
        if kind == "array":
            parts.append(F.col(quoted(name)).cast(T.ArrayType(T.FloatType())))
        else:
            parts.append(vector_to_array(F.col(quoted(name)), "float32"))
    if scalars:
        # concat of 64 one-element arrays made Spark copy each row's array 64 times: 1M rows x 64
        # float columns reached the Python workers in 2.0 s that way, 1.3 s as one array.
        parts.append(F.expr(f"array({', '.join(scalars)})"))
    return parts[0] if len(parts) == 1 else F.concat(*parts)


def quoted(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def _nonfinite_sql(expr: str) -> str:
    return f"(isnan(cast({expr} as double)) OR abs(cast({expr} as double)) = double('Infinity'))"


def feature_invalid_sql(df: DataFrame, name: str) -> str | None:
    """feature_invalid as SQL text (one py4j call to parse, where Column operators cost ~10 calls
    per column: 1.6 s of driver time for 64 columns); None for vectors, which need Column API."""
    kind = feature_kind(df, name)
    if kind == "scalar":
        return f"coalesce({_nonfinite_sql(quoted(name))}, false)"
    if kind == "array":
        return f"coalesce(exists({quoted(name)}, x -> coalesce({_nonfinite_sql('x')}, false)), false)"
    return None


def feature_invalid(df: DataFrame, name: str) -> Column:
    """True for a row whose feature column holds NaN or +-Inf (anywhere in an array or vector)."""
    text = feature_invalid_sql(df, name)
    if text is not None:
        return F.expr(text)
    arr = vector_to_array(F.col(quoted(name)))  # a Scala UDF with no SQL name

    def nonfinite(x: Column) -> Column:
        return F.coalesce(F.isnan(x.cast("double")) | (F.abs(x.cast("double")) == float("inf")), F.lit(False))

    return F.coalesce(F.exists(arr, nonfinite), F.lit(False))


def label_invalid_sql(label_col: str, classification: bool) -> str:
    """True for a row whose label no built-in loss can use: NaN/Inf, or not a class index 0..C-1."""
    label = f"cast({quoted(label_col)} as double)"
    bad = _nonfinite_sql(label)
    if classification:
        bad = f"({bad} OR {label} < 0 OR {label} != floor({label}))"
    return f"coalesce({bad}, false)"


def label_invalid(label_col: str, classification: bool) -> Column:
    return F.expr(label_invalid_sql(label_col, classification))


def row_invalid(df: DataFrame, feature_cols: Sequence[str], label_col: str | None, classification: bool) -> Column:
    """True for a row on_invalid="skip" drops: NaN/Inf in a feature, or a label no loss can use."""
    texts = [feature_invalid_sql(df, name) for name in feature_cols]
    if label_col is not None:
        texts.append(label_invalid_sql(label_col, classification))
    bad = F.expr(" OR ".join(t for t in texts if t is not None) or "false")
    for name, text in zip(feature_cols, texts):
        if text is None:  # vectors only
            bad = bad | feature_invalid(df, name)
    return bad
