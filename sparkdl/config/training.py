"""Validators of the training-essential options: learning-rate schedules, precision, gradient
accumulation, validation metrics, early stopping and driver callbacks (TrainConfig's second half);
and the small sections around training (tracking, the CLI's input and output, a TOML run's model),
which config.py re-exports.

Split from config/values.py so that each stays small; like it, imports nothing from sparkdl but
errors and config_values, so every layer (the worker's metrics included) may use the name grammar.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

from sparkdl.config.values import check_islands, check_types, choice, positive_int, positive_int_or_zero, suggest
from sparkdl.errors import ConfigError

LR_SCHEDULES = ("constant", "linear", "cosine", "step")
PRECISIONS = ("32", "bf16", "16")
METRICS = ("accuracy", "top_k_accuracy", "perplexity", "mae", "rmse", "auc")
DEFAULT_TOP_K = 5
EARLY_STOPPING_KEYS = ("metric", "mode", "patience", "min_delta", "restore_best")
_TOP_K = re.compile(r"top_(\d+)_accuracy")


def parse_metric_name(name: str) -> tuple[str, int]:
    """(kind, k) of a built-in metric name: "top_k_accuracy" is top-5, "top_3_accuracy" top-3;
    k is 0 for the other kinds. ConfigError for an unknown name."""
    if name in METRICS:
        return name, DEFAULT_TOP_K if name == "top_k_accuracy" else 0
    match = _TOP_K.fullmatch(name) if isinstance(name, str) else None
    if match and int(match.group(1)) >= 1:
        return "top_k_accuracy", int(match.group(1))
    raise ConfigError(f"train.metrics names an unknown metric {name!r}",
                      hint=f"{suggest(str(name), METRICS)} (top_<k>_accuracy for another k), or a callable "
                           "(output, label) -> (sum, count)")


def metric_name(spec: Any) -> str:
    """The history name (without "val_") of one train.metrics entry: the built-in name as given, a
    callable's `metric_name` attribute, else its __name__."""
    if callable(spec):
        name = getattr(spec, "metric_name", None) or getattr(spec, "__name__", None)
        if not isinstance(name, str) or not name.isidentifier() or name == "<lambda>":
            raise ConfigError(f"train.metrics holds a callable without a usable name: {spec!r}",
                              hint="use a def (its __name__ names the metric) or set fn.metric_name = 'my_metric'")
        return name
    parse_metric_name(spec)
    return spec


def check_metrics(specs: Sequence[Any]) -> tuple[str, ...]:
    """Names of train.metrics, each once."""
    if isinstance(specs, str) or not isinstance(specs, (list, tuple)):
        raise ConfigError(f"train.metrics must be a list of metric names or callables, got {specs!r}",
                          hint='for example metrics=["accuracy", "top_k_accuracy"]')
    names = [metric_name(spec) for spec in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"train.metrics lists {twice} twice", hint="list each metric once")
    return tuple(names)


def check_schedule(train: Any) -> None:
    """lr_schedule and its parameters."""
    choice("train.lr_schedule", train.lr_schedule, LR_SCHEDULES, callable_ok=True)
    if callable(train.lr_schedule) and (train.warmup_steps or train.min_lr or train.step_every):
        raise ConfigError("train.warmup_steps/min_lr/step_every shape the built-in schedules, but lr_schedule is a "
                          "callable (your scheduler decides the lr)", hint="leave them unset, or build the warm-up "
                          "into your scheduler (e.g. torch.optim.lr_scheduler.SequentialLR)")
    for key in ("warmup_steps", "step_every"):
        value = getattr(train, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"train.{key} must be an integer >= 0, got {value!r}",
                              hint="warmup_steps counts optimizer steps; step_every 0 = once per epoch")
    if not 0 <= train.min_lr <= train.lr:
        raise ConfigError(f"train.min_lr must be in [0, lr={train.lr}], got {train.min_lr!r}",
                          hint="the floor a linear or cosine schedule decays to, e.g. min_lr=lr/10")
    if not 0 < train.step_gamma <= 1:
        raise ConfigError(f"train.step_gamma must be in (0, 1], got {train.step_gamma!r}",
                          hint='the factor lr_schedule="step" multiplies the lr by every step_every steps')


