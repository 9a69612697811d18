"""Driver entry points: fit, run and predict. Composes config, data feed, launch and inference."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from sparkdl.config import RunConfig
from sparkdl.errors import ConfigError, ModelError
from sparkdl.launch.attempts import tracked_submit
from sparkdl.launch.shipping import ship_by_value
from sparkdl.planning import make_plan, measured_links, plan_strategy, settle_without_planner
from sparkdl.scoring import check_gpus_per_task, check_inference_batch_size, predict  # noqa: F401 - public here

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


def _spark(df: Any = None) -> Any:
    if df is not None:
        return df.sparkSession
    from pyspark.sql import SparkSession

    return SparkSession.getActiveSession() or SparkSession.builder.getOrCreate()


def label_is_integral(df: Any, label_col: str | None) -> bool:
    from pyspark.sql import types as T

    if label_col is None or label_col not in df.columns:
        return False
    return isinstance(df.schema[label_col].dataType, (T.IntegralType, T.BooleanType))


def output_kind(config: RunConfig, classification: bool, out_width: int) -> str:
    if config.train.loss == "bce_with_logits":
        return "binary"
    if classification:
        return "class" if out_width > 1 else "binary"
    return "value" if out_width == 1 else "values"


def probe_model(model: Any, config: RunConfig, num_features: int) -> tuple[Any, int]:
    """Build the model on the driver and run one zero batch through it, so a wrong model or input
    width fails here in seconds instead of on every executor."""
    import torch

    from sparkdl.launch.objectives import build_model

    module = build_model(model, config.train.seed)
    module.eval()
    try:
        with torch.no_grad():
            out = module(torch.zeros(2, num_features))
    except Exception as exc:  # noqa: BLE001 - any failure here is a model/input mismatch
        raise ModelError(f"the model cannot take a batch of {num_features} features "
                         f"(from feature_cols {list(config.data.feature_cols)}): {type(exc).__name__}: {exc}",
                         hint="make the first layer's input width match the number of feature values") from None
    if not isinstance(out, torch.Tensor) or out.dim() < 1 or out.shape[0] != 2:
        raise ModelError("the model must return one tensor with the batch as its first dimension",
                         hint="return logits/values of shape (batch, outputs)")
    return module, int(out[0].numel())


def check_output_width(config: RunConfig, out_width: int, num_classes: int | None) -> None:
    """The model's output must fit the built-in loss, or every executor fails on its first step."""
    loss = config.train.loss
    if loss == "cross_entropy":
        need = max(2, num_classes or 2)
        if out_width < need:
            raise ModelError(f"loss 'cross_entropy' needs one logit per class: label column "
                             f"{config.data.label_col!r} holds {num_classes} classes but the model outputs "
                             f"{out_width} value(s) per row",
                             hint=f"make the last layer output {need}, or use loss='bce_with_logits' "
                                  "with one output for two classes")
    elif loss in ("mse", "bce_with_logits") and out_width != 1:
        raise ModelError(f"loss {loss!r} compares one output per row with the scalar label column "
                         f"{config.data.label_col!r}, but the model outputs {out_width} values per row",
                         hint="make the last layer output 1, or pass a callable loss")


def drop_labels_beyond_the_model(config: RunConfig, prepared: Any, out_width: int) -> Any:
    """on_invalid="skip" with cross-entropy: class indices the model has no logit for are invalid
    labels too; those rows are dropped (one more counting job), others still raise."""
    from dataclasses import replace

    from pyspark.sql import functions as F

    from sparkdl.data.layout import LABEL_COLUMN
    from sparkdl.errors import EmptyDataError

    classes = prepared.layout.num_classes
    if config.data.on_invalid != "skip" or config.train.loss != "cross_entropy" or not classes \
            or classes <= out_width or out_width < 2:
        return prepared
    kept = prepared.df.filter(F.col(LABEL_COLUMN) < out_width)
    split = prepared.layout.split_column
    rows = kept.filter(F.col(split) == 0).count() if split else kept.count()
    dropped = prepared.num_rows - rows
    if rows == 0:
        raise EmptyDataError(f"every label of {config.data.label_col!r} is a class index >= the model's "
                             f"{out_width} outputs", hint=f"make the last layer output {classes}")
    _log.warning("sparkdl: on_invalid='skip' dropped %d rows whose label is a class index >= the model's %d "
                 "outputs", dropped, out_width)
    return replace(prepared, df=kept.repartition(config.launch.num_workers), num_rows=rows,
                   dropped_rows=prepared.dropped_rows + dropped,
                   layout=replace(prepared.layout, num_classes=out_width))


