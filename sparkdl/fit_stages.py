"""The stages of one fit, in order: validate -> prepare data -> plan -> launch -> collect. Each takes
what the stage before it returned (a typed record below) and the config sections it needs; none
calls back into an earlier one. api.fit is these five calls; sparkdl.plan the first three.

Entry-point code (docs/architecture.md, "Layering": composition happens here and in api, estimator
and cli): the whole RunConfig stops at these functions; what they call below takes its sections.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable

from sparkdl.config import RunConfig
from sparkdl.config.elastic import is_elastic
from sparkdl.data.feed import PreparedData
from sparkdl.data.layout import FeedLayout
from sparkdl.data.prepare import PreparedRuns
from sparkdl.driver.attempts import tracked_submit
from sparkdl.driver.callbacks import resolve_callbacks
from sparkdl.driver.checks import (before_training, check_enough_rows, check_output_width, check_picklable,
                                   check_training_options, check_weighted_loss, drop_labels_beyond_the_model)
from sparkdl.driver.model_probe import check_activation_checkpointing, probe_model, probe_tensor_model
from sparkdl.driver.planning import check_kept_world, resolve
from sparkdl.driver.model_inputs import bind_model_inputs
from sparkdl.driver.shipping import ship_by_value
from sparkdl.errors import ConfigError, ModelError
from sparkdl.model.trained import (ModelParts, add_frozen_part, check_complete, load_parts,
                                   real_where_state_cannot_reach)
from sparkdl.model.trained_state import held_frozen_keys
from sparkdl.planner.resolved import ResolvedPlan
from sparkdl.tracking.fit_records import fit_extras, input_example, run_params
from sparkdl.tracking.phases import Phases
from sparkdl.tracking.serving import ServedModel
from sparkdl.wire.spec import TrainSpec
from sparkdl.wire.stopping import stop_tags

if TYPE_CHECKING:
    import torch
    from pyspark.sql import DataFrame, SparkSession

    from sparkdl.data.assemble import SampleBatch
    from sparkdl.driver.callbacks import Callback
    from sparkdl.tracking.mlflow_run import RunTracker
    from sparkdl.wire.spec import ModelSpec

_log = logging.getLogger("sparkdl")


@dataclass
class FitResult:
    module: "torch.nn.Module"  # the trained module on the driver
    history: list[dict[str, Any]]
    layout: FeedLayout
    output_kind: str
    config: RunConfig
    run_id: str
    extra: dict[str, Any] = field(default_factory=dict)
    plan: ResolvedPlan | None = None  # the layout it trained with (reusable: TorchEstimator(plan=...))


@dataclass(frozen=True)
class FitRequest:
    """validate's record: the options checked, the model resolved, the slots there."""

    config: RunConfig
    model: ModelSpec  # an nn.Module, a zero-argument callable or a list of layer factories
    callbacks: tuple[Callback, ...]  # train.callbacks resolved to callables (driver only: never shipped)
    kept: ResolvedPlan | None  # the plan to train with instead of planning (plan= / plan_from_run / plan_file)
    spark: SparkSession  # classic or Connect


@dataclass(frozen=True)
class FitData:
    """prepare_data's record: the rows dealt to ranks, and the model probed on them."""

    prepared: PreparedData
    module: "torch.nn.Module"  # the driver's (meta) copy, probed
    out_width: int  # the output width the loss sees
    sample: SampleBatch | None  # the probe batch (input_cols) or None
    out_shape: tuple[int, ...]  # the per-row output shape ((), for a flat output)


@dataclass(frozen=True)
class FitPlan:
    """plan_fit's record: the layout to train with and the one object shipped to every rank."""

    resolved: ResolvedPlan
    config: RunConfig  # final: the resolved plan's strategy options merged in
    spec: TrainSpec


@dataclass(frozen=True)
class FitRun:
    """launch's record: what the barrier job(s) returned, and the MLflow run they were tracked in."""

    tracker: RunTracker
    parts: ModelParts
    history: list[dict[str, Any]]


def spark_of(df: Any = None) -> Any:
    if df is not None:
        return df.sparkSession
    from pyspark.sql import SparkSession

    return SparkSession.getActiveSession() or SparkSession.builder.getOrCreate()


def with_plan(config: RunConfig, resolved: ResolvedPlan) -> RunConfig:
    """The run's final configuration: the resolved plan's train section in place of the user's."""
    return replace(config, train=resolved.train) if resolved.train is not None else config


