"""Run configuration: frozen dataclasses, TOML loading, `a.b=c` overrides and flat keyword mapping.

The same RunConfig comes from estimator keyword arguments, from `sparkdl.run(**options)` and from a
TOML file plus `--set` overrides on the CLI, so the three entry points can never drift apart.
Imports nothing from sparkdl but errors (layering rule).
"""
from __future__ import annotations

try:
    import tomllib
except ImportError:  # Python 3.10 (Databricks runtimes before 15)
    import tomli as tomllib  # type: ignore[no-redef]
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from sparkdl.config.values import (boolean, check_feature_spec, check_text_options, check_input_spec, check_rows_options,
                                   check_types, choice, parse_bytes,
                                   parse_literal, plain, positive_int, positive_int_or_zero, suggest)
from sparkdl.config.training import (DELIVERY_MODES, check_emulation, check_outer_sync, SPOOL_MODES, check_channel, check_horovod_env,
                                     check_training_essentials)
from sparkdl.config.training import InputConfig, ModelConfig, OutputConfig, TrackingConfig  # noqa: F401 - public here
from sparkdl.config.elastic import check_worker_range
from sparkdl.config.threads import AUTO as AUTO_THREADS, threads_option
from sparkdl.config.merging import check_across_sections, merged_section
from sparkdl.config.sparse import check_sparse_cols
from sparkdl.config.embeddings import EmbeddingConfig, check_embedding_run
from sparkdl.errors import ConfigError

__all__ = ["DataConfig", "TrainConfig", "LaunchConfig", "TrackingConfig", "InputConfig", "OutputConfig",
           "ModelConfig", "EmbeddingConfig", "RunConfig", "option_owners", "parse_bytes", "parse_literal", "suggest"]

# "causal_lm": shifted cross entropy of a causal language model; "model": the model's own loss from `labels`
LOSSES = ("cross_entropy", "mse", "bce_with_logits", "causal_lm", "model")
OPTIMIZERS = ("adam", "adamw", "sgd")
STRATEGIES = ("data_parallel", "hybrid", "ist", "sharded", "embeddings", "auto")
SCHEDULES = ("1f1b", "gpipe")
SYNC_MODES = ("allreduce", "diloco")
SYNC_DTYPES = ("fp32", "fp16", "bf16", "int8", "int4")
IST_SCALES = ("scale", "batchnorm")
NONFINITE_LOSS_MODES = ("raise", "skip")  # train.nonfinite_loss (executor/loss_watch.py)
REPLAN_MODES = ("auto", "off")  # train.replan (executor/replan.py)
BATCH_BALANCES = ("equal", "speed", "dynamic")
BACKENDS = ("torch", "horovod")
TASKS = ("auto", "classification", "regression")


