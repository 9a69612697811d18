"""Driver side of the data path: validate the schema, select and cast columns, shard by world size.

Every problem a user can cause with their DataFrame is raised here, on the driver, before any
barrier job starts; one aggregation job gathers all the statistics the checks need.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Sequence

from pyspark.ml.functions import vector_to_array
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from sparkdl.data.feed_sql import (feature_invalid, feature_invalid_sql, feature_kind, features_expression,
                                   label_invalid, label_type, quoted, row_invalid)
from sparkdl.data.shards import balanced, partition_row_counts, shard_row_counts
from sparkdl.data.layout import FEATURES_COLUMN, LABEL_COLUMN, SPLIT_COLUMN, WEIGHT_COLUMN, FeedLayout
from sparkdl.errors import (
    ArrayLengthError,
    ColumnTypeError,
    EmptyDataError,
    MissingColumnError,
    NullValuesError,
)
from sparkdl.spark.session import facts

if TYPE_CHECKING:
    import pyarrow as pa

    from sparkdl.config import DataConfig, TrainConfig
    from sparkdl.data.parquet_shards import ParquetShards

_log = logging.getLogger("sparkdl")


@dataclass(frozen=True)
class PreparedData:
    df: DataFrame  # two columns: features array<float>, label (int64/float32) when training
    layout: FeedLayout
    num_rows: int  # training rows
    num_validation_rows: int = 0
    dropped_rows: int = 0  # invalid rows dropped under on_invalid="skip"
    sample: "pa.Table | None" = None  # input_cols runs: the first prepared rows, to probe the model with
    shard_rows: tuple[int, ...] | None = None  # training rows per rank when already counted (a kept partitioning)
    counted_from: DataFrame | None = None  # data.shards.balanced's keyed input: counts the shards without the shuffle
    # A plain Parquet scan the ranks read themselves (data/parquet_source.py), or None.
    source: "ParquetShards | None" = None
    # The same rows as `df` with every feature as its own float column (scalar features only, the
    # partitioning kept, nothing added): what packed delivery packs (data/packed_delivery.py).
    flat: DataFrame | None = None
    packed: DataFrame | None = None  # `flat` packed into blocks of rows on the JVM, when delivered so

    def launch_df(self) -> DataFrame:
        """What the barrier job maps over: the prepared rows (packed into blocks, or as Spark's own
        Arrow rows), or under direct Parquet reads one placeholder row per rank (each rank reads its
        own rows)."""
        if self.packed is not None:
            return self.packed
        if self.source is None:
            return self.df
        workers = len(self.source.pieces)
        return self.df.sparkSession.range(0, workers, 1, workers)

    @property
    def delivery(self) -> str:
        """How the ranks get their rows: "parquet" (direct reads), "packed" or "spark"."""
        return "parquet" if self.source is not None else "packed" if self.packed is not None else "spark"

    def with_rows(self, df: DataFrame, **changes: Any) -> "PreparedData":
        """The same preparation over other rows (say, some dropped and the rest shuffled): the ways
        of delivering the old rows (a direct Parquet source, the flat and packed frames, their
        counted shards) described those rows and go with them."""
        return replace(self, df=df, source=None, flat=None, packed=None, shard_rows=None, **changes)

    def training_shards(self, workers: int) -> tuple[int, ...]:
        """Training rows of every rank's shard (one small job unless already counted)."""
        if self.shard_rows is not None:
            return self.shard_rows
        return shard_row_counts(self.df, workers, self.counted_from, self.layout.split_column)


def label_is_integral(df: DataFrame, label_col: str | None) -> bool:
    if label_col is None or label_col not in df.columns:
        return False
    dtype = df.schema[label_col].dataType
    element = dtype.elementType if isinstance(dtype, T.ArrayType) else dtype  # per-position labels
    return isinstance(element, (T.IntegralType, T.BooleanType))


def is_classification(df: DataFrame, data: "DataConfig", train: "TrainConfig", custom_loop: bool = False) -> bool:
    """TrainConfig.is_classification (the one rule) for this DataFrame's label column."""
    return train.is_classification(label_is_integral(df, data.label_col), builtin_loss=not custom_loop)


