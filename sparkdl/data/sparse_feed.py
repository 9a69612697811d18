"""Driver side of sparse_cols runs: categorical columns (ids looked up in embedding tables) beside
optional dense feature columns, checked with one aggregation job and mapped to table rows in Spark
SQL, and the same columns rebuilt for scoring a DataFrame.

The prepared rows: the dense features as one array<float> (feed.py's expression, only with
feature_cols), then per categorical input its table rows (bigint, or array<bigint> for multi-hot)
and, when weighted, its weights (array<float>), then the label and the per-row weight. The workers
read these as the input_cols path's FIXED and RAGGED columns (arrow_rows.spool_columns), so the
label is an input_cols-style TensorColumn too. Sharding and validation rows are feed.py's.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Sequence

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from sparkdl.config.sparse import SparseInput, SparseInputs, sparse_inputs
from sparkdl.data.feed import (PreparedData, check_columns, check_weight, checked_feature_width, checked_label,
                               feed_stats)
from sparkdl.data.feed_sql import feature_kind, features_expression, label_type, quoted, row_invalid
from sparkdl.data.layout import (DENSE_SOURCE, FIXED, INPUT_PREFIX, LABEL_COLUMN, RAGGED, WEIGHT_COLUMN,
                                 FeedLayout, SparseFeature, TensorColumn)
from sparkdl.data.sparse_inputs import (SparseColumn, check_sparse_stats, prepared_names, rows_sql,
                                        sparse_aggregates, sparse_columns, sparse_schema, weights_sql)
from sparkdl.data.tensor_feed import sampled_and_sharded
from sparkdl.errors import ArrayLengthError, ColumnTypeError, ConfigError, EmptyDataError

if TYPE_CHECKING:
    from sparkdl.config import DataConfig

_log = logging.getLogger("sparkdl")
DENSE_COLUMN = f"{INPUT_PREFIX}0"  # the prepared dense features of a sparse_cols run


def prepare_sparse(df: DataFrame, data: "DataConfig", *, classification: bool, num_workers: int,
                   validation_df: DataFrame | None = None, seed: int = 0, fixed_order: bool = False) -> PreparedData:
    """sparse_cols runs: checked (schema first, then one statistics job), selected and sharded like
    feed.prepare, plus a few prepared rows (`sample`, an Arrow table) to probe the model with.
    Packed delivery and direct Parquet reads do not apply: the rows are Spark's own."""
    inputs = sparse_inputs(data.sparse_cols)
    if inputs is None:
        raise ConfigError("prepare_sparse needs data.sparse_cols", hint="declare the categorical columns")
    prepared = _prepare_one(df, data, inputs, classification, "the DataFrame")
    validation = None
    if validation_df is not None:
        validation = _prepare_one(validation_df, data, inputs, classification, "validation_df")
        _check_like_training(validation.layout, prepared.layout)
    return sampled_and_sharded(prepared, validation, data, num_workers=num_workers, seed=seed,
                               fixed_order=fixed_order)


def _prepare_one(df: DataFrame, data: "DataConfig", inputs: SparseInputs, classification: bool,
                 what: str) -> PreparedData:
    feature_cols = tuple(data.feature_cols or ())
    label_col, weight_col = data.label_col, data.weight_col
    # Every schema problem before the one job: missing columns, then types.
    check_columns(df, [*feature_cols, *(c for c in (label_col, weight_col) if c is not None)])
    columns = sparse_schema(df, inputs)
    for name in feature_cols:
        feature_kind(df, name)
    if label_col is not None:
        label_type(df, label_col)
    stats = feed_stats(df, feature_cols, label_col, classification, weight_col, data.on_invalid,
                   extra=sparse_aggregates(columns))
    if not stats["rows"]:
        raise EmptyDataError(f"{what} has no rows", hint="check the filters or the input path")
    if weight_col is not None:
        check_weight(df, weight_col, stats)
    num_features = checked_feature_width(df, feature_cols, stats, what, data.on_invalid) if feature_cols else 0
    num_classes = checked_label(label_col, stats, classification, what, data.on_invalid) \
        if label_col is not None else None
    check_sparse_stats(columns, stats)
    dropped = _dropped(stats, data.on_invalid, what)
    if dropped:
        df = df.filter(~row_invalid(df, feature_cols, label_col, classification))
    label = None
    if label_col is not None:
        dtype = "int64" if classification else "float32"
        label = TensorColumn(label_col, LABEL_COLUMN, FIXED, dtype, dtype, ())
    layout = FeedLayout(num_features=num_features, label_dtype=label.dtype if label is not None else None,
                        source_feature_cols=feature_cols, source_label_col=label_col, num_classes=num_classes,
                        inputs=_input_columns(num_features, columns), label=label,
                        weight_column=WEIGHT_COLUMN if weight_col else None, source_weight_col=weight_col,
                        sparse=tuple(sparse_feature(c) for c in columns))
    selected = _selected(df, feature_cols, columns, label, weight_col)
    return PreparedData(df=df.select(*selected), layout=layout, num_rows=int(stats["rows"]) - dropped,
                        dropped_rows=dropped)