def validate(df: DataFrame, model: ModelSpec, config: RunConfig, plan: ResolvedPlan | str | None) -> FitRequest:
    """Stage 1: options, the model, a kept plan, the DataFrame's columns, the slots and preflight."""
    from sparkdl.data.feed import check_columns
    from sparkdl.driver.job import ensure_training_slots

    config.validate()
    check_weighted_loss(config.data, config.train)
    callbacks = tuple(resolve_callbacks(config.train.callbacks))
    model = the_model(model, config)
    config = replace(config, data=bind_model_inputs(config.data, config.train, model))
    kept = kept_plan(plan, config)
    if kept is not None:
        check_kept_world(kept, config.launch)
    check_columns(df, input_columns(config) + ([] if labels_from_text(config.data) else [label_col(config)]))
    spark = spark_of(df)
    ensure_training_slots(spark, config.launch.num_workers, config.launch)
    before_training(spark, config.train, config.launch, config.launch.num_workers)
    return FitRequest(config, model, callbacks, kept, spark)


def prepare_data(df: DataFrame, validation_df: DataFrame | None, request: FitRequest, phases: Phases,
                 shared: PreparedRuns | None = None) -> FitData:
    """Stage 2: the data stage (one stats job, shards; `shared`: taken from an earlier fit of the
    same tuning grid where its options allow), the model probed on real rows, and every check that
    needs both."""
    from sparkdl.data.prepare import prepare_run

    config = request.config
    if shared is not None:
        prepared = shared.prepared(df, config.data, config.train, config.launch, validation_df)
    else:
        prepared = prepare_run(df, config.data, config.train, config.launch, validation_df)
    phases.mark("prepare")
    module, out_width, sample, out_shape = probe(request.model, config, prepared)
    check_activation_checkpointing(config.train, module)
    prepared = drop_labels_beyond_the_model(config.data, config.train, config.launch, prepared, out_width)
    check_output_width(config.data, config.train, out_width, prepared.layout.num_classes, label_shape(prepared.layout))
    check_enough_rows(config.data, config.launch, prepared.num_rows)
    check_training_options(config.train, config.launch, request.spark, prepared, out_shape or (out_width,))
    return FitData(prepared, module, out_width, sample, out_shape)


def plan_fit(request: FitRequest, data: FitData) -> FitPlan:
    """Stage 3: the resolved plan (kept, named, or the planner's under "auto") and the TrainSpec."""
    config = request.config
    resolved = resolve(data.module, config.data, config.train, config.launch, config.tracking, data.prepared.layout,
                       request.spark, data.prepared.num_rows, plan=request.kept, sample=data.sample,
                       embeddings=config.embeddings, rows=data.prepared.df)
    config = with_plan(request.config, resolved)
    return FitPlan(resolved, config, train_spec(request.model, config, data.prepared, resolved))


def launch(df: DataFrame, validation_df: DataFrame | None, request: FitRequest, data: FitData, planned: FitPlan,
           phases: Phases) -> FitRun:
    """Stage 4: the MLflow run, then the barrier job (resubmitted, resized when elastic)."""
    config, spec = planned.config, planned.spec
    tracker = start_tracking(config, df, data.prepared, planned.resolved, spec.run_id)
    phases.mark("tracking")
    resize = resizer(df, validation_df, request.model, (data.module, data.sample), config, planned.resolved,
                     spec.run_id) if is_elastic(config.launch) else None
    parts, history = tracked_submit(request.spark, data.prepared.launch_df(), spec, tracker,
                                    callbacks=list(request.callbacks), resize=resize)
    return FitRun(tracker, parts, history)


def collect(df: DataFrame, request: FitRequest, data: FitData, planned: FitPlan, ran: FitRun, phases: Phases) -> FitResult:
    """Stage 5: the trained model read from the ranks' parts, logged to MLflow, the run finished
    (FAILED on any exception on the way, Ctrl-C included: never left RUNNING)."""
    with ran.tracker.ends_failed():
        return _collected(df, request, data, planned, ran, phases)