def check_columns(df: DataFrame, columns: Sequence[str]) -> None:
    available = df.columns
    for name in columns:
        if name not in available:
            raise MissingColumnError(
                f"column {name!r} is not in the DataFrame; available columns: {', '.join(available)}",
                hint="fix feature_cols/label_col, or add the column before fitting")


def weight_aggregates(weight_col: str | None) -> list[Column]:
    """The stats job's terms for a weight column: nulls, and negative or non-finite weights."""
    if weight_col is None:
        return []
    col = F.col(quoted(weight_col)).cast("double")
    return [F.sum(col.isNull().cast("long")).alias("null_weight"),
            F.sum(F.coalesce(F.isnan(col) | (F.abs(col) == float("inf")) | (col < 0), F.lit(False)).cast("long"))
            .alias("bad_weight")]


def check_weight(df: DataFrame, name: str, stats: dict) -> None:
    if not isinstance(df.schema[name].dataType, T.NumericType):
        raise ColumnTypeError(f"weight column {name!r} has type {df.schema[name].dataType.simpleString()}, not numeric",
                              hint="pass a numeric per-row weight >= 0")
    if stats.get("null_weight"):
        raise NullValuesError(f"weight column {name!r} has {stats['null_weight']} null value(s)",
                              hint=f"fill them, e.g. df.na.fill({{{name!r}: 1.0}})")
    if stats.get("bad_weight"):
        raise ColumnTypeError(f"weight column {name!r} has {stats['bad_weight']} negative, NaN or infinite value(s)",
                              hint="weights must be finite and >= 0 (0 = the row counts for nothing)")


_PACKED = 1 << 32  # a scalar column's nulls count below this bit of its one check sum, NaN/Inf above it


def feed_stats(df: DataFrame, feature_cols: Sequence[str], label_col: str | None,
               classification: bool, weight_col: str | None = None, on_invalid: str = "skip",
               packed: bool = True, extra: Sequence[Column] = ()) -> dict[str, int | None]:
    """Every count the driver's checks need, in one aggregation job. A scalar feature column's nulls
    and NaN/Inf rows share one sum (`packed`): Spark's aggregation slows with the number of
    aggregates (1M rows x 64 columns: 4-6 s with two per column, 1.5-2 s with one); a DataFrame of
    2^32 rows or more, where the packed counts could overflow, is counted again unpacked. `extra`:
    more named aggregates for the same job (a sparse_cols run's checks of its categorical columns)."""
    aggs: list[Column] = [F.count(F.lit(1)).alias("rows"), *weight_aggregates(weight_col)]
    packed_columns = []
    for i, name in enumerate(feature_cols):
        kind = feature_kind(df, name)
        text = feature_invalid_sql(df, name)
        if packed and kind == "scalar" and text is not None:
            aggs.append(F.expr(f"sum(CASE WHEN {quoted(name)} IS NULL THEN 1L WHEN {text} THEN {_PACKED}L ELSE 0L END)"
                               f" AS checks_{i}"))
            packed_columns.append(i)
            continue
        aggs.append(F.expr(f"sum(cast({quoted(name)} IS NULL as long)) AS null_{i}"))
        if kind in ("array", "vector"):
            arr = F.col(quoted(name)) if kind == "array" else vector_to_array(F.col(quoted(name)))
            aggs += [F.min(F.size(arr)).alias(f"min_{i}"), F.max(F.size(arr)).alias(f"max_{i}")]
            if kind == "array":
                aggs.append(F.sum(F.exists(arr, lambda x: x.isNull()).cast("long")).alias(f"inner_{i}"))
        aggs.append(F.expr(f"sum(cast({text} as long)) AS nonfinite_{i}") if text is not None else
                    F.sum(feature_invalid(df, name).cast("long")).alias(f"nonfinite_{i}"))
    if on_invalid == "skip":
        # Only skipping needs the rows it drops (under "error" any such row raises first); alone, this
        # OR over every column took 15 s for 1M rows x 64 columns.
        aggs.append(F.sum(row_invalid(df, feature_cols, label_col, classification).cast("long")).alias("invalid_rows"))
    if label_col is not None:
        aggs.append(F.sum(F.col(quoted(label_col)).isNull().cast("long")).alias("null_label"))
        as_double = F.col(quoted(label_col)).cast("double")
        aggs.append(F.sum((F.isnan(as_double) | (F.abs(as_double) == float("inf"))).cast("long"))
                    .alias("nonfinite_label"))
        invalid = label_invalid(label_col, classification)
        aggs.append(F.sum(invalid.cast("long")).alias("invalid_label"))
        if classification:
            # Spark ML labels are doubles: accepted for classification when they hold whole numbers.
            label = F.col(quoted(label_col)).cast("double")
            aggs += [F.min(label).alias("label_min"), F.max(label).alias("label_max"),
                     F.sum((label != F.floor(label)).cast("long")).alias("label_fractional"),
                     F.max(F.when(~invalid, label)).alias("valid_label_max")]
    stats = df.agg(*aggs, *extra).collect()[0].asDict()
    if packed_columns and stats["rows"] >= _PACKED:
        return feed_stats(df, feature_cols, label_col, classification, weight_col, on_invalid, packed=False, extra=extra)
    for i in packed_columns:
        checks = stats.pop(f"checks_{i}") or 0
        stats[f"null_{i}"], stats[f"nonfinite_{i}"] = checks % _PACKED, checks // _PACKED
    return stats