def check_enough_rows(config: RunConfig, num_rows: int) -> None:
    workers, batch = config.launch.num_workers, config.data.batch_size
    if num_rows < workers:
        raise ConfigError(f"the DataFrame has {num_rows} row(s), fewer than num_workers={workers}: "
                          "some workers would get no data", hint=f"use num_workers <= {num_rows}")
    if config.data.drop_last and num_rows // workers < batch:
        raise ConfigError(f"drop_last=True with batch_size={batch} drops everything: each of the {workers} "
                          f"workers gets about {num_rows // workers} rows",
                          hint="lower batch_size or set drop_last=False")


def check_backend(config: RunConfig) -> None:
    """A missing backend, or one lacking an operation the strategy needs, fails here, not on every
    executor after the data was shipped."""
    from sparkdl.comm import backend_class
    from sparkdl.strategies import strategy_class

    # "auto" is resolved to a concrete strategy before this check in fit; a custom loop has none.
    requires = strategy_class(config.train.strategy).requires if config.train.strategy != "auto" else frozenset()
    missing = requires - backend_class(config.launch.backend).ops
    if missing:
        raise ConfigError(f"train.strategy={config.train.strategy!r} needs {', '.join(sorted(missing))}, which "
                          f"launch.backend={config.launch.backend!r} does not provide",
                          hint="use backend='torch' (torch.distributed has point-to-point and subgroups)")
    if config.launch.backend == "horovod":
        from sparkdl.comm.horovod import import_horovod

        import_horovod()


def preflight(spark: Any, workers: int, gpus_per_worker: int = 0) -> None:
    """The JVM bridge's checks besides the slot count (which ensure_slots waits for): dynamic
    allocation, executor GPUs without task GPU amounts (unless the training stage asks for GPUs
    itself, launch.gpus_per_worker). Also attaches BarrierWatch, whose events explain failures.
    Without the bridge (no jar, Spark Connect) nothing happens."""
    from sparkdl import jvm

    jvm.attach(spark)
    report = jvm.preflight(spark, workers)
    skipped = {"slots"} | ({"task_gpus"} if gpus_per_worker else set())
    problems = [p for p in (report or {}).get("problems", []) if p.get("code") not in skipped]
    if problems:
        raise ConfigError("; ".join(p["message"] for p in problems), hint="; ".join(p["fix"] for p in problems))


def plan(model: Any, df: Any, config: RunConfig | None = None, **options: Any) -> Any:
    """The Plan a fit with these options would follow (strategy="auto"), without training:
    `plan.strategy`, `plan.candidates`, `plan.explain()`."""
    from sparkdl.data.feed import check_columns, prepare
    from sparkdl.launch.objectives import is_classification

    config = RunConfig.from_kwargs(base=config, **options).validate()
    data = config.data
    check_columns(df, list(data.feature_cols) + ([data.label_col] if data.label_col else []))
    classification = is_classification(config.train, label_is_integral(df, data.label_col))
    prepared = prepare(df, data.feature_cols, data.label_col, classification=classification,
                       num_workers=config.launch.num_workers, seed=config.train.seed, on_invalid=data.on_invalid)
    module, _ = probe_model(model, config, prepared.layout.num_features)
    return make_plan(module, config.merged({"tracking": {"progress": False}}), prepared.layout.num_features,
                     _spark(df), prepared.num_rows)


def check_picklable(spec: Any) -> None:
    """Everything in the TrainSpec must reach the executors; say which part cannot, before the job."""
    from sparkdl.launch.worker import _dumps_any

    for name in ("model", "train_fn", "config"):
        value = getattr(spec, name)
        try:
            _dumps_any(value)
        except Exception as exc:  # noqa: BLE001 - pickling raises many types
            what = {"model": "the model", "train_fn": "train_fn", "config": "the loss or optimizer"}[name]
            raise ModelError(f"{what} cannot be sent to the executors: {type(exc).__name__}: {exc}",
                             hint="it (or something it refers to, e.g. a SparkSession, DataFrame, lock or "
                                  "open file) must be picklable; create such objects inside the function") from None