def check_precision(train: Any) -> None:
    choice("train.precision", train.precision, PRECISIONS)
    positive_int("train.accumulate_steps", train.accumulate_steps)


def early_stopping_options(value: Any) -> dict[str, Any] | None:
    """early_stopping with every key filled in (None: off); ConfigError naming a bad key."""
    if value is None or value is False:
        return None
    if not isinstance(value, dict):
        raise ConfigError(f"train.early_stopping must be a table of options, got {value!r}",
                          hint='for example early_stopping={"metric": "val_loss", "patience": 3}')
    unknown = sorted(set(value) - set(EARLY_STOPPING_KEYS))
    if unknown:
        raise ConfigError(f"train.early_stopping has an unknown key {unknown[0]!r}",
                          hint=suggest(unknown[0], EARLY_STOPPING_KEYS))
    metric = value.get("metric", "val_loss")
    if not isinstance(metric, str) or not metric:
        raise ConfigError(f"train.early_stopping.metric must be a history name such as 'val_loss', got {metric!r}")
    # Higher is better only for accuracies and AUC; losses, errors, perplexity and anything else: lower.
    default_mode = "max" if metric.endswith(("accuracy", "auc")) else "min"
    options = {"metric": metric, "mode": value.get("mode", default_mode), "patience": value.get("patience", 3),
               "min_delta": value.get("min_delta", 0.0), "restore_best": value.get("restore_best", True)}
    choice("train.early_stopping.mode", options["mode"], ("min", "max"))
    patience = options["patience"]
    if not isinstance(patience, int) or isinstance(patience, bool) or patience < 1:
        raise ConfigError(f"train.early_stopping.patience must be an integer >= 1, got {patience!r}",
                          hint="epochs without improvement before stopping")
    delta = options["min_delta"]
    if not isinstance(delta, (int, float)) or isinstance(delta, bool) or delta < 0:
        raise ConfigError(f"train.early_stopping.min_delta must be a number >= 0, got {delta!r}")
    if not isinstance(options["restore_best"], bool):
        raise ConfigError(f"train.early_stopping.restore_best must be true or false, got {options['restore_best']!r}")
    return options


def monitored_names(metrics: Sequence[str], has_validation: bool, classification: bool = True) -> tuple[str, ...]:
    """Epoch-record names early stopping can watch in this run (val_accuracy: class labels only)."""
    names = ["loss"]
    if has_validation:
        names += ["val_loss"] + (["val_accuracy"] if classification else []) + [f"val_{m}" for m in metrics]
    return tuple(dict.fromkeys(names))


def check_monitored(metric: str, metrics: Sequence[str], has_validation: bool, classification: bool = True) -> None:
    """Driver check before the job: early stopping watches a name the epoch records will hold."""
    known = monitored_names(metrics, has_validation, classification)
    if metric in known:
        return
    if metric.startswith("val_") and not has_validation:
        raise ConfigError(f"train.early_stopping watches {metric!r}, but this fit has no validation rows",
                          hint="set validation_fraction (e.g. 0.2) or pass validation_df, or watch 'loss'")
    raise ConfigError(f"train.early_stopping watches {metric!r}, which no epoch record holds",
                      hint=f"{suggest(metric, known)}; val_<name> needs <name> in train.metrics")


def check_callbacks(callbacks: Any) -> None:
    if isinstance(callbacks, (str, bytes)) or not isinstance(callbacks, (list, tuple)):
        raise ConfigError(f"train.callbacks must be a list of callables (or 'package.module:function' paths), "
                          f"got {callbacks!r}", hint="callbacks=[plot_loss]")
    for callback in callbacks:
        if callable(callback):
            continue
        if not isinstance(callback, str) or ":" not in callback or not all(callback.partition(":")[::2]):
            raise ConfigError(f"train.callbacks holds {callback!r}, neither a callable nor 'package.module:function'",
                              hint="each callback is fn(record: dict) -> None | 'stop', called on the driver")