@dataclass(frozen=True)
class DataConfig:
    feature_cols: tuple[str, ...] = ()
    label_col: str | None = "label"
    batch_size: int = 64
    shuffle: bool = True
    drop_last: bool = False
    prediction_col: str = "prediction"
    spool_dir: str | None = None
    validation_fraction: float = 0.0  # rows held out (randomly, by seed) for per-epoch validation
    on_invalid: str = "error"  # rows with NaN/Inf features or unusable labels: "error", or "skip" (dropped, counted)
    input_cols: tuple[str, ...] | dict[str, str] | None = None  # tensor columns: list (positional) or {kwarg: column}
    input_shapes: dict[str, Sequence[int]] | None = None  # {column: per-row shape} of fixed-length arrays, one -1
    input_dtypes: dict[str, str] | None = None  # {column: "float32" | "int64" | "bfloat16" | ...} over the default
    label_shapes: Sequence[int] | dict[str, Sequence[int]] | None = None  # per-row shape of an array label
    weight_col: str | None = None  # per-row weight: built-in losses become sum(w * l) / sum(w)
    transform_fn: Callable[..., Any] | None = None  # executors: dict of input columns -> dict of model inputs
    prefetch_batches: int = 2  # batches made ahead on a background thread when transform_fn is set (0 = off)
    spool: str = "auto"  # "disk": epoch 1 streams, later epochs read a local spool; "none": one pass, no file
    shuffle_buffer_rows: int = 0  # epoch 1's seeded shuffle buffer per rank (0 = about 64 MiB of rows)
    # "parquet": ranks read a plain Parquet scan's files themselves; "packed": Spark hands over blocks of rows
    # packed on the JVM; "spark": Spark's own Arrow rows; "auto": the first of these the DataFrame qualifies for
    delivery: str = "auto"
    # categorical inputs looked up in embedding tables: [SparseInput, ...] or {column: {table, num_rows, ...}}
    sparse_cols: tuple[Any, ...] | dict[str, Any] | None = None
    tokenizer: Any = None  # text columns -> input_ids + attention_mask per batch on the executors (data/text.py)
    max_length: int = 512  # tokens per row (truncated), or per block with packing
    packing: bool = False  # causal LMs: a batch's texts joined (end-of-text between) and cut into max_length blocks

    def validate(self, columns: bool = True) -> None:
        check_types("data", self)
        if columns:  # False: a run without a DataFrame (sparkdl.run's own loop), no column options apply
            (check_input_spec if self.input_cols is not None else check_feature_spec)(self)
            check_sparse_cols(self)
            check_text_options(self)
        else:
            check_rows_options(self)
        positive_int_or_zero("data.prefetch_batches", self.prefetch_batches)
        choice("data.spool", self.spool, SPOOL_MODES)
        positive_int_or_zero("data.shuffle_buffer_rows", self.shuffle_buffer_rows)
        choice("data.delivery", self.delivery, DELIVERY_MODES)


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 5
    lr: float = 1e-3
    optimizer: str | Callable[..., Any] = "adam"
    loss: str | Callable[..., Any] = "cross_entropy"
    task: str = "auto"
    momentum: float = 0.0
    weight_decay: float = 0.0
    seed: int = 0
    strategy: str = "auto"  # "auto": the planner chooses (sparkdl.plan shows how); or one of STRATEGIES
    stages: int = 0  # hybrid: pipeline stages K (0 = the smallest K >= 2 dividing num_workers that fits)
    microbatches: int = 0  # hybrid: micro-batches per step (0 = 4 x stages, capped by the batch)
    schedule: str = "1f1b"  # hybrid: "1f1b" or "gpipe"
    sync: str = "allreduce"  # data_parallel: "allreduce" (every step) or "diloco" (every sync_every steps)
    sync_every: int = 50  # diloco: inner steps H between synchronisations
    outer_lr: float = 0.7  # diloco: outer Nesterov SGD learning rate (1.0 with momentum 0 = plain averaging)
    outer_momentum: float = 0.9  # diloco: outer Nesterov momentum
    # diloco: the pseudo-gradient on the wire, "fp32", "fp16", "bf16", "int8" or "int4" (block scales and an
    # error-feedback residual); always summed in fp32
    sync_dtype: str = "fp32"
    fragments: int = 1  # diloco: P fragments of strided top-level layers syncing at staggered steps (Streaming DiLoCo)
    fragment_sync_delay: int = 0  # diloco: tau, inner steps a fragment's sync overlaps before it lands (< H / P)
    fragment_update_alpha: float = 0.0  # diloco: a landed fragment = alpha x local + (1 - alpha) x global
    # diloco on uneven workers (strategies/diloco_uneven.py): "dynamic" = each replica's inner steps per round
    # from its measured speed (DyLU; fast replicas echo batches), pseudo-gradients weighted by rows
    local_updates: str = "fixed"
    outer_optimizer: str = "nesterov"  # diloco: "nesterov" or "delayed_nesterov" (momentum every N pseudo-gradients)
    outer_momentum_every: int = 0  # delayed_nesterov: N (0 = the number of replicas; 1 = plain Nesterov)
    max_staleness: int | tuple = 0  # diloco: rounds a replica may run ahead (DSSP): s, or bounds (s_L, s_U); 0 = off
    # diloco: islands of fast links, data parallel inside each every step and DiLoCo across: host groups
    # [["h1", "h2"], ["h3", "h4"]], or a count (>= 2) to find from measured links; 0 = none
    islands: int | tuple[tuple[str, ...], ...] = 0
    ist_sync_every: int = 30  # ist: local steps R per round (subnets re-drawn every round)
    ist_scale: str = "scale"  # ist: train-narrow/test-wide fix, "scale" (x W on hidden activations) or "batchnorm"
    grad_clip: float = 0.0  # clip each step's gradient norm to this (0 = off); DiLoCo's paper uses 1.0
    nonfinite_loss: str = "raise"  # a NaN/inf loss: "raise" (TrainingError: step, rank, last finite loss) or "skip" (AMP's way)
    # auto: an extra margin on time to data parallel's loss (k x steps x step, planner/steps_to_loss.py) an
    # approximate strategy must win by, past the planner's 15% close-call band; 1.0 = none, inf = never approximate
    approximate_min_speedup: float = 1.0
    # auto chose data parallel: "auto" switches to DiLoCo at an epoch boundary when measured steps show the link
    # was the bound (and back when it is not); "off": the run keeps the planned layout (executor/replan.py)
    replan: str = "auto"
    batch_balance: str = "equal"  # data_parallel: "equal" rows per rank, or "speed": rows by measured rank speed
    # (once, at the start), or "dynamic" (also sharded): re-split every rebalance_every steps, rows moved, exact
    rebalance_every: int = 4  # batch_balance="dynamic": steps between agreements on the ranks' measured speeds
    checkpoint_dir: str | None = None  # local path or pyarrow filesystem URI; None: no checkpoints
    checkpoint_every: int = 0  # steps between checkpoints (0: at epoch ends only)
    keep_checkpoints: int = 2  # complete checkpoints kept
    resume_run: str | None = None  # an earlier fit's run id: continue its checkpoints under checkpoint_dir
    plan_from_run: str | None = None  # MLflow run id of an earlier fit: train with its plan.json, no planning
    plan_file: str | None = None  # a plan's JSON (sparkdl plan --out, ResolvedPlan.to_json): train with it
    # Training essentials (config/training.py validates them): stepped per optimizer step
    lr_schedule: str | Callable[..., Any] = "constant"  # "linear" | "cosine" | "step", or optimizer -> LRScheduler
    warmup_steps: int = 0  # optimizer steps of linear warm-up from 0
    min_lr: float = 0.0  # the floor linear/cosine decay to
    step_every: int = 0  # "step": optimizer steps between lr *= step_gamma (0 = once per epoch)
    step_gamma: float = 0.1
    precision: str = "32"  # "32", "bf16" (autocast, fp32 master weights) or "16" (CUDA, GradScaler)
    accumulate_steps: int = 1  # micro-batches per optimizer step; gradients communicated on the last only
    # data_parallel (backend="torch"): gradient buckets allreduced while backward runs, as DDP does
    # (False: all of them after backward; the same averages)
    overlap_grads: bool = True
    activation_checkpointing: bool = False  # Hugging Face models recompute activations in backward (less memory)
    metrics: tuple[Any, ...] = ()  # validation metrics by name or callable (output, label) -> (sum, count)
    early_stopping: dict | None = None  # {"metric", "mode", "patience", "min_delta", "restore_best"}
    callbacks: tuple[Any, ...] = ()  # driver: fn(epoch record) -> None | "stop" (or "pkg.mod:fn" paths)

    @property
    def implied_strategy(self) -> str:
        """`strategy`, except that under "auto" options only one strategy has decide it (sync="diloco"
        or batch_balance="speed": data_parallel; stages >= 2 or microbatches: hybrid); "auto" when the
        planner is to choose."""
        if self.strategy != "auto":
            return self.strategy
        if self.sync != "allreduce" or self.batch_balance != "equal" or self.precision == "16":
            return "data_parallel"
        if self.stages >= 2 or self.microbatches:
            return "hybrid"
        return "auto"

    def is_classification(self, label_is_integral: bool, builtin_loss: bool = True) -> bool:
        """The one rule: class labels are int64 (cross entropy); every other loss trains on float32
        values. Under task="auto", where no built-in loss decides (a callable loss, or a custom loop
        of sparkdl.run, `builtin_loss=False`), the label column's type does."""
        if self.task != "auto":
            return self.task == "classification"
        if callable(self.loss) or self.loss == "model" or not builtin_loss:
            return label_is_integral
        return self.loss in ("cross_entropy", "causal_lm")

    def validate(self) -> None:
        check_types("train", self)  # types and finiteness first: the rules below compare numbers
        positive_int("train.epochs", self.epochs)
        if not isinstance(self.lr, (int, float)) or isinstance(self.lr, bool) or self.lr <= 0:
            raise ConfigError(f"train.lr must be a positive number, got {self.lr!r}", hint="for example lr=1e-3")
        choice("train.optimizer", self.optimizer, OPTIMIZERS, callable_ok=True)
        choice("train.loss", self.loss, LOSSES, callable_ok=True)
        choice("train.task", self.task, TASKS)
        choice("train.strategy", self.strategy, STRATEGIES)
        choice("train.schedule", self.schedule, SCHEDULES)
        for key in ("stages", "microbatches"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"train.{key} must be an integer >= 0 (0 = automatic), got {value!r}")
        choice("train.sync", self.sync, SYNC_MODES)
        choice("train.sync_dtype", self.sync_dtype, SYNC_DTYPES)
        choice("train.ist_scale", self.ist_scale, IST_SCALES)
        self._validate_balance()
        positive_int("train.sync_every", self.sync_every)
        check_outer_sync(self)
        positive_int("train.ist_sync_every", self.ist_sync_every)
        if self.sync != "allreduce" and self.strategy not in ("data_parallel", "auto"):
            raise ConfigError(f"train.sync={self.sync!r} is a synchronisation mode of data parallel, but "
                              f"train.strategy={self.strategy!r}", hint="use strategy='data_parallel' with sync='diloco'")
        if not self.outer_lr > 0:
            raise ConfigError(f"train.outer_lr must be > 0, got {self.outer_lr!r}", hint="DiLoCo uses 0.7")
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"train.outer_momentum must be in [0, 1), got {self.outer_momentum!r}",
                              hint="DiLoCo uses 0.9")
        if self.grad_clip < 0:
            raise ConfigError(f"train.grad_clip must be >= 0 (0 = off), got {self.grad_clip!r}")
        choice("train.nonfinite_loss", self.nonfinite_loss, NONFINITE_LOSS_MODES)
        choice("train.replan", self.replan, REPLAN_MODES)
        boolean("train.activation_checkpointing", self.activation_checkpointing)
        if not isinstance(self.overlap_grads, bool):
            raise ConfigError(f"train.overlap_grads must be true or false, got {self.overlap_grads!r}")
        if not isinstance(self.checkpoint_every, int) or isinstance(self.checkpoint_every, bool) \
                or self.checkpoint_every < 0:
            raise ConfigError(f"train.checkpoint_every must be an integer >= 0 (0 = epoch ends only), got "
                              f"{self.checkpoint_every!r}")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ConfigError(f"train.checkpoint_every={self.checkpoint_every} needs train.checkpoint_dir",
                              hint="set checkpoint_dir to a directory every executor can reach, e.g. "
                                   "'/dbfs/tmp/ckpt', 's3://bucket/ckpt' or a local path on local masters")
        positive_int("train.keep_checkpoints", self.keep_checkpoints)
        if not self.approximate_min_speedup >= 1:
            raise ConfigError(f"train.approximate_min_speedup must be >= 1, got {self.approximate_min_speedup!r}",
                              hint="1 = the planner takes the fastest layout; inf = never DiLoCo or IST")
        if self.strategy == "auto" and (self.sync != "allreduce" or self.batch_balance != "equal") \
                and (self.stages >= 2 or self.microbatches):
            raise ConfigError("train.sync/batch_balance are data-parallel options, but train.stages/microbatches "
                              "are hybrid ones", hint="set strategy explicitly, and only that strategy's options")
        if self.strategy == "hybrid" and self.stages == 1:
            raise ConfigError("train.stages=1 with strategy='hybrid' is a pipeline of one stage",
                              hint="use stages >= 2, or strategy='data_parallel'")
        self._validate_kept_plan()
        check_training_essentials(self)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"train.seed must be an integer, got {self.seed!r}")

    def _validate_balance(self) -> None:
        choice("train.batch_balance", self.batch_balance, BATCH_BALANCES)
        strategy = self.implied_strategy
        if self.batch_balance == "speed" and strategy not in ("data_parallel", "auto"):
            raise ConfigError(f"train.batch_balance='speed' shares a data-parallel batch, but train.strategy="
                              f"{strategy!r}", hint="use strategy='data_parallel' (or 'auto')")
        if self.batch_balance == "dynamic" and (strategy not in ("data_parallel", "sharded", "auto")
                                                or (self.sync != "allreduce" and strategy == "sharded")):
            raise ConfigError(f"train.batch_balance='dynamic' re-splits the batch of data-parallel ranks (data_parallel "
                              f"with sync='allreduce' or 'diloco', or sharded), but train.strategy={strategy!r}"
                              + (f" with sync={self.sync!r}" if self.sync != "allreduce" else ""),
                              hint="use strategy='data_parallel' or 'sharded'")
        positive_int("train.rebalance_every", self.rebalance_every)

    def _validate_kept_plan(self) -> None:
        for key, what in (("plan_from_run", "an MLflow run id"), ("plan_file", "a path")):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"train.{key} must be {what}, got {value!r}", hint="or leave it unset")
        if self.plan_from_run and self.plan_file:
            raise ConfigError("train.plan_from_run and train.plan_file are both set", hint="set only one of them")


