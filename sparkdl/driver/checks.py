"""The checks a run passes on the driver before any barrier job starts (the model against its input
and loss: driver/model_probe.py): the rows against the workers, the backend against the strategy,
what must pickle, the JVM bridge's preflight, and the scoring options. Each raises a SparkdlError naming the option
or column and the fix, in seconds instead of after the data was shipped to every executor.
"""
from __future__ import annotations

import logging
from typing import Any

from sparkdl.config import DataConfig, LaunchConfig, TrainConfig
from sparkdl.errors import ConfigError, ModelError
from sparkdl.spark.session import facts, is_connect, warn_once

_log = logging.getLogger("sparkdl")


def check_weighted_loss(data: DataConfig, train: TrainConfig) -> None:
    """weight_col with a callable loss: the callable must take the weights (weight=); loss="model"
    cannot weigh rows (the model averages its own loss)."""
    from sparkdl.strategies.inputs import takes_weight

    loss = train.loss
    if data.weight_col is not None and loss == "model":
        raise ConfigError(f"data.weight_col={data.weight_col!r} cannot weigh loss='model' (the model averages its own "
                          "loss)", hint="use loss='causal_lm' or 'cross_entropy', which weigh rows exactly, or drop "
                                        "weight_col")
    if data.weight_col is not None and callable(loss) and not takes_weight(loss):
        raise ConfigError(f"data.weight_col={data.weight_col!r} needs a loss that uses the weights, but the "
                          "loss callable takes no weight= argument",
                          hint="add a weight=None keyword to the loss, or use a built-in loss")


def check_strategy_inputs(train: TrainConfig, layout: Any) -> None:
    """IST deals the neurons of an MLP on one feature vector: nothing else (planner/candidates.py
    marks it infeasible under "auto")."""
    if train.strategy == "ist" and layout is not None and layout.weight_column:
        raise ConfigError("strategy='ist' trains without per-row weights (its subnets average plain losses)",
                          hint="drop weight_col, or use strategy='data_parallel' or 'hybrid'")
    if train.strategy == "ist" and layout is not None and layout.tensor_inputs:
        raise ConfigError("strategy='ist' trains MLPs on one float feature vector (feature_cols); input_cols "
                          "runs cannot use it", hint="use strategy='data_parallel' (or sync='diloco'), 'hybrid' or "
                                                     "'auto'")


def check_output_width(data: DataConfig, train: TrainConfig, out_width: int, num_classes: int | None,
                       label_shape: tuple[int, ...] = ()) -> None:
    """The model's output must fit the built-in loss, or every executor fails on its first step.
    (Array labels: the loss already ran on the probe batch; only the class count is left.)"""
    loss = train.loss
    if label_shape and loss != "cross_entropy":
        return
    if loss == "cross_entropy":
        need = max(2, num_classes or 2)
        if out_width < need:
            where = "per position" if label_shape else "per row"
            raise ModelError(f"loss 'cross_entropy' needs one logit per class: label column "
                             f"{data.label_col!r} holds {num_classes} classes but the model outputs "
                             f"{out_width} value(s) {where}",
                             hint=f"make the last layer output {need}, or use loss='bce_with_logits' "
                                  "with one output for two classes")
    elif loss in ("mse", "bce_with_logits") and out_width != 1:
        raise ModelError(f"loss {loss!r} compares one output per row with the scalar label column "
                         f"{data.label_col!r}, but the model outputs {out_width} values per row",
                         hint="make the last layer output 1, or pass a callable loss")


def drop_labels_beyond_the_model(data: DataConfig, train: TrainConfig, launch: LaunchConfig, prepared: Any,
                                 out_width: int) -> Any:
    """on_invalid="skip" with cross-entropy: class indices the model has no logit for are invalid
    labels too; those rows are dropped (one more counting job), others still raise."""
    from dataclasses import replace

    from pyspark.sql import functions as F

    from sparkdl.data.layout import LABEL_COLUMN
    from sparkdl.errors import EmptyDataError

    classes = prepared.layout.num_classes
    if data.on_invalid != "skip" or train.loss != "cross_entropy" or not classes \
            or classes <= out_width or out_width < 2:
        return prepared
    label = prepared.layout.label
    largest = F.array_max(F.col(LABEL_COLUMN)) if label is not None and label.shape else F.col(LABEL_COLUMN)
    kept = prepared.df.filter(largest < out_width)
    split = prepared.layout.split_column
    rows = kept.filter(F.col(split) == 0).count() if split else kept.count()
    dropped = prepared.num_rows - rows
    if rows == 0:
        raise EmptyDataError(f"every label of {data.label_col!r} is a class index >= the model's "
                             f"{out_width} outputs", hint=f"make the last layer output {classes}")
    _log.warning("sparkdl: on_invalid='skip' dropped %d rows whose label is a class index >= the model's %d "
                 "outputs", dropped, out_width)
    from sparkdl.data.shards import balanced

    shuffled, counted_from = balanced(kept, launch.num_workers)
    return prepared.with_rows(shuffled, counted_from=counted_from, num_rows=rows,
                              dropped_rows=prepared.dropped_rows + dropped,
                              layout=replace(prepared.layout, num_classes=out_width))