def _collected(df: DataFrame, request: FitRequest, data: FitData, planned: FitPlan, ran: FitRun,
               phases: Phases) -> FitResult:
    config, prepared, tracker = planned.config, data.prepared, ran.tracker
    log_prediction(tracker, planned.resolved, ran.history)
    tracker.set_tags(stop_tags(ran.history))
    kind = output_kind(config, prepared.layout.label_dtype == "int64", data.out_width, data.out_shape)
    tracker.log_loss_curve(ran.history)
    module, model_uri = take_the_model(ran.parts, data.module, request.model, config, prepared, df,
                                       (kind, data.out_shape), tracker, phases)
    phases.mark("log_model")
    tracker.log_metric_points([(phases.metrics(), 0)])
    tracker.finish("FINISHED")
    extra = fit_extras(tracker, model_uri, data.out_shape, phases, prepared, ran.parts, config.output.load_model)
    return FitResult(module=module, history=ran.history, layout=prepared.layout, output_kind=kind, config=config,
                     run_id=planned.spec.run_id, plan=planned.resolved, extra=extra)


def output_kind(config: RunConfig, classification: bool, out_width: int, out_shape: tuple[int, ...] = ()) -> str:
    """How predictions are written (tracking/inference.py): "class" (B, C) -> long, "classes" (B, T, C) ->
    array<long> of length T, "binary", "value" (one number) or "values" (array<float>, flattened)."""
    if labels_from_text(config.data):
        return "text"  # a language model trained on its texts continues prompts (TorchModel.scoring for logits)
    if config.train.loss == "bce_with_logits":
        return "binary" if math.prod(out_shape or (1,)) == 1 else "values"
    if classification and len(out_shape) >= 2:
        return "classes"
    if classification:
        return "class" if out_width > 1 else "binary"
    return "value" if out_width == 1 and len(out_shape) <= 1 else "values"


def take_the_model(parts: ModelParts, module: Any, model: Any, config: RunConfig, prepared: Any, df: Any,
                    output: tuple[str, tuple[int, ...]], tracker: Any, phases: Phases) -> tuple[Any, str | None]:
    """(the driver's module, the MLflow model's URI): every part checked, read into the module unless
    output.load_model is off, the MLflow model logged from the files. The files go once the model is
    in memory, or on any failure; a model left in them keeps them (ModelParts.remove_when_unused)."""
    load = config.output.load_model
    try:
        module = real_where_state_cannot_reach(module, model, config.train.seed)
        if tracker.run_id or not load:  # their files must make the whole model: frozen weights come from here
            add_frozen_part(parts, module)
        check_complete(module, parts.tensor_names() | held_frozen_keys(module))
        if load:
            load_parts(module, parts.files)
        module.eval()
        phases.mark("load_model")
        serving = ServedModel(module, prepared.layout, output[0], config.data.transform_fn, explicit_dtypes(config),
                              output[1], config.data.prediction_col)
        model_uri = tracker.log_model(serving, input_example(df, prepared.layout, sample=prepared.sample),
                                      parts.local_directory(), loaded=load) if tracker.run_id else None
    except BaseException:
        parts.remove()
        raise
    if load:
        parts.remove()
    return module, model_uri


def probe(model: Any, config: RunConfig, prepared: Any) -> tuple[Any, int, Any, tuple[int, ...]]:
    """(module, output width the loss sees, probe batch, per-row output shape): a zero batch of the
    feature width (no batch, shape ()), or (input_cols) a few real rows through the executors'
    conversion and transform_fn."""
    if prepared.layout.sparse:
        from sparkdl.driver.embedding_plan import probe_embedding_model

        return probe_embedding_model(model, config.data, config.train, prepared.layout, prepared.sample)
    if prepared.layout.tensor_inputs:
        return probe_tensor_model(model, config.data, config.train, prepared.layout, prepared.sample)
    module, out_width = probe_model(model, config.data, config.train, prepared.layout.num_features)
    return module, out_width, None, ()


def label_shape(layout: Any) -> tuple[int, ...]:
    return tuple(layout.label.shape) if layout.label is not None else ()


def explicit_dtypes(config: RunConfig) -> frozenset[str]:
    return frozenset(config.data.input_dtypes or {})


def the_model(model: Any, config: RunConfig) -> Any:
    if model is None and config.model.factory:
        from sparkdl.model.objectives import import_factory

        model = import_factory(config.model.factory)
    if model is None:
        raise ModelError("no model was given", hint="pass model=nn.Module(...) or a zero-argument callable, "
                                                    "or set model.factory='package.module:function'")
    return model


def input_columns(config: RunConfig) -> list[str]:
    """The DataFrame columns the model reads (input_cols, or feature_cols), plus weight_col."""
    from sparkdl.config.values import input_columns

    data = config.data
    used = input_columns(data) if data.input_cols is not None else list(data.feature_cols)
    return used + ([data.weight_col] if data.weight_col else [])


def labels_from_text(data: Any) -> bool:
    """A run whose texts are their own labels (a causal LM from a text column, data/text.py)."""
    return data.tokenizer is not None and data.label_col is None


