"""Driver side of tensor columns (`input_cols`): check each input, label and weight column, decide
the tensor each becomes, select and cast them. One aggregation job gathers every statistic the
checks need; every problem raises a SparkdlError naming the column, before any barrier job.

The sharding and validation split are feed.py's (shared with feature_cols runs).
"""
from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pyspark.ml.functions import vector_to_array
from pyspark.ml.linalg import VectorUDT
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from sparkdl.config.values import input_columns, label_shape
from sparkdl.data.feed import (PreparedData, check_columns, check_weight, feature_invalid, quoted, split_and_shard,
                               weight_aggregates)
from sparkdl.data.layout import (BINARY, FIXED, INPUT_PREFIX, LABEL_COLUMN, RAGGED, TEXT, WEIGHT_COLUMN,
                                 FeedLayout, TensorColumn)
from sparkdl.errors import ArrayLengthError, ColumnTypeError, EmptyDataError, NullValuesError

if TYPE_CHECKING:
    from sparkdl.config import DataConfig

_log = logging.getLogger("sparkdl")
IGNORE_INDEX = -100  # cross_entropy's ignore_index: label positions that count for nothing
SAMPLE_ROWS = 4  # rows the driver converts (and transform_fn decodes) to probe the model
_INTEGER_STORAGE = {T.ByteType: "int8", T.ShortType: "int16", T.IntegerType: "int32", T.LongType: "int64"}
_NEEDS_TRANSFORM_HINT = ("pass transform_fn=..., a picklable function batch -> dict run on the executors, which "
                         "turns these values into fixed-shape arrays under the same name")


def _element(dtype: T.DataType) -> T.DataType:
    return dtype.elementType if isinstance(dtype, T.ArrayType) else dtype


def _storage(dtype: T.DataType) -> str:
    """What a numeric/bool element is delivered and spooled as: integers keep their width (token ids
    stay exact and small), every float and decimal becomes float32, booleans bool."""
    for spark_type, name in _INTEGER_STORAGE.items():
        if isinstance(dtype, spark_type):
            return name
    return "bool" if isinstance(dtype, T.BooleanType) else "float32"


def column_kind(df: DataFrame, name: str, transformed: bool, what: str = "input") -> tuple[str, str]:
    """(kind, storage) of one column; a type no tensor can come from raises naming the column."""
    dtype = df.schema[name].dataType
    element = _element(dtype)
    if isinstance(dtype, VectorUDT):
        return FIXED, "float32"
    if isinstance(element, (T.NumericType, T.BooleanType)):
        return FIXED, _storage(element)
    if isinstance(dtype, (T.BinaryType, T.StringType)) and what == "input":
        if not transformed:
            raise ColumnTypeError(f"input column {name!r} holds {dtype.simpleString()} values, which need decoding "
                                  "into a tensor", hint=_NEEDS_TRANSFORM_HINT)
        return (BINARY if isinstance(dtype, T.BinaryType) else TEXT), ""
    raise ColumnTypeError(f"{what} column {name!r} has type {dtype.simpleString()}, which no tensor can hold",
                          hint="use numeric or boolean scalars, arrays of them or Spark ML vectors"
                               + ("; binary/string columns with transform_fn" if what == "input" else ""))


def _default_dtype(storage: str) -> str:
    if storage.startswith("int"):
        return "int64"
    return "bool" if storage == "bool" else "float32"


def _array_of(df: DataFrame, name: str) -> Column:
    dtype = df.schema[name].dataType
    return vector_to_array(F.col(quoted(name))) if isinstance(dtype, VectorUDT) else F.col(quoted(name))


def _is_array(df: DataFrame, name: str) -> bool:
    return isinstance(df.schema[name].dataType, (T.ArrayType, VectorUDT))


def _is_float(df: DataFrame, name: str) -> bool:
    return isinstance(_element(df.schema[name].dataType), (T.FloatType, T.DoubleType, T.DecimalType)) \
        or isinstance(df.schema[name].dataType, VectorUDT)


def _nonfinite(df: DataFrame, name: str) -> Column:
    """True for a row holding NaN or +-Inf (anywhere in an array); False for other types."""
    return feature_invalid(df, name) if _is_float(df, name) else F.lit(False)