def check_training_essentials(train: Any) -> None:
    """TrainConfig.validate's part for these options, and how they combine with the strategy."""
    check_schedule(train)
    check_precision(train)
    check_metrics(train.metrics)
    early_stopping_options(train.early_stopping)
    check_callbacks(train.callbacks)
    if train.precision == "16" and train.strategy in ("hybrid", "ist", "sharded"):
        raise ConfigError(f"train.precision='16' (fp16 with a gradient scaler) is data-parallel only, but "
                          f"train.strategy={train.strategy!r}",
                          hint="use precision='bf16' (no scaler needed), or strategy='data_parallel'")
    if train.accumulate_steps > 1 and train.strategy == "ist":
        raise ConfigError("train.accumulate_steps applies to data_parallel and hybrid, but train.strategy='ist'",
                          hint="IST rounds are counted in local steps: raise batch_size instead")


_HOROVOD_CONTRACT = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK",
                     "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME", "HOROVOD_CONTROLLER", "HOROVOD_GLOO_RENDEZVOUS_ADDR",
                     "HOROVOD_GLOO_RENDEZVOUS_PORT")  # comm/horovod.py sets these from the barrier job


SPOOL_MODES = ("auto", "disk", "none")
DELIVERY_MODES = ("auto", "spark", "parquet", "packed")  # data.delivery: data/parquet_source.py, data/packed_delivery.py


def spool_mode(spool: str, train: Any) -> str:
    """"disk" or "none" for data.spool. "auto" writes no spool for a one-epoch fit (nothing reads it)
    unless batches are shared by speed: a fast rank's larger share wraps around its shard, which only
    a spool can give again."""
    if spool == "auto":
        return "none" if train.epochs == 1 and train.batch_balance != "speed" else "disk"
    return spool


def check_spool(spool: str, train: Any) -> None:
    if spool != "none":
        return
    if train.epochs != 1:
        raise ConfigError(f"data.spool='none' trains one pass straight from Spark, but train.epochs={train.epochs}",
                          hint="use spool='disk' (or 'auto') for more epochs: epoch 1 still streams, later ones "
                               "read the local spool written alongside; or epochs=1")
    if train.batch_balance == "speed":
        raise ConfigError("data.spool='none' keeps no rows to wrap around, but train.batch_balance='speed' gives "
                          "fast ranks more rows per step than their shard holds",
                          hint="use spool='disk' (or 'auto') with batch_balance='speed'")


WILDCARD_ADDRESSES = ("*",)  # besides every spelling of the unspecified address (unspecified_address)


def check_channel(channel: Any) -> None:
    """launch.channel: "auto", "off", or the host name / IP address executors reach this client at."""
    text = channel if isinstance(channel, str) else ""
    port_or_url = ":" in text and text.count(":") < 2  # an IPv6 address has two or more
    if not text or any(c.isspace() or c in "/@" for c in text) or port_or_url:
        raise ConfigError(f"launch.channel must be \"auto\", \"off\" or a host name or IP address, got {channel!r}",
                          hint='"auto" (the default) finds the address itself; "off" when executors cannot reach '
                               "this client (metrics then reach MLflow from the job's result, after training)")
    if text in WILDCARD_ADDRESSES or unspecified_address(text):
        raise wildcard_channel(channel, unspecified_address(text))
    if text.startswith("[") or text.endswith("]"):  # a socket cannot bind "[fe80::1]": it would listen everywhere
        raise ConfigError(f"launch.channel={channel!r} is an IPv6 address in brackets",
                          hint=f"write it without them: launch.channel={text.strip('[]')!r}")


def wildcard_channel(channel: str, resolved: str = "") -> ConfigError:
    """The error for a launch.channel that means "every interface": the channel would listen on all of
    them, and executors told to dial it would dial themselves."""
    means = f" (it resolves to {resolved}, every interface)" if resolved and resolved != channel else ""
    return ConfigError(f"launch.channel={channel!r} is a wildcard address{means}, which executors cannot dial",
                       hint='leave launch.channel="auto" (the session\'s own address), or give the address or host '
                            "name of this client that the executors reach")