def label_col(config: RunConfig) -> str:
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


def train_spec(model: Any, config: RunConfig, prepared: Any, resolved: ResolvedPlan, run_id: str = "") -> Any:
    from sparkdl.data.epochs import check_shards
    from sparkdl.driver.job import new_run_id
    from sparkdl.wire.replan import replan_figures
    from sparkdl.wire.spec import TrainSpec

    row_counts = prepared.training_shards(config.launch.num_workers)  # ranks stream epoch 1 on these counts
    check_shards(row_counts, config.data)  # an empty shard or no full batch: raised here, before the job
    layout, rows = prepared.layout, prepared.num_rows + prepared.num_validation_rows

    train = config.train
    ship_by_value(model, train.loss, train.optimizer, config.data.transform_fn, train.lr_schedule, *train.metrics,
                  spark=prepared.df.sparkSession)
    # Callbacks run on the driver (a notebook's plots): the executors only learn that there are some.
    # An elastic run that may grow asks the driver at every epoch end, as callbacks do.
    asks = bool(train.callbacks) or config.launch.grow_workers
    spec = TrainSpec(run_id=run_id or train.resume_run or new_run_id(), data=config.data,
                     train=replace(train, callbacks=()), launch=config.launch, tracking=config.tracking,
                     layout=layout, model=model,
                     strategy_layout=resolved.layout, driver_callbacks=asks, rows=rows,
                     row_counts=row_counts, source=prepared.source, packed_rows=prepared.packed is not None,
                     replan=replan_figures(resolved.auto, train))
    check_picklable(spec)
    return spec


def resizer(df: Any, validation_df: Any, model: Any, probed: tuple[Any, Any], config: RunConfig,
             resolved: ResolvedPlan, run_id: str) -> Callable[[int, Any], tuple[Any, Any]]:
    """An elastic run's re-plan for another number of workers (driver/elastic.py): the data
    re-sharded, the layout resolved again for the strategy the run trains with (a checkpoint
    carries over within its strategy), the global batch kept, the same run id (its checkpoints)."""
    from sparkdl.config.elastic import worker_range
    from sparkdl.data.prepare import prepare_run
    from sparkdl.driver.elastic import kept_batch

    trained = with_plan(config, resolved)
    accumulate = trained.train.accumulate_steps
    global_batch = config.data.batch_size * config.launch.num_workers * accumulate
    low, high = worker_range(config.launch)

    def resize(workers: int, change: Any) -> tuple[Any, Any]:
        sized = trained.merged({"launch": {"num_workers": workers, "min_workers": low, "max_workers": high},
                                "data": {"batch_size": kept_batch(global_batch, accumulate, workers)}}).validate()
        prepared = prepare_run(df, sized.data, sized.train, sized.launch, validation_df)
        again = resolve(probed[0], sized.data, sized.train, sized.launch, sized.tracking, prepared.layout,
                        spark_of(df), prepared.num_rows, sample=probed[1], embeddings=sized.embeddings,
                        rows=prepared.df)
        return prepared.launch_df(), train_spec(model, with_plan(sized, again), prepared, again, run_id=run_id)
    return resize


def start_tracking(config: RunConfig, df: Any, prepared: Any, resolved: ResolvedPlan, run_id: str) -> Any:
    from sparkdl.tracking.mlflow_run import RunTracker

    t = config.tracking
    tracker = RunTracker(t.tracking, t.tracking_uri, t.experiment, t.run_name)
    tracker.start(params={**run_params(config.flat(), config.data, config.launch.num_workers, df, prepared),
                  **resolved.as_params()}, tags={"sparkdl.run_id": run_id})
    tracker.log_text(resolved.explain(), "plan.txt")  # the planner's table under "auto", then the layout
    tracker.log_text(resolved.to_json(), "plan.json")  # the same plan as a value: TorchEstimator(plan_from_run=...)
    return tracker


def log_prediction(tracker: Any, resolved: ResolvedPlan, history: list[dict[str, Any]]) -> None:
    """Beside the planner's prediction: the measured step time of the last epoch (data loading included)."""
    choice = resolved.choice
    if choice is not None and history and history[-1].get("steps"):
        measured = 1e3 * history[-1]["seconds"] / history[-1]["steps"]
        tracker.log_metric_points([({"plan_measured_step_ms": measured,
                                     "plan_predicted_step_ms": 1e3 * choice.predicted_step_s}, 0)])