def _label_bad(df: DataFrame, name: str, classification: bool) -> Column:
    """True for a row whose label no built-in loss can use: NaN/Inf, or (classes) not an index 0..C-1
    (IGNORE_INDEX allowed in arrays)."""
    bad = _nonfinite(df, name)
    if not classification:
        return bad

    def not_an_index(x: Column) -> Column:
        x = x.cast("double")
        return F.coalesce(((x < 0) & (x != IGNORE_INDEX)) | (x != F.floor(x)), F.lit(False))

    col = F.col(quoted(name))
    wrong = F.coalesce(F.exists(_array_of(df, name), not_an_index), F.lit(False)) if _is_array(df, name) else \
        F.coalesce((col.cast("double") < 0) | (col.cast("double") != F.floor(col.cast("double"))), F.lit(False))
    return bad | wrong


def _stats(df: DataFrame, inputs: list[str], label: str | None, weight: str | None,
           classification: bool) -> dict[str, Any]:
    aggs: list[Column] = [F.count(F.lit(1)).alias("rows")]
    invalid = F.lit(False)
    for i, name in enumerate(inputs):
        col = F.col(quoted(name))
        aggs.append(F.sum(col.isNull().cast("long")).alias(f"null_{i}"))
        if _is_array(df, name):
            arr = _array_of(df, name)
            aggs += [F.min(F.size(arr)).alias(f"min_{i}"), F.max(F.size(arr)).alias(f"max_{i}")]
            if isinstance(df.schema[name].dataType, T.ArrayType):
                aggs.append(F.sum(F.exists(arr, lambda x: x.isNull()).cast("long")).alias(f"inner_{i}"))
        aggs.append(F.sum(_nonfinite(df, name).cast("long")).alias(f"nonfinite_{i}"))
        invalid = invalid | _nonfinite(df, name)
    if label is not None:
        col = F.col(quoted(label))
        aggs += [F.sum(col.isNull().cast("long")).alias("null_label"),
                 F.sum(_nonfinite(df, label).cast("long")).alias("nonfinite_label"),
                 F.sum(_label_bad(df, label, classification).cast("long")).alias("invalid_label")]
        invalid = invalid | _label_bad(df, label, classification)
        if _is_array(df, label):
            arr = _array_of(df, label)
            aggs += [F.min(F.size(arr)).alias("min_label"), F.max(F.size(arr)).alias("max_label")]
            if isinstance(df.schema[label].dataType, T.ArrayType):
                aggs.append(F.sum(F.exists(arr, lambda x: x.isNull()).cast("long")).alias("inner_label"))
            if classification:
                kept = F.filter(arr, lambda x: x != IGNORE_INDEX)
                aggs += [F.min(F.array_min(kept)).cast("double").alias("label_min"),
                         F.max(F.array_max(kept)).cast("double").alias("label_max"),
                         F.sum(F.size(F.filter(arr, lambda x: x == IGNORE_INDEX))).alias("ignored_label")]
        elif classification:
            aggs += [F.min(col.cast("double")).alias("label_min"), F.max(col.cast("double")).alias("label_max")]
        if classification:
            aggs.append(F.max(F.when(~_label_bad(df, label, classification),
                                     F.array_max(F.filter(_array_of(df, label), lambda x: x != IGNORE_INDEX))
                                     if _is_array(df, label) else col).otherwise(None)).cast("double")
                        .alias("valid_label_max"))
    aggs += weight_aggregates(weight)
    aggs.append(F.sum(invalid.cast("long")).alias("invalid_rows"))
    return df.agg(*aggs).collect()[0].asDict()


