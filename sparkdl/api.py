"""Driver entry points fit / run / plan / predict: composition only, each read top-down as named stages.

One fit (sparkdl/fit_stages.py holds the stages and the typed record each returns): validate (options,
model, columns, slots, preflight) -> prepare data (one stats job, shards, the model probed, checks) ->
plan (the planner under "auto", the TrainSpec) -> launch (MLflow run, barrier job) -> collect (the
model read from the ranks' parts and logged).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable

from sparkdl.config import RunConfig
from sparkdl.data.layout import FeedLayout
from sparkdl.data.parquet_shards import ParquetShards
from sparkdl.driver.attempts import tracked_submit
from sparkdl.driver.checks import (before_training, check_backend, check_enough_rows, check_gpus_per_task,
                                   check_inference_batch_size, check_picklable, check_weighted_loss, preflight)
from sparkdl.driver.model_inputs import bind_model_inputs
from sparkdl.driver.planning import resolve
from sparkdl.driver.shipping import ship_by_value
from sparkdl.errors import ConfigError
from sparkdl.fit_stages import (FitResult, collect, input_columns, kept_plan, launch, output_kind, plan_fit,
                                prepare_data, probe, spark_of, the_model, validate)
from sparkdl.planner.resolved import ResolvedPlan
from sparkdl.spark.session import facts
from sparkdl.tracking.phases import Phases
from sparkdl.wire.spec import TrainSpec

if TYPE_CHECKING:
    import torch
    from pyspark.sql import DataFrame, SparkSession

    from sparkdl.executor.context import WorkerContext
    from sparkdl.wire.spec import ModelSpec

__all__ = ["fit", "run", "plan", "predict", "FitResult", "kept_plan", "output_kind", "check_backend"]

_log = logging.getLogger("sparkdl")


def plan(model: ModelSpec, df: DataFrame, config: RunConfig | None = None, **options: Any) -> ResolvedPlan:
    """The resolved plan a fit with these options would follow, without training: under
    strategy="auto" the planner's `candidates`, `choice` and `explain()`; `strategy`, `options`,
    the typed `layout`. Keep it and pass it to `TorchEstimator(plan=...)` to train with exactly it."""
    from sparkdl.data.feed import check_columns
    from sparkdl.data.prepare import prepare_run

    config = RunConfig.from_kwargs(base=config, **options).validate()
    check_weighted_loss(config.data, config.train)
    model = the_model(model, config)
    config = replace(config, data=bind_model_inputs(config.data, config.train, model))  # as fit binds them
    data = config.data
    check_columns(df, input_columns(config) + ([data.label_col] if data.label_col else []))
    preflight(spark_of(df), config.launch.num_workers, config.launch.gpus_per_worker)
    prepared = prepare_run(df, config.data, config.train, config.launch)
    module, _, sample, _ = probe(model, config, prepared)
    quiet = replace(config.tracking, progress=False)
    return resolve(module, config.data, config.train, config.launch, quiet, prepared.layout, spark_of(df),
                   prepared.num_rows, fallback=False, sample=sample, embeddings=config.embeddings, rows=prepared.df)


def fit(df: DataFrame, model: ModelSpec, config: RunConfig, validation_df: DataFrame | None = None,
        plan: ResolvedPlan | str | None = None, shared: Any = None) -> FitResult:
    """Train `model` on `df` with `config` on a barrier job; the stages of sparkdl/fit_stages.py in
    order. `shared`: a data.prepare.PreparedRuns the fits of one tuning grid share."""
    phases = Phases()
    request = validate(df, model, config, plan)
    phases.mark("slots")
    data = prepare_data(df, validation_df, request, phases, shared)
    phases.mark("checks")
    planned = plan_fit(request, data)
    phases.mark("plan")
    ran = launch(df, validation_df, request, data, planned, phases)
    phases.mark("job")
    return collect(df, request, data, planned, ran, phases)


def run(train_fn: Callable[[WorkerContext], Any], df: DataFrame | None = None, num_workers: int = 2, **options: Any) -> Any:
    """Call train_fn(ctx) on every rank of a barrier job; returns rank 0's return value.

    Stages: validate (options, slots, preflight) -> prepare data (the rows dealt to ranks, counted) ->
    the TrainSpec -> launch and collect (rank 0's return value)."""
    from sparkdl.driver.job import ensure_training_slots

    config = _run_config(train_fn, df, num_workers, options)
    spark = spark_of(df)
    ensure_training_slots(spark, num_workers, config.launch)
    before_training(spark, config.train, config.launch, num_workers)
    feed = _run_feed(spark, df, config)
    spec = _run_spec(train_fn, config, feed)
    # A custom loop gets the driver channel too (rank 0's output, the failing rank's own error),
    # but no MLflow run: what it trains and logs is its own business.
    result, _ = tracked_submit(spark, feed.job_df, spec)
    return result


@dataclass(frozen=True)
class RunFeed:
    """sparkdl.run's data stage: the job's input and what the ranks learn of their rows."""

    job_df: DataFrame  # the barrier job's DataFrame (one placeholder row per rank without a DataFrame)
    layout: FeedLayout | None = None
    source: ParquetShards | None = None
    row_counts: tuple[int, ...] = ()
    rows: int = 0
    packed: bool = False


def _run_feed(spark: SparkSession, df: DataFrame | None, config: RunConfig) -> RunFeed:
    from sparkdl.data.epochs import check_shards
    from sparkdl.data.prepare import prepare_run

    workers = config.launch.num_workers
    if df is None:
        return RunFeed(spark.range(0, workers, 1, workers))
    prepared = prepare_run(df, config.data, config.train, config.launch, custom_loop=True)
    if prepared.num_rows < workers:
        check_enough_rows(config.data, config.launch, prepared.num_rows)
    # Counted up front (free for a kept partitioning or direct reads), so that ctx.batches(0)
    # streams while the partition arrives, as the built-in loop's epoch 1 does.
    row_counts = prepared.training_shards(workers)
    check_shards(row_counts, config.data)
    return RunFeed(prepared.launch_df(), prepared.layout, prepared.source, tuple(row_counts),
                   prepared.num_rows + prepared.num_validation_rows, prepared.packed is not None)


def _run_spec(train_fn: Callable[[WorkerContext], Any], config: RunConfig, feed: RunFeed) -> TrainSpec:
    from sparkdl.driver.job import new_run_id

    ship_by_value(train_fn, config.data.transform_fn, spark=feed.job_df.sparkSession)
    spec = TrainSpec(run_id=new_run_id(), data=config.data, train=config.train, launch=config.launch,
                     tracking=config.tracking, layout=feed.layout, train_fn=train_fn, source=feed.source,
                     row_counts=feed.row_counts, rows=feed.rows, packed_rows=feed.packed)
    check_picklable(spec)
    check_backend(config.train, config.launch)
    return spec


def _run_config(train_fn: Any, df: Any, num_workers: int, options: dict[str, Any]) -> RunConfig:
    """sparkdl.run's options; with a DataFrame every column but the label is a feature by default."""
    if not callable(train_fn):
        raise ConfigError(f"train_fn must be callable, got {type(train_fn).__name__}",
                          hint="def train_fn(ctx): ... ; sparkdl.run(train_fn, df=df)")
    config = RunConfig.from_kwargs(num_workers=num_workers, **options)
    if config.train.callbacks:
        raise ConfigError("train.callbacks are called with the built-in loop's epoch records, but sparkdl.run runs "
                          "your train_fn", hint="call your own code from train_fn, or train with fit / TorchEstimator")
    if config.data.spool == "none":
        raise ConfigError("data.spool='none' applies to fit: sparkdl.run spools each partition, since a custom "
                          "loop may read its epochs in any order", hint="use spool='disk' or 'auto' with sparkdl.run")
    if df is None:
        # No DataFrame: the column options do not apply; every other option meets fit's checks.
        return config.validate(columns=False)
    label = config.data.label_col if config.data.label_col in df.columns else None
    if config.data.input_cols is not None:
        return config.merged({"data": {"label_col": label}}).validate()
    features = config.data.feature_cols or tuple(c for c in df.columns if c not in (label, config.data.weight_col))
    return config.merged({"data": {"feature_cols": tuple(features), "label_col": label}}).validate()


def _scored_schema(df: DataFrame, kind: str, columns: Any, served: Any) -> Any:
    """transform's output schema: df's columns, the prediction, and the score columns of `kind`
    (arrays of doubles here; made vectors after the scoring stage); a name df already has is refused."""
    from pyspark.sql import types as T

    from sparkdl.errors import SchemaError

    scores = columns.scores(kind)
    for name in (columns.prediction, *scores):
        if name in df.columns:
            raise SchemaError(f"the DataFrame already has a column named {name!r}, which transform writes",
                              hint="drop it first, or name the output otherwise (setPredictionCol, "
                                   "setProbabilityCol, setRawPredictionCol; \"\" leaves a score column out)")
    prediction_type = {"class": T.DoubleType(), "binary": T.DoubleType(), "value": T.DoubleType(),
                       "classes": T.ArrayType(T.LongType()), "values": T.ArrayType(T.FloatType()),
                       "text": T.StringType(), "embedding": T.ArrayType(T.FloatType())}[kind]
    metadata = {"sparkdl.output_shape": list(served.output_shape)} if served is not None else {}
    return T.StructType(df.schema.fields + [T.StructField(columns.prediction, prediction_type, True, metadata)]
                        + [T.StructField(name, T.ArrayType(T.DoubleType()), True) for name in scores])


def predict(df: DataFrame, module: torch.nn.Module, layout: FeedLayout, kind: str, columns: Any = "prediction",
            batch_size: int = 1024, gpus_per_task: float = 0.0, served: Any = None) -> Any:
    """Append the prediction computed on the executors through mapInArrow (and, for classifiers,
    rawPrediction and probability vectors: `columns`, a tracking.inference.ScoreColumns, or the
    name of the one prediction column); every input column kept.

    `gpus_per_task` > 0 runs the scoring stage under a task ResourceProfile with that many GPUs, so a
    CPU-default application scores on GPUs; a fraction (0.25) lets 1/amount tasks share one GPU."""
    import uuid
    from dataclasses import replace

    from sparkdl.data.feed import check_columns, features_expression
    from sparkdl.data.layout import FEATURES_COLUMN
    from sparkdl.tracking.inference import ScoreColumns, make_predict_fn
    from sparkdl.driver.job import gpu_task_profile
    from sparkdl.wire.codec import dumps_any

    check_gpus_per_task(gpus_per_task)
    check_inference_batch_size(batch_size)
    if isinstance(columns, str):  # the prediction column alone, as before score columns existed
        columns = ScoreColumns(prediction=columns, probability="", raw_prediction="")
    cols = list(layout.source_input_cols)
    check_columns(df, cols)
    scores = columns.scores(kind)
    out_schema = _scored_schema(df, kind, columns, served)
    spark = df.sparkSession
    ship_by_value(module, served.transform_fn if served is not None else None, spark=spark)
    module_bytes = facts(spark).ship(dumps_any(module))
    carried = replace(served, module=None) if served is not None else None
    fn = make_predict_fn(module_bytes, uuid.uuid4().hex, FEATURES_COLUMN, layout.num_features, kind, columns,
                         batch_size, carried)
    profile = gpu_task_profile(spark, gpus_per_task) if gpus_per_task else None
    if layout.sparse:  # ids mapped to table rows by the SQL training used
        from sparkdl.data.sparse_feed import scoring_columns

        prepared = df.withColumns(scoring_columns(df, layout))
    elif layout.tensor_inputs:
        from sparkdl.data.tensor_feed import selected_inputs

        prepared = df.withColumns({c.column: selected_inputs(df, c) for c in layout.inputs})
    else:
        prepared = df.withColumn(FEATURES_COLUMN, features_expression(df, cols))
    scored = prepared.mapInArrow(fn, out_schema, profile=profile)
    if not scores:
        return scored
    from pyspark.ml.functions import array_to_vector

    return scored.withColumns({name: array_to_vector(name) for name in scores})  # Spark ML's evaluators read vectors