def prepare(df: DataFrame, feature_cols: Sequence[str], label_col: str | None, *, classification: bool,
            num_workers: int, validation_df: DataFrame | None = None, validation_fraction: float = 0.0,
            seed: int = 0, on_invalid: str = "error", weight_col: str | None = None,
            count_kept_partitions: bool = True, fixed_order: bool = False) -> PreparedData:
    """Checked, selected and sharded data. With validation (a DataFrame, or a fraction held out by
    seed), validation rows travel in the same barrier job, marked by a split column, so every rank
    evaluates its share each epoch without a second Spark job. `weight_col`: per-row weights, a
    third prepared column."""
    prepared = _prepare_one(df, feature_cols, label_col, classification=classification, on_invalid=on_invalid,
                            weight_col=weight_col)
    val = None
    if validation_df is not None:
        val = _prepare_one(validation_df, feature_cols, label_col, classification=classification, what="validation_df",
                           on_invalid=on_invalid, weight_col=weight_col)
        if val.layout.num_features != prepared.layout.num_features:
            raise ArrayLengthError(f"validation_df has {val.layout.num_features} feature values per row, the "
                                   f"training DataFrame {prepared.layout.num_features}",
                                   hint="use the same feature columns")
    return split_and_shard(prepared, val, num_workers=num_workers, validation_fraction=validation_fraction, seed=seed,
                           count_kept_partitions=count_kept_partitions, fixed_order=fixed_order)


