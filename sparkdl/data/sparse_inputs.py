"""Driver side of categorical inputs (data.sparse_cols): the schema checks, the one aggregate query
of their values, and the Spark expressions that turn ids into table rows.

Everything is Spark SQL text (no Python UDF, one py4j call per column): integer ids in
[0, num_rows) stay as they are; strings, and integer ids outside the range under
out_of_range="hash", become `pmod(xxhash64(v), num_rows)` with every integer widened to bigint
first (data/sparse_hash.py states the rule and computes the same rows without Spark). Multi-hot
arrays are mapped element by element with `transform`, so their weights stay aligned position for
position. Under out_of_range="refuse" the values query counts the ids outside the range before any
job; the row expression then guards with `raise_error`, for rows that change between the two.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from sparkdl.config.sparse import SparseInput, SparseInputs
from sparkdl.data.feed_sql import quoted
from sparkdl.data.sparse_hash import SparseIdError
from sparkdl.errors import ArrayLengthError, ColumnTypeError, MissingColumnError, NullValuesError

SPARSE_PREFIX = "__sparkdl_sparse_"  # prepared ids: f"{SPARSE_PREFIX}{i}"; their weights: f"{SPARSE_PREFIX}w_{i}"
_VAR = "sparkdl_id"  # the lambda variable of element-wise expressions (shadows any column of that name)


@dataclass(frozen=True)
class SparseColumn:
    """What the schema says of one declared input: ids of `kind` ("integer" or "string"), one per
    row or an array of them (`multi_hot`), with or without weights."""

    input: SparseInput
    kind: str
    multi_hot: bool

    @property
    def weighted(self) -> bool:
        return self.input.weights_col is not None


def prepared_names(index: int) -> tuple[str, str]:
    """The prepared DataFrame's names of input `index`'s rows and weights."""
    return f"{SPARSE_PREFIX}{index}", f"{SPARSE_PREFIX}w_{index}"


# --- schema (no job) ------------------------------------------------------------------------

def _id_kind(dtype: T.DataType) -> str | None:
    if isinstance(dtype, T.IntegralType):
        return "integer"
    if isinstance(dtype, T.StringType):
        return "string"
    return None


def _type_error(name: str, dtype: T.DataType) -> ColumnTypeError:
    shown = dtype.simpleString()
    if isinstance(dtype, T.ArrayType) and isinstance(dtype.elementType, T.ArrayType):
        hint = f"flatten it first, e.g. F.flatten({name!r}), so each row holds one list of ids"
    elif isinstance(dtype, (T.FractionalType, T.BooleanType)):
        hint = (f"cast whole-number ids to long, e.g. df.withColumn({name!r}, F.col({name!r}).cast('long')); "
                "a numeric measurement belongs in feature_cols, not sparse_cols")
    else:
        hint = f"cast it to long or string ids, e.g. F.col({name!r}).cast('string'), or drop it from sparse_cols"
    return ColumnTypeError(f"sparse column {name!r} (data.sparse_cols) has type {shown}; ids must be integers, "
                           "strings, or arrays of them (multi-hot)", hint=hint)


def _check_present(df: DataFrame, name: str, what: str) -> None:
    if name not in df.columns:
        raise MissingColumnError(f"{what} {name!r} (data.sparse_cols) is not in the DataFrame; available columns: "
                                 f"{', '.join(df.columns)}", hint="fix data.sparse_cols, or add the column before fitting")


def sparse_schema(df: DataFrame, inputs: SparseInputs) -> tuple[SparseColumn, ...]:
    """Every declared input checked against the schema, before any job: the columns exist, ids are
    integers, strings or arrays of them, weights an array of numbers beside an array of ids."""
    out = []
    for item in inputs.inputs:
        _check_present(df, item.column, "sparse column")
        dtype = df.schema[item.column].dataType
        multi_hot = isinstance(dtype, T.ArrayType)
        kind = _id_kind(dtype.elementType if multi_hot else dtype)
        if kind is None:
            raise _type_error(item.column, dtype)
        if item.weights_col is not None:
            _check_weights_type(df, item, item.weights_col, multi_hot)
        out.append(SparseColumn(input=item, kind=kind, multi_hot=multi_hot))
    return tuple(out)


def _check_weights_type(df: DataFrame, item: SparseInput, name: str, multi_hot: bool) -> None:
    _check_present(df, name, "weights column")
    if not multi_hot:
        raise ColumnTypeError(f"sparse column {item.column!r} holds one id per row, but weights_col {name!r} "
                              "weighs the ids of a multi-hot (array) column",
                              hint="drop weights_col (a per-row weight is data.weight_col), or make the ids an array")
    dtype = df.schema[name].dataType
    if not (isinstance(dtype, T.ArrayType) and isinstance(dtype.elementType, T.NumericType)):
        raise ColumnTypeError(f"weights column {name!r} of sparse column {item.column!r} has type "
                              f"{dtype.simpleString()}, not an array of numbers",
                              hint=f"give one number per id of {item.column!r}, e.g. array<float>")


# --- the ids' rows as Spark expressions -----------------------------------------------------

def _sql_string(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _in_range(value: str, num_rows: int) -> str:
    return f"({value} >= 0 AND {value} < {num_rows}L)"


def element_row_sql(value: str, kind: str, item: SparseInput) -> str:
    """SQL of the table row of one id `value` (an SQL expression of kind "integer" or "string");
    NULL stays NULL (the values query refuses nulls before training)."""
    rows = item.num_rows
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
        raise ValueError(f"sparse column {item.column!r}: num_rows must be a positive integer, got {rows!r}")
    if kind == "string":
        return f"CASE WHEN {value} IS NULL THEN NULL ELSE pmod(xxhash64({value}), {rows}L) END"
    wide = f"CAST({value} AS BIGINT)"
    if item.out_of_range == "refuse":
        message = f"sparkdl: sparse column {item.column!r} holds an id outside [0, {rows}) (out_of_range='refuse'): "
        outside = f"raise_error(concat({_sql_string(message)}, CAST({value} AS STRING)))"
    else:
        outside = f"pmod(xxhash64({wide}), {rows}L)"
    return f"CASE WHEN {value} IS NULL THEN NULL WHEN {_in_range(value, rows)} THEN {wide} ELSE {outside} END"


def rows_sql(column: SparseColumn) -> str:
    """SQL of a column's table rows: bigint, or array<bigint> element-wise for multi-hot."""
    name = quoted(column.input.column)
    if not column.multi_hot:
        return f"CAST({element_row_sql(name, column.kind, column.input)} AS BIGINT)"
    return f"transform({name}, {_VAR} -> CAST({element_row_sql(_VAR, column.kind, column.input)} AS BIGINT))"