@dataclass(frozen=True)
class LaunchConfig:
    num_workers: int = 2
    backend: str = "torch"
    timeout_s: float = 600.0
    # None: as long as Spark's own barrier-scheduling check would wait (its interval x maxFailures)
    slot_wait_s: float | None = None
    peer_failure_delay_s: float = 5.0  # a rank whose collective broke waits this long, so the first failure is heard
    threads_per_worker: int | str | None = None  # torch threads per rank; None / "auto": the task's CPUs (executor/threads.py)
    run_dir: str | None = None
    max_memory_per_rank: int | str | None = None  # bytes, or "512MB" / "2GiB"; None: no budget
    emulate_network: dict | None = None  # {"latency_ms": .., "gbps": ..}: slow every message down (experiments)
    gpus_per_worker: int = 0  # GPUs per rank for the training stage only (stage-level ResourceProfile); 0: app's
    emulate_speed: tuple | None = None  # relative compute speed per rank, e.g. [1, 0.25] (experiments)
    horovod_env: dict | None = None  # HOROVOD_* settings applied before hvd.init() (backend="horovod")
    channel: str = "auto"  # where executors send progress and metrics back: "auto", "off" or this client's host
    rank_output: str = "rank0"  # whose stdout/stderr reach the driver's log: "rank0" or "all" (prefixed [rank r])
    # How the ranks' parts of the trained model reach the driver (wire/model_transfer.py):
    # "auto", "channel", "storage" (checkpoint_dir or run_dir) or "rows" (the job's result rows).
    model_transfer: str = "auto"
    # Spot-safe runs (driver/elastic.py): a fit whose hosts are gone for good goes on with the slots
    # there are, down to min_workers (0: num_workers, i.e. not elastic), after waiting
    # replacement_wait_s for replacements; grow_workers: back up to max_workers (0: num_workers) at the
    # next epoch end once slots return.
    min_workers: int = 0
    max_workers: int = 0
    grow_workers: bool = False
    replacement_wait_s: float = 30.0

    def __post_init__(self) -> None:
        if self.threads_per_worker == AUTO_THREADS:  # one spelling of "auto" downstream: None
            object.__setattr__(self, "threads_per_worker", None)

    def validate(self) -> None:
        check_types("launch", self)  # a NaN or infinite timeout is refused here, not on rank 0
        positive_int("launch.num_workers", self.num_workers)
        check_worker_range(self.num_workers, self.min_workers, self.max_workers, self.grow_workers,
                           self.replacement_wait_s)
        check_emulation(self.emulate_network, self.emulate_speed, self.num_workers)
        if not isinstance(self.gpus_per_worker, int) or isinstance(self.gpus_per_worker, bool) \
                or self.gpus_per_worker < 0:
            raise ConfigError(f"launch.gpus_per_worker must be a whole number of GPUs >= 0, got {self.gpus_per_worker!r}",
                              hint="1 for one GPU per rank (NCCL needs a GPU of its own per rank); 0 = the "
                                   "application's spark.task.resource.gpu.amount")
        if self.max_memory_per_rank is not None:
            parse_bytes(self.max_memory_per_rank, "launch.max_memory_per_rank")
        choice("launch.backend", self.backend, BACKENDS)
        check_horovod_env(self.horovod_env, self.backend)
        check_channel(self.channel)
        choice("launch.model_transfer", self.model_transfer, ("auto", "channel", "storage", "rows"))
        choice("launch.rank_output", self.rank_output, ("rank0", "all"))
        if self.model_transfer == "channel" and self.channel == "off":
            raise ConfigError('launch.model_transfer="channel" needs the driver channel, but launch.channel="off"',
                              hint='use model_transfer="storage" (with checkpoint_dir or run_dir) or "auto"')
        for key in ("timeout_s", "slot_wait_s"):
            value = getattr(self, key)
            if key == "slot_wait_s" and value is None:
                continue
            if not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"launch.{key} must be a positive number of seconds, got {value!r}")
        delay = self.peer_failure_delay_s
        if not isinstance(delay, (int, float)) or isinstance(delay, bool) or not 0 <= delay < float("inf"):
            raise ConfigError(f"launch.peer_failure_delay_s must be a number of seconds >= 0, got {delay!r}",
                              hint="5 (the default) lets the rank that failed first be named; 0 fails at once")
        threads_option(self.threads_per_worker)