def split_and_shard(prepared: PreparedData, validation: PreparedData | None, *, num_workers: int,
                    validation_fraction: float = 0.0, seed: int = 0, count_kept_partitions: bool = True,
                    fixed_order: bool = False) -> PreparedData:
    """Validation rows (a prepared validation_df, or a fraction held out by seed) marked by a split
    column in the same DataFrame, and the rows spread over num_workers partitions (one per rank).
    count_kept_partitions=False skips the job that counts a kept partitioning (the rows are dealt);
    fixed_order: dealt rows keep their input order within each shard (shards.balanced)."""
    layout, selected = prepared.layout, prepared.df
    num_rows, num_val = prepared.num_rows, 0
    if validation is not None:
        selected = selected.withColumn(SPLIT_COLUMN, F.lit(0)).unionByName(
            validation.df.withColumn(SPLIT_COLUMN, F.lit(1)))
        num_val = validation.num_rows
        prepared = replace(prepared, dropped_rows=prepared.dropped_rows + validation.dropped_rows)
    elif validation_fraction > 0:
        held_out = (F.rand(seed) < F.lit(validation_fraction)).cast("int")
        selected = selected.withColumn(SPLIT_COLUMN, held_out)
        num_val = int(round(num_rows * validation_fraction))
        num_rows -= num_val
    kept_rows = None
    if count_kept_partitions and not num_val and not prepared.dropped_rows and \
            facts(selected.sparkSession).num_partitions(selected) == num_workers:
        # A DataFrame already split into exactly num_workers non-empty partitions keeps its
        # partitioning and row order (one small job counts them, only in that case).
        per_partition = partition_row_counts(selected)
        if len(per_partition) == num_workers:
            kept_rows = tuple(per_partition.get(p, 0) for p in range(num_workers))
    counted_from = None
    if num_val:
        layout = replace(layout, split_column=SPLIT_COLUMN)
    if kept_rows is None:  # a union cannot run in a barrier stage as is either
        selected, counted_from = balanced(selected, num_workers, fixed_order)
    flat = prepared.flat if kept_rows is not None and not num_val else None  # the same rows, only so
    return replace(prepared, df=selected, layout=layout, num_rows=num_rows, num_validation_rows=num_val,
                   shard_rows=kept_rows, counted_from=counted_from, flat=flat)


def _prepare_one(df: DataFrame, feature_cols: Sequence[str], label_col: str | None, *, classification: bool,
                 what: str = "the DataFrame", on_invalid: str = "error", weight_col: str | None = None) -> PreparedData:
    used = list(feature_cols) + [c for c in (label_col, weight_col) if c is not None]
    check_columns(df, used)
    label_dtype = None
    if label_col is not None:
        label_type(df, label_col)
        label_dtype = "int64" if classification else "float32"
    stats = feed_stats(df, feature_cols, label_col, classification, weight_col, on_invalid)
    if not stats["rows"]:
        raise EmptyDataError(f"{what} has no rows", hint="check the filters or the input path")
    if weight_col is not None:
        check_weight(df, weight_col, stats)
    num_features = checked_feature_width(df, feature_cols, stats, what, on_invalid)
    num_classes = checked_label(label_col, stats, classification, what, on_invalid) if label_col is not None else None
    dropped = int(stats["invalid_rows"] or 0) if on_invalid == "skip" else 0
    if dropped:
        if dropped == stats["rows"]:
            raise EmptyDataError(f"every row of {what} is invalid ({dropped} rows with NaN/Inf features or "
                                 "unusable labels): none left to train on", hint="check the data and the filters")
        _log.warning("sparkdl: on_invalid='skip' dropped %d of %d rows of %s (NaN/Inf features or unusable labels)",
                     dropped, stats["rows"], what)
        df = df.filter(~row_invalid(df, feature_cols, label_col, classification))
    selected = [features_expression(df, feature_cols).alias(FEATURES_COLUMN)]
    if label_col is not None:
        cast = "long" if label_dtype == "int64" else "float"
        selected.append(F.col(quoted(label_col)).cast(cast).alias(LABEL_COLUMN))
    if weight_col is not None:
        selected.append(F.col(quoted(weight_col)).cast("float").alias(WEIGHT_COLUMN))
    prepared = df.select(*selected)
    flat = _flat(df, feature_cols, label_col, "long" if label_dtype == "int64" else "float", weight_col)
    layout = FeedLayout(num_features=num_features, label_dtype=label_dtype,
                        source_feature_cols=tuple(feature_cols), source_label_col=label_col,
                        num_classes=num_classes, weight_column=WEIGHT_COLUMN if weight_col else None,
                        source_weight_col=weight_col)
    return PreparedData(df=prepared, layout=layout, num_rows=int(stats["rows"]) - dropped, dropped_rows=dropped,
                        flat=flat)