def _resolved_shape(name: str, length: int, shape: tuple[int, ...] | None, what: str) -> tuple[int, ...]:
    """The per-row shape of a fixed-length array of `length` values (input_shapes, one -1 inferred)."""
    if shape is None:
        return (length,)
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if known == 0 or length % known:
            raise ArrayLengthError(f"{what}[{name!r}]={list(shape)} cannot hold the column's {length} values per row "
                                   f"({length} is not a multiple of {known})", hint="fix the shape or the column")
        return tuple(length // known if s == -1 else s for s in shape)
    if known != length:
        raise ArrayLengthError(f"{what}[{name!r}]={list(shape)} holds {known} values per row, but column {name!r} "
                               f"holds {length}", hint=f"use a shape whose product is {length}, e.g. [{length}]")
    return tuple(shape)


def _check_nulls(name: str, stats: dict[str, Any], key: str, rows: int, what: str) -> None:
    nulls = stats.get(f"null_{key}") or 0
    if nulls:
        raise NullValuesError(f"{what} column {name!r} has {nulls} null value(s) in {rows} rows",
                              hint=f"drop or fill them first, e.g. df.na.drop(subset=[{name!r}])")
    inner = stats.get(f"inner_{key}") or 0
    if inner:
        raise NullValuesError(f"array column {name!r} has {inner} row(s) holding null elements",
                              hint="fill the null elements, e.g. F.transform(col, lambda x: F.coalesce(x, F.lit(0)))")


def _input_column(df: DataFrame, data: "DataConfig", index: int, name: str, key: str | None,
                  stats: dict[str, Any]) -> TensorColumn:
    transformed = data.transform_fn is not None
    kind, storage = column_kind(df, name, transformed)
    _check_nulls(name, stats, str(index), stats["rows"], "input")
    nonfinite = stats.get(f"nonfinite_{index}") or 0
    if nonfinite and data.on_invalid == "error":
        raise NullValuesError(f"input column {name!r} has {nonfinite} row(s) with NaN or infinite values "
                              f"(of {stats['rows']})", hint="fix or drop them first, or pass on_invalid='skip' "
                                                            "to drop such rows (they are counted and logged)")
    dtype = (data.input_dtypes or {}).get(name)
    column = f"{INPUT_PREFIX}{index}"
    if kind != FIXED:
        return TensorColumn(name, column, kind, storage, dtype or "float32", (), key)
    shape: tuple[int, ...] = ()
    if _is_array(df, name):
        low, high = stats[f"min_{index}"], stats[f"max_{index}"]
        if low != high:
            if not transformed:
                raise ArrayLengthError(f"input column {name!r} holds arrays of different lengths (from {low} to "
                                       f"{high})", hint="pad or cut the rows to one length, or " + _NEEDS_TRANSFORM_HINT)
            return TensorColumn(name, column, RAGGED, storage, dtype or _default_dtype(storage), (), key)
        if not high:
            raise ArrayLengthError(f"input column {name!r} holds empty arrays", hint="pass non-empty arrays")
        given = (data.input_shapes or {}).get(name)
        shape = _resolved_shape(name, int(high), tuple(given) if given else None, "input_shapes")
    elif (data.input_shapes or {}).get(name) not in (None, [1], (1,)):
        raise ArrayLengthError(f"input_shapes[{name!r}]={list(data.input_shapes[name])} reshapes a scalar column "
                               f"(1 value per row)", hint="drop the shape, or pass an array column")
    return TensorColumn(name, column, FIXED, storage, dtype or _default_dtype(storage), shape, key)


def _label_column(df: DataFrame, data: "DataConfig", classification: bool, stats: dict[str, Any]) -> TensorColumn:
    name = data.label_col
    _, storage = column_kind(df, name, False, what="label")
    _check_nulls(name, stats, "label", stats["rows"], "label")
    if (stats.get("nonfinite_label") or 0) and data.on_invalid == "error":
        raise NullValuesError(f"label column {name!r} has {stats['nonfinite_label']} row(s) with NaN or infinite "
                              "values", hint="drop them first, or pass on_invalid='skip' to drop such rows")
    if classification and (stats.get("invalid_label") or 0) and data.on_invalid == "error":
        raise ColumnTypeError(f"label column {name!r} must hold class indices 0..C-1 for a classification loss "
                              f"(found values from {stats.get('label_min')} to {stats.get('label_max')}"
                              + (f"; {IGNORE_INDEX} marks positions to ignore" if _is_array(df, name) else "") + ")",
                              hint="index the labels (StringIndexer) or use loss='mse' for regression")
    shape: tuple[int, ...] = ()
    if _is_array(df, name):
        low, high = stats["min_label"], stats["max_label"]
        if low != high or not high:
            raise ArrayLengthError(f"label column {name!r} holds arrays of different lengths (from {low} to {high})",
                                   hint="every row's label array must have the same length: pad with -100 "
                                        "(ignored by cross_entropy) or cut the rows")
        shape = _resolved_shape(name, int(high), label_shape(data), "label_shapes")
    elif label_shape(data) not in (None, (1,)):
        raise ArrayLengthError(f"label_shapes={list(label_shape(data))} reshapes the scalar label column {name!r}",
                               hint="drop label_shapes, or pass an array label column")
    if classification:
        storage = "int64" if not shape else (storage if storage.startswith("int") else "int32")
        return TensorColumn(name, LABEL_COLUMN, FIXED, storage, "int64", shape)
    return TensorColumn(name, LABEL_COLUMN, FIXED, "float32", "float32", shape)


_SPARK_TYPES = {"int8": T.ByteType(), "int16": T.ShortType(), "int32": T.IntegerType(), "int64": T.LongType(),
                "float32": T.FloatType(), "bool": T.BooleanType()}


def selected_inputs(df: DataFrame, column: TensorColumn) -> Column:
    """An input column as training received it, for scoring (TorchModel.transform): same casts, no alias."""
    if column.source not in df.columns:
        check_columns(df, [column.source])
    return _selected(df, column)


def _selected(df: DataFrame, column: TensorColumn) -> Column:
    """The column as the workers receive it: elements cast to the storage type (Arrow then hands
    numpy one contiguous block per batch), vectors as float32 arrays."""
    name = column.source
    if column.kind in (BINARY, TEXT):
        return F.col(quoted(name)).alias(column.column)
    element = _SPARK_TYPES[column.storage]
    if isinstance(df.schema[name].dataType, VectorUDT):
        return vector_to_array(F.col(quoted(name)), "float32").alias(column.column)
    if _is_array(df, name):
        return F.col(quoted(name)).cast(T.ArrayType(element)).alias(column.column)
    return F.col(quoted(name)).cast(element).alias(column.column)


def _prepare_one(df: DataFrame, data: "DataConfig", classification: bool, what: str,
                 label_keyword: str | None = None) -> PreparedData:
    inputs = input_columns(data)
    keys = list(data.input_cols) if isinstance(data.input_cols, dict) else [None] * len(inputs)
    extra = [c for c in (data.label_col, data.weight_col) if c is not None]
    check_columns(df, inputs + extra)
    stats = _stats(df, inputs, data.label_col, data.weight_col, classification)
    if not stats["rows"]:
        raise EmptyDataError(f"{what} has no rows", hint="check the filters or the input path")
    columns = tuple(_input_column(df, data, i, name, key, stats) for i, (name, key) in enumerate(zip(inputs, keys)))
    label = _label_column(df, data, classification, stats) if data.label_col is not None else None
    if data.weight_col is not None:
        check_weight(df, data.weight_col, stats)
    dropped = int(stats["invalid_rows"] or 0) if data.on_invalid == "skip" else 0
    if dropped == stats["rows"]:
        raise EmptyDataError(f"every row of {what} is invalid ({dropped} rows with NaN/Inf inputs or unusable "
                             "labels): none left to train on", hint="check the data and the filters")
    if dropped:
        _log.warning("sparkdl: on_invalid='skip' dropped %d of %d rows of %s (NaN/Inf inputs or unusable labels)",
                     dropped, stats["rows"], what)
        bad = F.lit(False)
        for name in inputs:
            bad = bad | _nonfinite(df, name)
        if data.label_col is not None:
            bad = bad | _label_bad(df, data.label_col, classification)
        df = df.filter(~bad)
    selected = [_selected(df, c) for c in columns]
    if label is not None:
        selected.append(_selected(df, label))
    if data.weight_col is not None:
        selected.append(F.col(quoted(data.weight_col)).cast("float").alias(WEIGHT_COLUMN))
    high = stats.get("valid_label_max") if data.on_invalid == "skip" else stats.get("label_max")
    num_classes = int(high) + 1 if classification and label is not None and high is not None else None
    layout = FeedLayout(num_features=0, label_dtype=None if label is None else label.dtype,
                        source_label_col=data.label_col, num_classes=num_classes, inputs=columns,
                        keyword_inputs=isinstance(data.input_cols, dict), label=label,
                        weight_column=WEIGHT_COLUMN if data.weight_col else None, source_weight_col=data.weight_col,
                        transformed=data.transform_fn is not None,
                        label_ignores=bool(stats.get("ignored_label")),
                        label_keyword=label_keyword)
    return PreparedData(df=df.select(*selected), layout=layout, num_rows=int(stats["rows"]) - dropped,
                        dropped_rows=dropped)


def prepare_tensors(df: DataFrame, data: "DataConfig", *, classification: bool, num_workers: int,
                    validation_df: DataFrame | None = None, seed: int = 0, fixed_order: bool = False,
                    label_keyword: str | None = None) -> PreparedData:
    """input_cols runs: checked, selected and sharded like feed.prepare, plus a few converted rows
    (`sample`, an Arrow table of the prepared columns) to probe the model with. `label_keyword`: the
    forward keyword the labels also go to (loss="model")."""
    prepared = _prepare_one(df, data, classification, "the DataFrame", label_keyword)
    validation = None
    if validation_df is not None:
        validation = _like_training(_prepare_one(validation_df, data, classification, "validation_df", label_keyword),
                                    prepared.layout)
        # validation's layout (cast like training's), with training's classes: the two are merged next
        prepared = replace(prepared, layout=replace(validation.layout, num_classes=prepared.layout.num_classes))
    return sampled_and_sharded(prepared, validation, data, num_workers=num_workers, seed=seed,
                               fixed_order=fixed_order)


def sampled_and_sharded(prepared: PreparedData, validation: PreparedData | None, data: "DataConfig", *,
                        num_workers: int, seed: int, fixed_order: bool) -> PreparedData:
    """The end of a tensor-column prepare (input_cols, sparse_cols): the classes either side saw, a
    few prepared rows to probe the model with, then feed.split_and_shard."""
    if validation is not None:
        classes = [n for n in (prepared.layout.num_classes, validation.layout.num_classes) if n is not None]
        prepared = replace(prepared, layout=replace(prepared.layout, num_classes=max(classes) if classes else None))
    sample = sample_rows(prepared.df)
    sharded = split_and_shard(prepared, validation, num_workers=num_workers,
                              validation_fraction=data.validation_fraction, seed=seed, fixed_order=fixed_order)
    return replace(sharded, sample=sample)


def _describe(column: TensorColumn) -> str:
    return f"{column.kind} {column.storage or 'bytes'} {list(column.shape)}".replace(" []", "")


def _like_training(validation: PreparedData, training: FeedLayout) -> PreparedData:
    """validation_df's columns as the training rows are spooled (its own checks already ran): the
    same element types (cast), shapes that must match, and variable-length rows wherever training
    has them (a transform_fn sees both alike)."""
    pairs = list(zip(training.inputs, validation.layout.inputs))
    if training.label is not None and validation.layout.label is not None:
        pairs.append((training.label, validation.layout.label))
    casts = {}
    for mine, theirs in pairs:
        fits = (mine.kind == theirs.kind and (mine.kind != FIXED or mine.shape == theirs.shape)) \
            or (mine.kind == RAGGED and theirs.kind == FIXED)
        if not fits:
            raise ArrayLengthError(f"column {mine.source!r} of validation_df holds {_describe(theirs)} per row, the "
                                   f"training DataFrame {_describe(mine)}", hint="build both from the same columns")
        if mine.kind in (FIXED, RAGGED) and theirs.storage != mine.storage:
            element = _SPARK_TYPES[mine.storage]
            cast = T.ArrayType(element) if mine.shape or mine.kind == RAGGED else element
            casts[mine.column] = F.col(mine.column).cast(cast)
    df = validation.df.withColumns(casts) if casts else validation.df
    return replace(validation, df=df, layout=replace(training, label_ignores=training.label_ignores
                                                     or validation.layout.label_ignores))


def sample_rows(selected: DataFrame) -> Any:
    """The first few prepared rows as an Arrow table (one small job)."""
    import pyarrow as pa

    limited = selected.limit(SAMPLE_ROWS)
    if hasattr(limited, "toArrow"):  # PySpark >= 4.0
        return limited.toArrow()
    return pa.Table.from_batches(limited._collect_as_arrow())  # noqa: SLF001 - PySpark 3.5's only Arrow collect