def fit(df: Any, model: Any, config: RunConfig, validation_df: Any = None) -> FitResult:
    from sparkdl.data.feed import check_columns, prepare
    from sparkdl.launch.driver import ensure_training_slots, new_run_id
    from sparkdl.launch.objectives import is_classification
    from sparkdl.launch.spec import TrainSpec

    config.validate()
    if model is None and config.model.factory:
        from sparkdl.launch.objectives import import_factory

        model = import_factory(config.model.factory)
    if model is None:
        raise ModelError("no model was given", hint="pass model=nn.Module(...) or a zero-argument callable, "
                                                    "or set model.factory='package.module:function'")
    data = config.data
    if data.label_col is None:
        raise ConfigError("data.label_col is None, but fitting needs a label",
                          hint="pass label_col=..., or use sparkdl.run for a custom loop without labels")
    check_columns(df, list(data.feature_cols) + [data.label_col])
    ensure_training_slots(_spark(df), config.launch.num_workers, config.launch)
    preflight(_spark(df), config.launch.num_workers, config.launch.gpus_per_worker)
    classification = is_classification(config.train, label_is_integral(df, data.label_col))
    prepared = prepare(df, data.feature_cols, data.label_col, classification=classification,
                       num_workers=config.launch.num_workers, validation_df=validation_df,
                       validation_fraction=data.validation_fraction, seed=config.train.seed,
                       on_invalid=data.on_invalid)
    module, out_width = probe_model(model, config, prepared.layout.num_features)
    prepared = drop_labels_beyond_the_model(config, prepared, out_width)
    check_output_width(config, out_width, prepared.layout.num_classes)
    check_enough_rows(config, prepared.num_rows)
    auto_plan = None
    config = settle_without_planner(config)
    if config.train.strategy == "auto":
        auto_plan = make_plan(module, config, prepared.layout.num_features, _spark(df), prepared.num_rows,
                              fallback=True)
        config = config.merged({"train": auto_plan.options if auto_plan is not None else {"strategy": "data_parallel"}})
    check_backend(config)
    links = auto_plan.executor_links if auto_plan is not None else measured_links(_spark(df), config)
    plan, plan_params = plan_strategy(module, config, prepared.layout, links)
    if auto_plan is not None:
        plan_params.update(auto_plan.as_params())
    ship_by_value(model, config.train.loss, config.train.optimizer)
    spec = TrainSpec(run_id=new_run_id(), config=config, layout=prepared.layout, model=model, plan=plan)
    check_picklable(spec)
    tracker = new_tracker(config)
    tracker.start(params={**run_params(config, df, prepared), **plan_params}, tags={"sparkdl.run_id": spec.run_id})
    if auto_plan is not None:
        tracker.log_text(auto_plan.explain(), "plan.txt")
    state, history = tracked_submit(_spark(df), prepared.df, spec, tracker)
    if auto_plan is not None and history and history[-1].get("steps"):
        # Beside the prediction: the measured step time of the last epoch (data loading included).
        measured = 1e3 * history[-1]["seconds"] / history[-1]["steps"]
        tracker.log_metric_points([({"plan_measured_step_ms": measured,
                                     "plan_predicted_step_ms": 1e3 * auto_plan.choice.predicted_step_s}, 0)])
    module.load_state_dict(state)
    module.eval()
    kind = output_kind(config, classification, out_width)
    tracker.log_loss_curve(history)
    model_uri = tracker.log_model(module, input_example(df, prepared.layout)) if tracker.run_id else None
    tracker.finish("FINISHED")
    return FitResult(module=module, history=history, layout=prepared.layout, output_kind=kind, config=config,
                     run_id=spec.run_id, extra={"mlflow_run_id": tracker.run_id, "model_uri": model_uri,
                                                "tracking_uri": tracker.tracking_uri})


def new_tracker(config: RunConfig) -> Any:
    from sparkdl.tracking import RunTracker

    t = config.tracking
    return RunTracker(t.tracking, t.tracking_uri, t.experiment, t.run_name)