@dataclass(frozen=True)
class RunConfig:
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    input: InputConfig = field(default_factory=InputConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    embeddings: EmbeddingConfig = field(default_factory=EmbeddingConfig)

    def validate(self, columns: bool = True) -> "RunConfig":
        """Every option and the rules across sections: the one validation of fit, run (without a
        DataFrame: `columns=False`), plan and the CLI. Each section's `validate` checks its types and
        finiteness too, so one checked alone (sparkdl.compat's launch) meets the same rules."""
        for section in _sections(self):
            part = getattr(self, section)
            if section == "data":
                part.validate(columns)
            else:
                part.validate()
        check_across_sections(self.data, self.train, self.launch)
        check_embedding_run(self.data, self.train, self.launch)
        return self

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Nested plain dict; callables are shown by their qualified name."""
        out: dict[str, dict[str, Any]] = {}
        for section in _sections(self):
            part = getattr(self, section)
            out[section] = {f.name: plain(getattr(part, f.name)) for f in fields(part)}
        return out

    def flat(self) -> dict[str, Any]:
        """`section.key` -> value, for logging every option under one name."""
        return {f"{s}.{k}": v for s, d in self.to_dict().items() for k, v in d.items()}

    def with_overrides(self, overrides: Sequence[str]) -> "RunConfig":
        """Apply `section.key=value` strings; values are TOML literals, else plain strings."""
        updates: dict[str, dict[str, Any]] = {}
        for item in overrides:
            key, sep, raw = item.partition("=")
            if not sep or "." not in key:
                raise ConfigError(f"override {item!r} is not of the form section.option=value",
                                  hint="for example --set train.epochs=3")
            section, _, name = key.strip().partition(".")
            updates.setdefault(section, {})[name] = parse_literal(raw.strip())
        return self.merged(updates)

    def merged(self, nested: Mapping[str, Mapping[str, Any]]) -> "RunConfig":
        """A copy with `{section: {key: value}}` applied; unknown names raise with a suggestion."""
        config = self
        sections = _sections(self)
        for section, values in nested.items():
            if section not in sections:
                raise ConfigError(f"unknown config section {section!r}", hint=suggest(section, sections))
            config = replace(config, **{section: merged_section(section, getattr(config, section), values)})
        return config

    @classmethod
    def from_toml(cls, path: str | Path, overrides: Sequence[str] = ()) -> "RunConfig":
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist",
                              hint="pass --conf with the path of a TOML file, e.g. conf/examples/digits.toml")
        try:
            with path.open("rb") as stream:
                nested = tomllib.load(stream)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
        return cls().merged(nested).with_overrides(overrides).validate()

    @classmethod
    def from_kwargs(cls, base: "RunConfig | None" = None, **kwargs: Any) -> "RunConfig":
        """Map flat keyword arguments (`batch_size=64`, `num_workers=2`) onto their sections."""
        config = base or cls()
        owner = option_owners(config)
        nested: dict[str, dict[str, Any]] = {}
        for name, value in kwargs.items():
            if name not in owner:
                raise ConfigError(f"unknown option {name!r}", hint=suggest(name, list(owner)))
            nested.setdefault(owner[name], {})[name] = value
        return config.merged(nested)


def option_owners(config: RunConfig | None = None) -> dict[str, str]:
    """Flat option name -> section name; option names are unique across sections by design."""
    config = config or RunConfig()
    owners: dict[str, str] = {}
    for section in _sections(config):
        for f in fields(getattr(config, section)):
            owners[f.name] = section
    return owners


def _sections(config: RunConfig) -> list[str]:
    return [f.name for f in fields(config)]