def check_enough_rows(data: DataConfig, launch: LaunchConfig, num_rows: int) -> None:
    """Every rank gets rows and at least one step, as the workers will count them (epoch_plan over
    the round-robin shares prepare() gives)."""
    from sparkdl.data.epochs import epoch_plan, expected_row_counts

    workers, batch = launch.num_workers, data.batch_size
    if num_rows < workers:
        raise ConfigError(f"the DataFrame has {num_rows} row(s), fewer than num_workers={workers}: "
                          "some workers would get no data", hint=f"use num_workers <= {num_rows}")
    shards = expected_row_counts(num_rows, workers)
    if epoch_plan(shards, data).steps == 0:
        raise ConfigError(f"drop_last=True with batch_size={batch} drops everything: each of the {workers} "
                          f"workers gets at most {max(shards)} rows",
                          hint="lower batch_size or set drop_last=False")


def check_backend(train: TrainConfig, launch: LaunchConfig) -> None:
    """A missing backend, or one lacking an operation the strategy needs, fails here, not on every
    executor after the data was shipped."""
    from sparkdl.comm import backend_class
    from sparkdl.comm.base import SUBGROUP
    from sparkdl.strategies import strategy_class

    # "auto" is resolved to a concrete strategy before this check in fit; a custom loop has none.
    requires = strategy_class(train.strategy).requires if train.strategy != "auto" else frozenset()
    missing = requires - backend_class(launch.backend).ops
    if missing:
        raise ConfigError(f"train.strategy={train.strategy!r} needs {', '.join(sorted(missing))}, which "
                          f"launch.backend={launch.backend!r} does not provide",
                          hint="use backend='torch' (torch.distributed has point-to-point and subgroups)")
    from sparkdl.config.uneven import staleness_bounds

    if train.sync == "diloco" and staleness_bounds(train.max_staleness)[1] > 0 \
            and SUBGROUP not in backend_class(launch.backend).ops:
        raise ConfigError(f"train.max_staleness={train.max_staleness!r} overlaps whole rounds' syncs with training on "
                          f"a second process group, which launch.backend={launch.backend!r} cannot make",
                          hint="use backend='torch', or max_staleness=0")
    if train.sync == "diloco" and train.fragment_sync_delay and SUBGROUP not in backend_class(launch.backend).ops:
        raise ConfigError(f"train.fragment_sync_delay={train.fragment_sync_delay} overlaps each fragment's sync "
                          "with training on a second process group, which launch.backend="
                          f"{launch.backend!r} cannot make",
                          hint="use backend='torch', or fragment_sync_delay=0 (fragments still sync at staggered "
                               "steps)")
    if train.sync == "diloco" and train.islands and SUBGROUP not in backend_class(launch.backend).ops:
        raise ConfigError(f"train.islands needs a process group per island, which launch.backend="
                          f"{launch.backend!r} cannot make", hint="use backend='torch', or islands=0")
    if launch.backend == "horovod":
        from sparkdl.comm.horovod import import_horovod

        import_horovod()


def check_fragments(module: Any, train: TrainConfig) -> None:
    """Streaming DiLoCo deals top-level layers out to fragments: each fragment needs one."""
    train = train
    if train.sync != "diloco" or train.fragments == 1:
        return
    from sparkdl.strategies.diloco import layer_groups

    layers = len(layer_groups(module))
    if train.fragments > layers:
        raise ConfigError(f"train.fragments={train.fragments}, but the model has {layers} top-level layer(s) with "
                          "parameters (children of the model; a ModuleList or Sequential child counts its members)",
                          hint=f"use fragments <= {layers}")


def preflight(spark: Any, workers: int, gpus_per_worker: int = 0) -> None:
    """The JVM bridge's checks besides the slot count (which ensure_slots waits for): dynamic
    allocation, executor GPUs without task GPU amounts (unless the training stage asks for GPUs
    itself, launch.gpus_per_worker). Also attaches BarrierWatch, whose events explain failures.
    Without the bridge (no jar, Spark Connect) nothing happens."""
    from sparkdl.spark import jvm

    if is_connect(spark):
        warn_once("jvm-bridge", "Spark Connect session: the JVM bridge is off (no driver JVM on this side), so "
                                "a lost executor is reported by the ranks' own errors, without Spark's executor "
                                "events, and Preflight's dynamic-allocation and GPU checks do not run")
        return
    jvm.attach(spark)
    report = jvm.preflight(spark, workers)
    skipped = {"slots"} | ({"task_gpus"} if gpus_per_worker else set())
    problems = [p for p in (report or {}).get("problems", []) if p.get("code") not in skipped]
    if problems:
        raise ConfigError("; ".join(p["message"] for p in problems), hint="; ".join(p["fix"] for p in problems))


