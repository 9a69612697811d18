"""Driver entry points fit / run / plan / predict: composition only, each read top-down as named stages.

One fit: config and columns -> slots, preflight -> data (one stats job) -> probe the model -> checks ->
the plan (the planner under "auto") -> ship the TrainSpec -> track -> submit -> load and log the model.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from sparkdl.driver.checks import (before_training, check_backend, check_enough_rows, check_gpus_per_task,
                                   check_inference_batch_size, check_output_width, check_picklable,
                                   check_training_options, check_weighted_loss, drop_labels_beyond_the_model,
                                   preflight, probe_model, probe_tensor_model)
from sparkdl.config import RunConfig
from sparkdl.config.elastic import is_elastic
from sparkdl.errors import ConfigError, ModelError
from sparkdl.tracking.fit_records import fit_extras, input_example, run_params
from sparkdl.driver.attempts import tracked_submit
from sparkdl.driver.callbacks import resolve_callbacks
from sparkdl.wire.stopping import stop_tags
from sparkdl.driver.shipping import ship_by_value
from sparkdl.driver.planning import check_kept_world, resolve
from sparkdl.planner.resolved import ResolvedPlan
from sparkdl.tracking.phases import Phases
from sparkdl.tracking.serving import ServedModel
from sparkdl.model.trained import ModelParts, check_complete, load_parts, real_where_state_cannot_reach
from sparkdl.spark.session import facts

_log = logging.getLogger("sparkdl")


@dataclass
class FitResult:
    module: Any  # the trained torch.nn.Module on the driver
    history: list[dict[str, Any]]
    layout: Any  # FeedLayout
    output_kind: str
    config: RunConfig
    run_id: str
    extra: dict[str, Any] = field(default_factory=dict)
    plan: ResolvedPlan | None = None  # the layout it trained with (reusable: TorchEstimator(plan=...))


def _spark(df: Any = None) -> Any:
    if df is not None:
        return df.sparkSession
    from pyspark.sql import SparkSession

    return SparkSession.getActiveSession() or SparkSession.builder.getOrCreate()


def output_kind(config: RunConfig, classification: bool, out_width: int, out_shape: tuple[int, ...] = ()) -> str:
    """How predictions are written (tracking/inference.py): "class" (B, C) -> long, "classes" (B, T, C) ->
    array<long> of length T, "binary", "value" (one number) or "values" (array<float>, flattened)."""
    if config.train.loss == "bce_with_logits":
        return "binary" if math.prod(out_shape or (1,)) == 1 else "values"
    if classification and len(out_shape) >= 2:
        return "classes"
    if classification:
        return "class" if out_width > 1 else "binary"
    return "value" if out_width == 1 and len(out_shape) <= 1 else "values"


def plan(model: Any, df: Any, config: RunConfig | None = None, **options: Any) -> ResolvedPlan:
    """The resolved plan a fit with these options would follow, without training: under
    strategy="auto" the planner's `candidates`, `choice` and `explain()`; `strategy`, `options`,
    the typed `layout`. Keep it and pass it to `TorchEstimator(plan=...)` to train with exactly it."""
    from sparkdl.data.feed import check_columns
    from sparkdl.data.prepare import prepare_run

    config = RunConfig.from_kwargs(base=config, **options).validate()
    check_weighted_loss(config)
    data = config.data
    check_columns(df, _input_columns(config) + ([data.label_col] if data.label_col else []))
    preflight(_spark(df), config.launch.num_workers, config.launch.gpus_per_worker)
    prepared = prepare_run(df, config)
    module, _, sample, _ = _probe(model, config, prepared)
    return resolve(module, config.merged({"tracking": {"progress": False}}), prepared.layout, _spark(df),
                   prepared.num_rows, fallback=False, sample=sample)


def fit(df: Any, model: Any, config: RunConfig, validation_df: Any = None,
        plan: ResolvedPlan | str | None = None) -> FitResult:
    from sparkdl.data.feed import check_columns
    from sparkdl.data.prepare import prepare_run
    from sparkdl.driver.job import ensure_training_slots

    phases = Phases()
    config.validate()
    check_weighted_loss(config)
    callbacks = resolve_callbacks(config.train.callbacks)  # driver only: never shipped
    model = _the_model(model, config)
    kept = kept_plan(plan, config)
    if kept is not None:
        check_kept_world(kept, config)
    check_columns(df, _input_columns(config) + [_label_col(config)])
    spark = _spark(df)
    ensure_training_slots(spark, config.launch.num_workers, config.launch)
    before_training(spark, config, config.launch.num_workers)
    phases.mark("slots")
    prepared = prepare_run(df, config, validation_df)
    phases.mark("prepare")
    module, out_width, sample, out_shape = _probe(model, config, prepared)
    prepared = drop_labels_beyond_the_model(config, prepared, out_width)
    check_output_width(config, out_width, prepared.layout.num_classes, _label_shape(prepared.layout))
    check_enough_rows(config, prepared.num_rows)
    check_training_options(config, spark, prepared, out_shape or (out_width,))
    phases.mark("checks")
    resolved = resolve(module, config, prepared.layout, spark, prepared.num_rows, plan=kept, sample=sample)
    config = resolved.config or config
    spec = _train_spec(model, config, prepared, resolved)
    phases.mark("plan")
    tracker = _start_tracking(config, df, prepared, resolved, spec.run_id)
    phases.mark("tracking")
    resize = _resizer(df, validation_df, model, (module, sample), config, resolved, spec.run_id) \
        if is_elastic(config.launch) else None
    parts, history = tracked_submit(spark, prepared.launch_df(), spec, tracker, callbacks=callbacks, resize=resize)
    phases.mark("job")
    _log_prediction(tracker, resolved, history)
    tracker.set_tags(stop_tags(history))
    kind = output_kind(config, prepared.layout.label_dtype == "int64", out_width, out_shape)  # int64 labels: classes
    tracker.log_loss_curve(history)
    module, model_uri = _take_the_model(parts, module, model, config, prepared, df, (kind, out_shape), tracker, phases)
    phases.mark("log_model")
    tracker.log_metric_points([(phases.metrics(), 0)])
    tracker.finish("FINISHED")
    return FitResult(module=module, history=history, layout=prepared.layout, output_kind=kind, config=config,
                     run_id=spec.run_id, plan=resolved, extra=fit_extras(tracker, model_uri, out_shape, phases,
                                                                          prepared, parts, config))


def _take_the_model(parts: ModelParts, module: Any, model: Any, config: RunConfig, prepared: Any, df: Any,
                    output: tuple[str, tuple[int, ...]], tracker: Any, phases: Phases) -> tuple[Any, str | None]:
    """(the driver's module, the MLflow model's URI): every part checked, read into the module unless
    output.load_model is off, the MLflow model logged from the files. The files go once the model is
    in memory, or on any failure; a model left in them keeps them (ModelParts.remove_when_unused)."""
    load = config.output.load_model
    try:
        check_complete(module, parts.tensor_names())
        module = real_where_state_cannot_reach(module, model, config.train.seed)
        if load:
            load_parts(module, parts.files)
        module.eval()
        phases.mark("load_model")
        serving = ServedModel(module, prepared.layout, output[0], config.data.transform_fn, _explicit_dtypes(config),
                              output[1], config.data.prediction_col)
        model_uri = tracker.log_model(serving, input_example(df, prepared.layout, sample=prepared.sample),
                                      parts.local_directory(), loaded=load) if tracker.run_id else None
    except BaseException:
        parts.remove()
        raise
    if load:
        parts.remove()
    return module, model_uri


def _probe(model: Any, config: RunConfig, prepared: Any) -> tuple[Any, int, Any, tuple[int, ...]]:
    """(module, output width the loss sees, probe batch, per-row output shape): a zero batch of the
    feature width (no batch, shape ()), or (input_cols) a few real rows through the executors'
    conversion and transform_fn."""
    if prepared.layout.tensor_inputs:
        return probe_tensor_model(model, config, prepared.layout, prepared.sample)
    module, out_width = probe_model(model, config, prepared.layout.num_features)
    return module, out_width, None, ()


def _label_shape(layout: Any) -> tuple[int, ...]:
    return tuple(layout.label.shape) if layout.label is not None else ()


def _explicit_dtypes(config: RunConfig) -> frozenset[str]:
    return frozenset(config.data.input_dtypes or {})


def _the_model(model: Any, config: RunConfig) -> Any:
    if model is None and config.model.factory:
        from sparkdl.model.objectives import import_factory

        model = import_factory(config.model.factory)
    if model is None:
        raise ModelError("no model was given", hint="pass model=nn.Module(...) or a zero-argument callable, "
                                                    "or set model.factory='package.module:function'")
    return model


def _input_columns(config: RunConfig) -> list[str]:
    """The DataFrame columns the model reads (input_cols, or feature_cols), plus weight_col."""
    from sparkdl.config.values import input_columns

    data = config.data
    used = input_columns(data) if data.input_cols is not None else list(data.feature_cols)
    return used + ([data.weight_col] if data.weight_col else [])


def _label_col(config: RunConfig) -> str:
    if config.data.label_col is None:
        raise ConfigError("data.label_col is None, but fitting needs a label",
                          hint="pass label_col=..., or use sparkdl.run for a custom loop without labels")
    return config.data.label_col


def kept_plan(plan: ResolvedPlan | str | None, config: RunConfig) -> ResolvedPlan | None:
    """The plan to train with instead of planning: `plan=` (a ResolvedPlan or its JSON text),
    train.plan_from_run (the plan.json of that MLflow run) or train.plan_file; None to plan as usual."""
    run_id, path = config.train.plan_from_run, config.train.plan_file
    if plan is not None and (run_id or path):
        raise ConfigError(f"both plan= and train.{'plan_from_run' if run_id else 'plan_file'} are set",
                          hint="pass only one of them")
    if run_id:
        from sparkdl.tracking.mlflow_run import read_run_artifact

        return ResolvedPlan.from_json(read_run_artifact(run_id, "plan.json", config.tracking.tracking_uri))
    if path:
        from sparkdl.storage.files import read_plan_file

        return ResolvedPlan.from_json(read_plan_file(path))
    if plan is None or isinstance(plan, ResolvedPlan):
        return plan
    if isinstance(plan, (str, bytes)):
        return ResolvedPlan.from_json(plan)
    raise ConfigError(f"plan= must be the ResolvedPlan sparkdl.plan() returns (or its to_json() text), got "
                      f"{type(plan).__name__}", hint="plan = sparkdl.plan(model, df, ...); TorchEstimator(..., plan=plan)")


def _train_spec(model: Any, config: RunConfig, prepared: Any, resolved: ResolvedPlan, run_id: str = "") -> Any:
    from sparkdl.data.epochs import check_shards
    from sparkdl.driver.job import new_run_id
    from sparkdl.wire.spec import TrainSpec

    row_counts = prepared.training_shards(config.launch.num_workers)  # ranks stream epoch 1 on these counts
    check_shards(row_counts, config.data)  # an empty shard or no full batch: raised here, before the job
    layout, rows = prepared.layout, prepared.num_rows + prepared.num_validation_rows

    train = config.train
    ship_by_value(model, train.loss, train.optimizer, config.data.transform_fn, train.lr_schedule, *train.metrics)
    # Callbacks run on the driver (a notebook's plots): the executors only learn that there are some.
    shipped = replace(config, train=replace(train, callbacks=()))
    # An elastic run that may grow asks the driver at every epoch end, as callbacks do.
    asks = bool(train.callbacks) or config.launch.grow_workers
    spec = TrainSpec(run_id=run_id or train.resume_run or new_run_id(), config=shipped, layout=layout, model=model,
                     strategy_layout=resolved.layout, driver_callbacks=asks, rows=rows,
                     row_counts=row_counts, source=prepared.source, packed_rows=prepared.packed is not None)
    check_picklable(spec)
    return spec


def _resizer(df: Any, validation_df: Any, model: Any, probed: tuple[Any, Any], config: RunConfig,
             resolved: ResolvedPlan, run_id: str) -> Callable[[int, Any], tuple[Any, Any]]:
    """An elastic run's re-plan for another number of workers (driver/elastic.py): the data
    re-sharded, the layout resolved again for the strategy the run trains with (a checkpoint
    carries over within its strategy), the global batch kept, the same run id (its checkpoints)."""
    from sparkdl.config.elastic import worker_range
    from sparkdl.data.prepare import prepare_run
    from sparkdl.driver.elastic import kept_batch

    trained = resolved.config or config
    accumulate = trained.train.accumulate_steps
    global_batch = config.data.batch_size * config.launch.num_workers * accumulate
    low, high = worker_range(config.launch)

    def resize(workers: int, change: Any) -> tuple[Any, Any]:
        sized = trained.merged({"launch": {"num_workers": workers, "min_workers": low, "max_workers": high},
                                "data": {"batch_size": kept_batch(global_batch, accumulate, workers)}}).validate()
        prepared = prepare_run(df, sized, validation_df)
        again = resolve(probed[0], sized, prepared.layout, _spark(df), prepared.num_rows, sample=probed[1])
        return prepared.launch_df(), _train_spec(model, again.config or sized, prepared, again, run_id=run_id)
    return resize


def _start_tracking(config: RunConfig, df: Any, prepared: Any, resolved: ResolvedPlan, run_id: str) -> Any:
    from sparkdl.tracking.mlflow_run import RunTracker

    t = config.tracking
    tracker = RunTracker(t.tracking, t.tracking_uri, t.experiment, t.run_name)
    tracker.start(params={**run_params(config, df, prepared), **resolved.as_params()}, tags={"sparkdl.run_id": run_id})
    tracker.log_text(resolved.explain(), "plan.txt")  # the planner's table under "auto", then the layout
    tracker.log_text(resolved.to_json(), "plan.json")  # the same plan as a value: TorchEstimator(plan_from_run=...)
    return tracker


def _log_prediction(tracker: Any, resolved: ResolvedPlan, history: list[dict[str, Any]]) -> None:
    """Beside the planner's prediction: the measured step time of the last epoch (data loading included)."""
    choice = resolved.choice
    if choice is not None and history and history[-1].get("steps"):
        measured = 1e3 * history[-1]["seconds"] / history[-1]["steps"]
        tracker.log_metric_points([({"plan_measured_step_ms": measured,
                                     "plan_predicted_step_ms": 1e3 * choice.predicted_step_s}, 0)])