def weights_sql(column: SparseColumn) -> str:
    """SQL of a weighted input's weights as the workers receive them: array<float>."""
    return f"CAST({quoted(column.input.weights_col or '')} AS ARRAY<FLOAT>)"


def sparse_columns(columns: tuple[SparseColumn, ...]) -> list[Column]:
    """The prepared columns, in declaration order: each input's rows (bigint or array<bigint>) and,
    where weighted, its weights as array<float> (positions unchanged: weight j goes with id j)."""
    out = []
    for index, column in enumerate(columns):
        ids, weights = prepared_names(index)
        out.append(F.expr(f"{rows_sql(column)} AS {quoted(ids)}"))
        if column.weighted:
            out.append(F.expr(f"{weights_sql(column)} AS {quoted(weights)}"))
    return out


# --- the values query (one job) -------------------------------------------------------------

def _nonfinite(value: str) -> str:
    return f"(isnan(CAST({value} AS DOUBLE)) OR abs(CAST({value} AS DOUBLE)) = double('Infinity'))"


def sparse_aggregates(columns: tuple[SparseColumn, ...]) -> list[Column]:
    """The terms the checks need, for the driver's one statistics job (or sparse_stats alone):
    null ids, bad or misaligned weights, and under "refuse" the ids outside the range, counted
    per column with one example."""
    terms: list[str] = []
    for i, column in enumerate(columns):
        item, name = column.input, quoted(column.input.column)
        if column.multi_hot:
            terms.append(f"sum(CAST({name} IS NULL OR exists({name}, {_VAR} -> {_VAR} IS NULL) AS BIGINT))"
                         f" AS sparse_null_{i}")
        else:
            terms.append(f"sum(CAST({name} IS NULL AS BIGINT)) AS sparse_null_{i}")
        if column.weighted:
            weights = quoted(item.weights_col or "")
            terms.append(f"sum(CAST({weights} IS NULL OR exists({weights}, {_VAR} -> {_VAR} IS NULL OR "
                         f"{_nonfinite(_VAR)}) AS BIGINT)) AS sparse_bad_weights_{i}")
            terms.append(f"sum(CAST(size({name}) != size({weights}) AS BIGINT)) AS sparse_misaligned_{i}")
        if item.out_of_range == "refuse" and column.kind == "integer":
            terms += _outside_terms(i, name, column.multi_hot, item.num_rows or 0)
    return [F.expr(term) for term in terms]