def _dropped(stats: dict, on_invalid: str, what: str) -> int:
    """Rows on_invalid="skip" drops (NaN/Inf dense features or unusable labels), logged; all of them raise."""
    dropped = int(stats.get("invalid_rows") or 0) if on_invalid == "skip" else 0
    if dropped and dropped == stats["rows"]:
        raise EmptyDataError(f"every row of {what} is invalid ({dropped} rows with NaN/Inf features or unusable "
                             "labels): none left to train on", hint="check the data and the filters")
    if dropped:
        _log.warning("sparkdl: on_invalid='skip' dropped %d of %d rows of %s (NaN/Inf features or unusable labels)",
                     dropped, stats["rows"], what)
    return dropped


def sparse_feature(column: SparseColumn) -> SparseFeature:
    """What the layout keeps of one checked categorical input (enough to map ids again for scoring)."""
    item = column.input
    return SparseFeature(source=item.column, table=item.table_name, num_rows=int(item.num_rows or 0),
                         id_kind=column.kind, multi_hot=column.multi_hot, out_of_range=item.out_of_range,
                         source_weights=item.weights_col, dim=item.dim)


def _input_columns(num_features: int, columns: Sequence[SparseColumn]) -> tuple[TensorColumn, ...]:
    """The layout's inputs in prepared order: dense features (if any), then per input ids[, weights]."""
    out = [TensorColumn(DENSE_SOURCE, DENSE_COLUMN, FIXED, "float32", "float32", (num_features,))] \
        if num_features else []
    for index, column in enumerate(columns):
        ids, weights = prepared_names(index)
        out.append(TensorColumn(column.input.column, ids, RAGGED if column.multi_hot else FIXED, "int64", "int64", ()))
        if column.weighted:
            out.append(TensorColumn(column.input.weights_col or "", weights, RAGGED, "float32", "float32", ()))
    return tuple(out)


def _selected(df: DataFrame, feature_cols: Sequence[str], columns: Sequence[SparseColumn],
              label: TensorColumn | None, weight_col: str | None) -> list[Column]:
    selected = [features_expression(df, feature_cols).alias(DENSE_COLUMN)] if feature_cols else []
    selected += sparse_columns(tuple(columns))
    if label is not None:
        cast = "long" if label.dtype == "int64" else "float"
        selected.append(F.col(quoted(label.source)).cast(cast).alias(LABEL_COLUMN))
    if weight_col is not None:
        selected.append(F.col(quoted(weight_col)).cast("float").alias(WEIGHT_COLUMN))
    return selected


def _check_like_training(validation: FeedLayout, training: FeedLayout) -> None:
    """validation_df's prepared columns must union with the training rows' and mean the same rows."""
    if validation.num_features != training.num_features:
        raise ArrayLengthError(f"validation_df has {validation.num_features} dense feature values per row, the "
                               f"training DataFrame {training.num_features}", hint="use the same feature columns")
    for mine, theirs in zip(training.sparse, validation.sparse):
        if mine != theirs:
            raise ColumnTypeError(f"sparse column {mine.source!r} of validation_df holds {_describe(theirs)}, the "
                                  f"training DataFrame {_describe(mine)}",
                                  hint="build both DataFrames' categorical columns alike (same types)")


def _describe(feature: SparseFeature) -> str:
    kind = feature.id_kind
    return f"arrays of {kind} ids" if feature.multi_hot else f"one {kind} id per row"


# --- scoring ----------------------------------------------------------------------------------

def scoring_columns(df: DataFrame, layout: FeedLayout) -> dict[str, Column]:
    """The prepared input columns of a sparse_cols layout, built from a DataFrame to score as
    training built them ({prepared name: column}, for withColumns): the dense features, each
    input's table rows by the same SQL mapping, its weights as array<float>. A missing categorical
    column, or one whose ids are not of the kind training saw, raises naming it (no job)."""
    declared = tuple(SparseInput(column=f.source, table=f.table, num_rows=f.num_rows, weights_col=f.source_weights,
                                 out_of_range=f.out_of_range) for f in layout.sparse)
    found = sparse_schema(df, SparseInputs(inputs=declared, tables=()))
    out: dict[str, Column] = {}
    for dense in layout.dense_inputs:
        check_columns(df, layout.source_feature_cols)
        out[dense.column] = features_expression(df, layout.source_feature_cols)
    for index, (feature, column) in enumerate(zip(layout.sparse, found)):
        if (column.kind, column.multi_hot) != (feature.id_kind, feature.multi_hot):
            raise ColumnTypeError(f"sparse column {feature.source!r} holds {_describe(sparse_feature(column))}, but "
                                  f"the model was trained on {_describe(feature)}",
                                  hint=f"give {feature.source!r} the type it had in training")
        ids, weights = prepared_names(index)
        out[ids] = F.expr(_refusing_nulls(rows_sql(column), feature))
        if column.weighted:
            out[weights] = F.expr(_refusing_nulls(weights_sql(column), feature, feature.source_weights))
    return out


def _refusing_nulls(sql: str, feature: SparseFeature, name: str | None = None) -> str:
    """Training refused null ids (and weights) in its statistics job; scoring meets them row by row,
    so the row's expression raises, naming the column, instead of scoring a made-up row."""
    column = name or feature.source
    message = (f"sparkdl: column {column!r} (data.sparse_cols) holds a null id, weight or array in a row to score; "
               "fill or drop such rows first")
    value = f"({sql})"
    test = f"{value} IS NULL" + (f" OR exists({value}, x -> x IS NULL)" if feature.multi_hot else "")
    quoted_message = message.replace("\\", "\\\\").replace("'", "\\'")
    return f"CASE WHEN {test} THEN raise_error('{quoted_message}') ELSE {value} END"