def run(train_fn: Callable[[Any], Any], df: Any = None, num_workers: int = 2, **options: Any) -> Any:
    """Call train_fn(ctx) on every rank of a barrier job; returns rank 0's return value."""
    from sparkdl.data.epochs import check_shards
    from sparkdl.data.prepare import prepare_run
    from sparkdl.driver.job import ensure_training_slots, new_run_id
    from sparkdl.wire.spec import TrainSpec

    config = _run_config(train_fn, df, num_workers, options)
    spark = _spark(df)
    ensure_training_slots(spark, num_workers, config.launch)
    before_training(spark, config, num_workers)
    job_df, layout, source, row_counts, rows, packed = spark.range(0, num_workers, 1, num_workers), None, None, (), 0, False
    if df is not None:
        prepared = prepare_run(df, config, custom_loop=True)
        if prepared.num_rows < num_workers:
            check_enough_rows(config, prepared.num_rows)
        job_df, layout, source, packed = prepared.launch_df(), prepared.layout, prepared.source, prepared.packed is not None
        # Counted up front (free for a kept partitioning or direct reads), so that ctx.batches(0)
        # streams while the partition arrives, as the built-in loop's epoch 1 does.
        row_counts = prepared.training_shards(num_workers)
        check_shards(row_counts, config.data)
        rows = prepared.num_rows + prepared.num_validation_rows
    ship_by_value(train_fn, config.data.transform_fn)
    spec = TrainSpec(run_id=new_run_id(), config=config, layout=layout, train_fn=train_fn, source=source,
                     row_counts=row_counts, rows=rows, packed_rows=packed)
    check_picklable(spec)
    check_backend(config)
    # A custom loop gets the driver channel too (rank 0's output, the failing rank's own error),
    # but no MLflow run: what it trains and logs is its own business.
    result, _ = tracked_submit(spark, job_df, spec)
    return result


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
        # No DataFrame: the data section (feature columns) does not apply.
        config.train.validate()
        config.launch.validate()
        return config
    label = config.data.label_col if config.data.label_col in df.columns else None
    if config.data.input_cols is not None:
        return config.merged({"data": {"label_col": label}}).validate()
    features = config.data.feature_cols or tuple(c for c in df.columns if c not in (label, config.data.weight_col))
    return config.merged({"data": {"feature_cols": tuple(features), "label_col": label}}).validate()