def before_training(spark: Any, train: TrainConfig, launch: LaunchConfig, workers: int) -> None:
    """The cluster checks of a training job: preflight, and the run's directories shared between
    the driver and the executors' hosts (sparkdl/storage/shared_paths.py)."""
    from sparkdl.storage.shared_paths import check_run_dirs

    from sparkdl.driver.channel_checks import check_channel_reachable

    check_channel_reachable(facts(spark).master(), launch.channel)
    preflight(spark, workers, launch.gpus_per_worker)
    check_run_dirs(spark, train, launch, workers)


def check_picklable(spec: Any) -> None:
    """Everything in the TrainSpec must reach the executors; say which part cannot, before the job."""
    from sparkdl.wire.codec import dumps_any

    for name in ("model", "train_fn", "data", "train"):
        value = getattr(spec, name)
        try:
            dumps_any(value)
        except Exception as exc:  # noqa: BLE001 - pickling raises many types
            what = {"model": "the model", "train_fn": "train_fn", "data": "transform_fn",
                    "train": "the loss, optimizer, lr schedule or a metric"}[name]
            raise ModelError(f"{what} cannot be sent to the executors: {type(exc).__name__}: {exc}",
                             hint="it (or something it refers to, e.g. a SparkSession, DataFrame, lock or "
                                  "open file) must be picklable; create such objects inside the function") from None


def check_picklable_value(value: Any, what: str) -> bytes:
    """`value` pickled by value for the executors; a ModelError naming `what` when it cannot be."""
    from sparkdl.wire.codec import dumps_any

    try:
        return dumps_any(value)
    except Exception as exc:  # noqa: BLE001 - pickling raises many types
        raise ModelError(f"{what} cannot be sent to the ranks: {type(exc).__name__}: {exc}",
                         hint="it (or something it refers to, e.g. a SparkSession, DataFrame, lock or open file) "
                              "must be picklable; create such objects inside the function") from None


def check_gpus_per_task(amount: float) -> None:
    """Spark's rule for task resource amounts: a whole number, or a fraction of one GPU."""
    import math

    if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not math.isfinite(amount) \
            or amount < 0 or (amount > 1 and float(amount) != int(amount)):
        raise ConfigError(f"inference GPUs per task must be 0 (CPU), a fraction <= 1 or a whole number; "
                          f"got {amount!r}",
                          hint="e.g. setInferenceGpus(0.25) lets 4 scoring tasks share each GPU")


def check_inference_batch_size(batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"the inference batch size must be a positive integer; got {batch_size!r}",
                           hint="setInferenceBatchSize(1024)")


def check_training_options(train: TrainConfig, launch: LaunchConfig, spark: Any, prepared: Any,
                           out_shape: tuple[int, ...]) -> None:
    """Before any job: early stopping watches a name the epoch records will hold, fp16 has GPUs
    to run on, and every train.metrics entry can be computed on this model's outputs (tried on
    zero outputs of the probed shape with labels of the run's kind)."""
    from sparkdl.config.training import check_monitored, early_stopping_options, metric_name

    train = train
    early = early_stopping_options(train.early_stopping)
    if early is not None:
        check_monitored(early["metric"], [metric_name(m) for m in train.metrics], prepared.num_validation_rows > 0,
                        prepared.layout.label_dtype == "int64")
    if train.precision == "16" and not launch.gpus_per_worker \
            and not float(facts(spark).conf("spark.task.resource.gpu.amount", "0") or 0):
        raise ConfigError("train.precision='16' needs CUDA GPUs, but the training tasks get none "
                          "(launch.gpus_per_worker=0, no spark.task.resource.gpu.amount)",
                          hint="use precision='bf16' (autocast on CPU and GPU), or set gpus_per_worker=1")
    if train.metrics and not prepared.num_validation_rows:
        raise ConfigError(f"train.metrics {list(metric_name(m) for m in train.metrics)} are computed on validation "
                          "rows, but this fit has none", hint="set validation_fraction (e.g. 0.2) or pass validation_df")
    if train.metrics:
        _check_metrics_on_outputs(train, prepared.layout, out_shape)


def _check_metrics_on_outputs(train: TrainConfig, layout: Any, out_shape: tuple[int, ...]) -> None:
    import torch

    from sparkdl.model.metrics import GatheredMetric, build_metrics

    label_shape = tuple(layout.label.shape) if layout.label is not None else ()
    classes = layout.label_dtype == "int64"
    output = torch.zeros((2, *out_shape))
    label = torch.zeros((2, *label_shape), dtype=torch.int64 if classes else torch.float32)
    for metric in build_metrics(train.metrics):
        try:
            if isinstance(metric, GatheredMetric):
                metric.collect(output, label)
            else:
                metric.partial(output, label)
        except Exception as exc:  # noqa: BLE001 - a callable metric can raise anything
            raise ConfigError(f"train.metrics {metric.name!r} cannot be computed on this model's outputs "
                              f"(per row {list(out_shape)}, {'class' if classes else 'float'} labels per row "
                              f"{list(label_shape)}): {type(exc).__name__}: {exc}",
                              hint="accuracy/top_k_accuracy/perplexity take class logits; mae/rmse values shaped "
                                   "like the label; auc binary or class scores") from None