def unspecified_address(text: str) -> str:
    """The unspecified address (0.0.0.0 or ::) that `text` spells numerically, else "": decided by what
    the resolver makes of it, without a name lookup. "0", "0.0", "0x0", "0.0.0.0", "::", "[::]",
    "0:0:0:0:0:0:0:0" and "::ffff:0.0.0.0" all are (inet_aton reads "0.0" as 0.0.0.0, which
    ipaddress refuses to parse). Host names are resolved before the job (driver/channel_checks.py)."""
    import socket

    try:
        infos = socket.getaddrinfo(text.strip("[]"), None, flags=socket.AI_NUMERICHOST)
    except (OSError, UnicodeError, ValueError):  # a host name, or no address at all
        return ""
    return next((str(info[4][0]) for info in infos if unspecified_ip(str(info[4][0]))), "")


def unspecified_ip(address: str) -> bool:
    """An IP address (as the resolver returns it) that means "every interface"."""
    import ipaddress

    try:
        ip = ipaddress.ip_address(address.partition("%")[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:0.0.0.0
    return ip.is_unspecified or bool(mapped and mapped.is_unspecified)


def check_emulation(network: Any, speeds: Any, num_workers: int) -> None:
    """launch.emulate_network and launch.emulate_speed (experiments): their shapes and ranges."""
    if network is not None:
        if not isinstance(network, dict) or set(network) - {"latency_ms", "gbps"} or "gbps" not in network \
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in network.values()) \
                or network["gbps"] <= 0 or network.get("latency_ms", 0) < 0:
            raise ConfigError(f"launch.emulate_network must be a table {{latency_ms = >= 0, gbps = > 0}}, "
                              f"got {network!r}", hint='for example emulate_network={"latency_ms": 1, "gbps": 0.1}')
    if speeds is not None:
        if not isinstance(speeds, (list, tuple)) or len(speeds) != num_workers or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1 for v in speeds):
            raise ConfigError(f"launch.emulate_speed must list one speed in (0, 1] per worker "
                              f"({num_workers}), got {speeds!r}", hint="for example emulate_speed=[1, 0.25]")


def check_horovod_env(env: Any, backend: str) -> None:
    """launch.horovod_env: HOROVOD_* names with scalar values, for the horovod backend, never one of
    the variables sparkdl sets for the rendezvous."""
    if env is None:
        return
    if not isinstance(env, dict) or not all(isinstance(k, str) and k.startswith("HOROVOD_") for k in env) \
            or not all(isinstance(v, (str, int, float, bool)) for v in env.values()):
        raise ConfigError(f"launch.horovod_env must be a table of HOROVOD_* settings, got {env!r}",
                          hint='for example horovod_env={"HOROVOD_FUSION_THRESHOLD": 33554432}')
    if backend != "horovod":
        raise ConfigError(f"launch.horovod_env applies to backend='horovod', but launch.backend={backend!r}",
                          hint="set backend='horovod', or drop horovod_env")
    reserved = sorted(set(env) & set(_HOROVOD_CONTRACT))
    if reserved:
        raise ConfigError(f"launch.horovod_env sets {reserved}, which sparkdl sets for Horovod's rendezvous",
                          hint="ranks, sizes and the rendezvous come from the barrier job; tune other HOROVOD_* "
                               "settings only")


# -- the sections around training: tracking, the CLI's input and output, the model of a TOML run --
@dataclass(frozen=True)
class TrackingConfig:
    """MLflow and progress. The driver owns the run; executors never talk to the tracking server."""

    tracking: bool = True
    tracking_uri: str | None = None  # None: MLflow's own default (MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)
    experiment: str | None = None  # None: MLflow's current experiment
    run_name: str | None = None
    log_every: int = 20  # steps between metric points (and progress updates)
    progress: bool = True

    def validate(self) -> None:
        check_types("tracking", self)
        positive_int("tracking.log_every", self.log_every)


@dataclass(frozen=True)
class InputConfig:
    """Where the CLI reads its DataFrame from: a table name or a Parquet/CSV path."""

    table: str | None = None
    path: str | None = None
    format: str = "auto"

    def validate(self) -> None:
        check_types("input", self)
        choice("input.format", self.format, ("auto", "parquet", "csv", "json", "orc"))
        if self.table and self.path:
            raise ConfigError(f"input.table ({self.table!r}) and input.path ({self.path!r}) are both set",
                              hint="set only one of them")