def predict(df: Any, module: Any, layout: Any, kind: str, prediction_col: str = "prediction",
            batch_size: int = 1024, gpus_per_task: float = 0.0, served: Any = None) -> Any:
    """Append `prediction_col` computed on the executors through mapInArrow; every input column kept.

    `gpus_per_task` > 0 runs the scoring stage under a task ResourceProfile with that many GPUs, so a
    CPU-default application scores on GPUs; a fraction (0.25) lets 1/amount tasks share one GPU."""
    import uuid
    from dataclasses import replace

    from pyspark.sql import types as T

    from sparkdl.data.feed import check_columns, features_expression
    from sparkdl.data.layout import FEATURES_COLUMN
    from sparkdl.errors import SchemaError
    from sparkdl.tracking.inference import make_predict_fn
    from sparkdl.driver.job import gpu_task_profile
    from sparkdl.wire.codec import dumps_any

    check_gpus_per_task(gpus_per_task)
    check_inference_batch_size(batch_size)
    cols = list(layout.source_input_cols)
    check_columns(df, cols)
    if prediction_col in df.columns:
        raise SchemaError(f"the DataFrame already has a column named {prediction_col!r}",
                          hint="drop it first or pass another prediction column name")
    prediction_type = {"class": T.LongType(), "binary": T.LongType(), "value": T.DoubleType(),
                       "classes": T.ArrayType(T.LongType()), "values": T.ArrayType(T.FloatType())}[kind]
    metadata = {"sparkdl.output_shape": list(served.output_shape)} if served is not None else {}
    out_schema = T.StructType(df.schema.fields + [T.StructField(prediction_col, prediction_type, True, metadata)])
    spark = df.sparkSession
    ship_by_value(module, served.transform_fn if served is not None else None)
    module_bytes = facts(spark).ship(dumps_any(module))
    carried = replace(served, module=None) if served is not None else None
    fn = make_predict_fn(module_bytes, uuid.uuid4().hex, FEATURES_COLUMN, layout.num_features, kind, prediction_col,
                         batch_size, carried)
    profile = gpu_task_profile(spark, gpus_per_task) if gpus_per_task else None
    if layout.tensor_inputs:
        from sparkdl.data.tensor_feed import selected_inputs

        prepared = df.withColumns({c.column: selected_inputs(df, c) for c in layout.inputs})
    else:
        prepared = df.withColumn(FEATURES_COLUMN, features_expression(df, cols))
    return prepared.mapInArrow(fn, out_schema, profile=profile)