def _flat(df: DataFrame, feature_cols: Sequence[str], label_col: str | None, label_cast: str,
          weight_col: str | None) -> DataFrame | None:
    """The prepared rows with one float column per feature (None unless every feature is a scalar).
    SQL text: one py4j call for all the columns."""
    if any(feature_kind(df, name) != "scalar" for name in feature_cols):
        return None
    columns = [f"cast({quoted(name)} as float) as `f{i}`" for i, name in enumerate(feature_cols)]
    if label_col is not None:
        columns.append(f"cast({quoted(label_col)} as {label_cast}) as {LABEL_COLUMN}")
    if weight_col is not None:
        columns.append(f"cast({quoted(weight_col)} as float) as {WEIGHT_COLUMN}")
    return df.selectExpr(*columns)


def checked_feature_width(df: DataFrame, feature_cols: Sequence[str], stats: dict, what: str, on_invalid: str) -> int:
    """Feature values per row, from the stats job; the first column with nulls, NaN/Inf (unless
    skipped), null elements or rows of unequal length raises, naming it."""
    num_features = 0
    for i, name in enumerate(feature_cols):
        kind = feature_kind(df, name)
        nulls = stats[f"null_{i}"] or 0
        if nulls:
            raise NullValuesError(f"feature column {name!r} has {nulls} null value(s) in {stats['rows']} rows",
                                  hint=f"drop or fill them first, e.g. df.na.drop(subset=[{name!r}]) or df.na.fill(...)")
        nonfinite = stats[f"nonfinite_{i}"] or 0
        if nonfinite and on_invalid == "error":
            raise NullValuesError(f"feature column {name!r} has {nonfinite} row(s) with NaN or infinite values "
                                  f"(of {stats['rows']} in {what})",
                                  hint="fix or drop them first, or pass on_invalid='skip' to drop such rows "
                                       "(they are counted and logged)")
        if kind == "scalar":
            num_features += 1
            continue
        inner = stats.get(f"inner_{i}") or 0
        if inner:
            raise NullValuesError(f"array column {name!r} has {inner} row(s) holding null elements",
                                  hint="fill the null elements, e.g. with F.transform(col, lambda x: F.coalesce(x, F.lit(0.0)))")
        low, high = stats[f"min_{i}"], stats[f"max_{i}"]
        if low != high:
            raise ArrayLengthError(f"{kind} column {name!r} holds rows of different lengths (from {low} to {high})",
                                   hint="every row must have the same number of values; pad or filter the rows")
        num_features += int(high)
    if num_features == 0:
        raise ArrayLengthError(f"feature columns {list(feature_cols)} hold no values (length 0)",
                               hint="pass non-empty array/vector columns")
    return num_features


def checked_label(label_col: str, stats: dict, classification: bool, what: str, on_invalid: str) -> int | None:
    """The number of classes (None for regression), from the stats job; nulls, NaN/Inf (unless
    skipped) or labels that are no class index raise, naming the column."""
    nulls = stats["null_label"] or 0
    if nulls:
        raise NullValuesError(f"label column {label_col!r} has {nulls} null value(s) in {stats['rows']} rows",
                              hint=f"drop them first, e.g. df.na.drop(subset=[{label_col!r}])")
    nonfinite = stats["nonfinite_label"] or 0
    if nonfinite and on_invalid == "error":
        raise NullValuesError(f"label column {label_col!r} has {nonfinite} NaN or infinite value(s)",
                              hint=f"drop them first, e.g. df.filter(~F.isnan({label_col!r})), or pass "
                                   "on_invalid='skip' to drop such rows")
    if not classification:
        return None
    low, high = stats["label_min"], stats["label_max"]
    if on_invalid == "skip":
        high = stats["valid_label_max"]
        if high is None:
            raise EmptyDataError(f"label column {label_col!r} of {what} holds no class index 0..C-1",
                                 hint="index the labels (StringIndexer) or use loss='mse' for regression")
    elif low < 0 or stats["label_fractional"]:
        raise ColumnTypeError(
            f"label column {label_col!r} must hold class indices 0..C-1 for a classification loss "
            f"(found values from {low} to {high})",
            hint="index the labels (StringIndexer) or use loss='mse' for regression")
    return int(high) + 1