@dataclass(frozen=True)
class OutputConfig:
    model_path: str | None = None
    overwrite: bool = False
    # False: the fit never loads the trained model on the driver; it logs the MLflow model from the
    # ranks' files and returns a TorchModel that loads them on first use (a model larger than the
    # driver's memory can be trained, logged and served).
    load_model: bool = True

    def validate(self) -> None:
        check_types("output", self)
        if not isinstance(self.load_model, bool):
            raise ConfigError(f"output.load_model must be true or false, got {self.load_model!r}")
        if self.model_path is not None and not isinstance(self.model_path, str):
            raise ConfigError(f"output.model_path must be a path string, got {self.model_path!r}")


@dataclass(frozen=True)
class ModelConfig:
    """The model of a TOML-driven run (`sparkdl train`), since a file cannot hold an nn.Module:
    either `factory`, the import path of a zero-argument callable returning one, or an MLP."""

    factory: str | None = None  # "package.module:function"
    hidden: tuple[int, ...] = (128,)
    outputs: int = 0  # 0: the number of classes for a classification loss, else 1

    def validate(self) -> None:
        check_types("model", self)
        if self.factory is not None and (":" not in self.factory or not all(self.factory.partition(":")[::2])):
            raise ConfigError(f"model.factory must look like 'package.module:function', got {self.factory!r}")
        if not all(isinstance(w, int) and not isinstance(w, bool) and w > 0 for w in self.hidden):
            raise ConfigError(f"model.hidden must be a list of positive layer widths, got {list(self.hidden)!r}",
                              hint="for example hidden = [128] or --set model.hidden=[64,64]")
        if not isinstance(self.outputs, int) or isinstance(self.outputs, bool) or self.outputs < 0:
            raise ConfigError(f"model.outputs must be an integer >= 0 (0 = automatic), got {self.outputs!r}")


def check_outer_sync(train: Any) -> None:
    """Streaming DiLoCo's options (torchft's rules: H % P == 0, tau < H / P)."""
    positive_int("train.fragments", train.fragments)
    positive_int_or_zero("train.fragment_sync_delay", train.fragment_sync_delay)
    alpha = train.fragment_update_alpha
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not 0 <= alpha <= 1:
        raise ConfigError(f"train.fragment_update_alpha must be in [0, 1], got {alpha!r}",
                          hint="0 takes the global weights (the paper's default), 0.5 mixes half of the local ones")
    check_islands(train.islands)
    from sparkdl.config.uneven import check_uneven_workers

    check_uneven_workers(train)
    streaming = train.fragments > 1 or train.fragment_sync_delay or alpha or train.sync_dtype != "fp32" \
        or train.islands
    # Under strategy="auto" they apply if the planner picks DiLoCo (a plan's data parallel then
    # leaves them unused, as it leaves outer_lr).
    if streaming and train.strategy not in ("data_parallel", "auto"):
        raise ConfigError("train.sync_dtype/fragments/fragment_sync_delay/fragment_update_alpha/islands shape "
                          f"DiLoCo's outer synchronisation, but train.strategy={train.strategy!r}",
                          hint="set strategy='data_parallel' with sync='diloco' (or strategy='auto')")
    if train.sync_every % train.fragments:
        raise ConfigError(f"train.sync_every={train.sync_every} is not a multiple of train.fragments="
                          f"{train.fragments}: each fragment syncs once every sync_every steps at its own "
                          "offset of sync_every / fragments",
                          hint=f"for example sync_every={train.fragments * max(1, train.sync_every // train.fragments)}")
    if train.fragment_sync_delay >= train.sync_every // train.fragments:
        raise ConfigError(f"train.fragment_sync_delay={train.fragment_sync_delay} must be below sync_every / "
                          f"fragments = {train.sync_every // train.fragments}: a fragment's sync lands before "
                          "the next one starts",
                          hint="the paper overlaps 1 to 5 inner steps")