def _outside_terms(i: int, name: str, multi_hot: bool, num_rows: int) -> list[str]:
    if multi_hot:
        outside = f"filter({name}, {_VAR} -> NOT {_in_range(_VAR, num_rows)})"
        return [f"sum(size({outside})) AS sparse_outside_{i}", f"min(array_min({outside})) AS sparse_example_{i}"]
    return [f"sum(CAST(NOT {_in_range(name, num_rows)} AS BIGINT)) AS sparse_outside_{i}",
            f"min(CASE WHEN NOT {_in_range(name, num_rows)} THEN {name} END) AS sparse_example_{i}"]


def check_sparse_stats(columns: tuple[SparseColumn, ...], stats: Mapping[str, Any]) -> None:
    """Raise for the first input the statistics find at fault, naming its column and the fix."""
    for i, column in enumerate(columns):
        item = column.input
        nulls = stats.get(f"sparse_null_{i}") or 0
        if nulls:
            what = "null arrays or null ids in them" if column.multi_hot else "null ids"
            raise NullValuesError(f"sparse column {item.column!r} has {nulls} row(s) with {what}",
                                  hint=_null_hint(item.column, column))
        bad = stats.get(f"sparse_bad_weights_{i}") or 0
        if bad:
            raise NullValuesError(f"weights column {item.weights_col!r} of sparse column {item.column!r} has {bad} "
                                  "row(s) that are null or hold null, NaN or infinite weights",
                                  hint="give every id a finite weight (1.0 = unweighted)")
        misaligned = stats.get(f"sparse_misaligned_{i}") or 0
        if misaligned:
            raise ArrayLengthError(f"{misaligned} row(s) of sparse column {item.column!r} hold a different number "
                                   f"of ids than of weights in {item.weights_col!r}",
                                   hint="weights_col needs one weight per id, in the same order")
        outside = stats.get(f"sparse_outside_{i}") or 0
        if outside:
            raise SparseIdError(f"sparse column {item.column!r} holds {outside} id(s) outside the range "
                                f"[0, {item.num_rows}) of its table {item.table!r}, "
                                f"e.g. {stats.get(f'sparse_example_{i}')}",
                                hint=f"raise num_rows of table {item.table!r}, filter those rows, or set "
                                     f"out_of_range='hash' to hash them onto the table's rows")


def _null_hint(name: str, column: SparseColumn) -> str:
    if column.multi_hot:
        return (f"replace null arrays by empty ones, e.g. F.coalesce(F.col({name!r}), F.array()), and drop null "
                f"elements, e.g. F.filter({name!r}, lambda x: x.isNotNull()) (and their weights)")
    fill = "'<missing>'" if column.kind == "string" else "a reserved id"
    return f"fill them with {fill}, e.g. df.na.fill({{{name!r}: ...}}), or drop those rows"


def sparse_stats(df: DataFrame, columns: tuple[SparseColumn, ...]) -> dict[str, Any]:
    """The values query on its own (one job)."""
    aggregates = sparse_aggregates(columns)
    return df.agg(*aggregates).collect()[0].asDict() if aggregates else {}


def checked_sparse_columns(df: DataFrame, inputs: SparseInputs) -> tuple[SparseColumn, ...]:
    """Schema checks, then the values query (one job), then the checks on its counts."""
    columns = sparse_schema(df, inputs)
    check_sparse_stats(columns, sparse_stats(df, columns))
    return columns