def run_params(config: RunConfig, df: Any, prepared: Any) -> dict[str, Any]:
    """Every option (flattened), the dataset and the versions: what makes a run reproducible
    (credentials redacted)."""
    from sparkdl.tracking import redact, versions

    params: dict[str, Any] = dict(config.flat())
    used = list(config.data.feature_cols) + ([config.data.label_col] if config.data.label_col else [])
    types = dict(df.dtypes)
    params.update({
        "dataset.rows": prepared.num_rows, "dataset.validation_rows": prepared.num_validation_rows,
        "dataset.columns": ", ".join(f"{c}:{types.get(c)}" for c in used),
        "dataset.num_features": prepared.layout.num_features, "dataset.source": _source(df),
        "dataset.dropped_invalid_rows": prepared.dropped_rows,
        "world.workers": config.launch.num_workers, "world.master": df.sparkSession.sparkContext.master,
    })
    params.update(versions())
    return redact(params)


def _source(df: Any) -> str:
    try:
        files = df.inputFiles()
    except Exception:  # noqa: BLE001 - not every plan can list its files
        files = []
    return ", ".join(files[:5]) + (f" (+{len(files) - 5} more)" if len(files) > 5 else "") if files else "in-memory/derived"


def input_example(df: Any, layout: Any, rows: int = 5) -> Any:
    """A few rows of features as the model sees them: a pandas frame of the scalar feature columns,
    or a float32 array when array/vector columns are involved."""
    import numpy as np

    from sparkdl.data.feed import features_expression, feature_kind

    cols = list(layout.source_feature_cols)
    if all(feature_kind(df, c) == "scalar" for c in cols):
        return df.select(*cols).limit(rows).toPandas()
    values = [r[0] for r in df.select(features_expression(df, cols)).limit(rows).collect()]
    return np.asarray(values, dtype=np.float32)


def run(train_fn: Callable[[Any], Any], df: Any = None, num_workers: int = 2, **options: Any) -> Any:
    """Call train_fn(ctx) on every rank of a barrier job; returns rank 0's return value."""
    from sparkdl.data.feed import prepare
    from sparkdl.launch.driver import ensure_training_slots, new_run_id
    from sparkdl.launch.spec import TrainSpec

    if not callable(train_fn):
        raise ConfigError(f"train_fn must be callable, got {type(train_fn).__name__}",
                          hint="def train_fn(ctx): ... ; sparkdl.run(train_fn, df=df)")
    config = RunConfig.from_kwargs(num_workers=num_workers, **options)
    if df is not None:
        label = config.data.label_col if config.data.label_col in df.columns else None
        features = config.data.feature_cols or tuple(c for c in df.columns if c != label)
        config = config.merged({"data": {"feature_cols": tuple(features), "label_col": label}})
    if df is not None:
        config.validate()
    else:
        # No DataFrame: the data section (feature columns) does not apply.
        config.train.validate()
        config.launch.validate()
    spark = _spark(df)
    ensure_training_slots(spark, num_workers, config.launch)
    preflight(spark, num_workers, config.launch.gpus_per_worker)
    if df is not None:
        classification = config.train.task == "classification" or (
            config.train.task == "auto" and label_is_integral(df, config.data.label_col))
        prepared = prepare(df, config.data.feature_cols, config.data.label_col,
                           classification=classification, num_workers=num_workers,
                           on_invalid=config.data.on_invalid)
        if prepared.num_rows < num_workers:
            check_enough_rows(config, prepared.num_rows)
        job_df, layout = prepared.df, prepared.layout
    else:
        job_df, layout = spark.range(0, num_workers, 1, num_workers), None
    ship_by_value(train_fn)
    spec = TrainSpec(run_id=new_run_id(), config=config, layout=layout, train_fn=train_fn)
    check_picklable(spec)
    check_backend(config)
    from sparkdl.tracking import RunTracker

    # A custom loop gets the driver channel too (rank 0's output, the failing rank's own error),
    # but no MLflow run: what it trains and logs is its own business.
    result, _ = tracked_submit(spark, job_df, spec, RunTracker(enabled=False))
    return result
