"""Driver side of the hybrid strategy: check the configuration, cut the model into balanced stages,
and estimate training memory per rank (data parallel and hybrid) against `max_memory_per_rank`.

Everything here runs before any Spark job, so a bad configuration costs seconds, not a cluster.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from sparkdl.config import DataConfig, LaunchConfig, TrainConfig, parse_bytes
from sparkdl.errors import ConfigError, ModelError, ResourceError
from sparkdl.planner.partition import balanced_cuts, stage_costs
from sparkdl.planner.profile import ModelInput, ModelProfile, profile_sequential
from sparkdl.model.layouts import HybridLayout, default_grid
from sparkdl.strategies.pipeline_stages import pipeline_layers
from sparkdl.strategies.schedules import SCHEDULES, max_in_flight

PROFILE_ROWS_MAX = 256


def optimizer_bytes_per_param(train: TrainConfig) -> int:
    """Parameter + gradient + optimizer state, fp32 (ALGORITHMS.md: SGD 8, momentum 12, Adam 16)."""
    optimizer = train.optimizer
    if optimizer == "sgd":
        per_param = 12 if train.momentum > 0 else 8
    else:
        per_param = 16  # adam, adamw, and a callable optimizer (assumed Adam-like)
    if train.sync == "diloco":
        per_param += 8  # the global copy and the outer momentum
    return per_param


@dataclass(frozen=True)
class MemoryEstimate:
    state_bytes: int  # parameters, gradients, optimizer state
    activation_bytes: int

    @property
    def total(self) -> int:
        return self.state_bytes + self.activation_bytes


def data_parallel_memory(profile: ModelProfile, train: TrainConfig, batch_size: int) -> MemoryEstimate:
    return MemoryEstimate(state_bytes=profile.params * optimizer_bytes_per_param(train),
                          activation_bytes=int(profile.saved_bytes_per_row * batch_size))


def stage_memory(profile: ModelProfile, train: TrainConfig, batch_size: int, first: int, end: int, stage: int, stages: int,
                 microbatches: int, schedule: str) -> MemoryEstimate:
    """Layers first..end-1 as stage `stage`: their parameters' state, and the activations of the
    micro-batches that stage holds at once under the schedule."""
    layers = profile.layers[first:end]
    rows_per_micro = math.ceil(stages * batch_size / microbatches)
    in_flight = max_in_flight(SCHEDULES[schedule](stage, stages, microbatches))
    return MemoryEstimate(
        state_bytes=sum(layer.params for layer in layers) * optimizer_bytes_per_param(train),
        activation_bytes=int(sum(layer.saved_bytes for layer in layers) * rows_per_micro * in_flight))


def hybrid_memory(profile: ModelProfile, train: TrainConfig, batch_size: int, cuts: list[int], microbatches: int,
                  schedule: str) -> list[MemoryEstimate]:
    stages = len(cuts) - 1
    return [stage_memory(profile, train, batch_size, cuts[k], cuts[k + 1], k, stages, microbatches, schedule)
            for k in range(stages)]


def sharded_memory(profile: ModelProfile, train: TrainConfig, batch_size: int, workers: int) -> MemoryEstimate:
    """Sharded data parallel (strategies/sharded.py): 1/W of the parameters, gradients and optimizer
    state, plus one layer's gathered parameters and gradients in fp32 while it computes; the
    activations are each layer's input for the whole batch plus the largest layer's own."""
    largest = max((layer.params for layer in profile.layers), default=0)
    batch = batch_size
    boundaries = sum(layer.out_bytes for layer in profile.layers[:-1])
    return MemoryEstimate(
        state_bytes=int(profile.params * optimizer_bytes_per_param(train) / max(workers, 1)) + 8 * largest,
        activation_bytes=int((boundaries + max((layer.saved_bytes for layer in profile.layers), default=0)) * batch))


def check_sharded_memory(model: nn.Module, data: DataConfig, train: TrainConfig, launch: LaunchConfig,
                         num_features: "ModelInput | int") -> MemoryEstimate | None:
    """With a memory budget set, refuse a sharded run whose per-rank share does not fit."""
    if launch.max_memory_per_rank is None:
        return None
    budget = parse_bytes(launch.max_memory_per_rank, "launch.max_memory_per_rank")
    workers = launch.num_workers
    if isinstance(model, nn.Sequential):
        estimate = sharded_memory(profile_sequential(model, ModelInput.of(num_features),
                                                     rows=min(data.batch_size, PROFILE_ROWS_MAX)), train,
                                  data.batch_size, workers)
    else:
        from sparkdl.strategies.layer_shards import gathered_numels
        from sparkdl.strategies.sharded import model_layers

        # one layer, gathered whole for the step; a transformer cut at its blocks gathers its largest one
        params = sum(p.numel() for p in model.parameters())
        from sparkdl.model.objectives import loss_function

        largest = max(gathered_numels(model_layers(model, loss_function(train))), default=params)
        estimate = MemoryEstimate(int(params * optimizer_bytes_per_param(train) / max(workers, 1)) + 8 * largest, 0)
    if estimate.total > budget:
        raise ResourceError(
            f"sharded data parallel needs about {_mib(estimate.total)} per rank over {workers} ranks "
            f"({_mib(estimate.state_bytes)} sharded state and one gathered layer + {_mib(estimate.activation_bytes)} "
            f"activations), over launch.max_memory_per_rank={launch.max_memory_per_rank!r}",
            hint="use more workers (each holds 1/W of the state), strategy='hybrid' (activations of a "
                 "micro-batch per stage), or raise max_memory_per_rank")
    return estimate


def check_data_parallel_memory(model: nn.Module, data: DataConfig, train: TrainConfig, launch: LaunchConfig,
                               num_features: "ModelInput | int") -> MemoryEstimate | None:
    """With a memory budget set, refuse a data-parallel run whose model state does not fit one rank."""
    if launch.max_memory_per_rank is None:
        return None
    budget = parse_bytes(launch.max_memory_per_rank, "launch.max_memory_per_rank")
    if not isinstance(model, nn.Sequential):
        # Whole-model estimate without per-layer activations: parameters and optimizer state only.
        params = sum(p.numel() for p in model.parameters())
        estimate = MemoryEstimate(params * optimizer_bytes_per_param(train), 0)
    else:
        estimate = data_parallel_memory(profile_sequential(model, ModelInput.of(num_features),
                                                           rows=min(data.batch_size, PROFILE_ROWS_MAX)),
                                        train, data.batch_size)
    if estimate.total > budget:
        raise ResourceError(
            f"data parallel keeps the whole model on every rank: about {_mib(estimate.total)} per rank "
            f"({_mib(estimate.state_bytes)} parameters, gradients and optimizer state + "
            f"{_mib(estimate.activation_bytes)} activations), over launch.max_memory_per_rank="
            f"{launch.max_memory_per_rank!r}",
            hint="use strategy='hybrid' (the model is cut into pipeline stages, ~1/K of it per rank), "
                 "or raise max_memory_per_rank")
    return estimate


def plan_hybrid(model: nn.Module, data: DataConfig, train: TrainConfig, launch: LaunchConfig,
                num_features: "ModelInput | int", label_dtype: str,
                links: tuple[tuple[str, str, float, float], ...] = ()
                ) -> tuple[HybridLayout, ModelProfile, list[MemoryEstimate]]:
    """Stage cuts balancing measured per-layer time; every check that can fail happens here.
    `links`: measured links between executors, for placing the grid at run time. A transformer is
    planned as its cut (embeddings, one layer per block, head: strategies/pipeline_stages.py), checked
    against its own output on the run's sample rows."""
    model_input = ModelInput.of(num_features)
    if train.loss == "model":
        raise ConfigError("strategy='hybrid' takes the loss on the last stage's output, so loss='model' (the model's "
                          "own loss from `labels`) cannot train a pipeline",
                          hint="use loss='causal_lm' for a causal LM (the same shifted cross entropy), or "
                               "loss='cross_entropy'")
    model = pipeline_layers(model, model_input.sample)
    candidates = stage_counts(model, train, data.batch_size, launch.num_workers)
    workers, batch, layers = launch.num_workers, data.batch_size, len(model)
    microbatches = train.microbatches
    profile_rows = max(1, min(PROFILE_ROWS_MAX, math.ceil(min(candidates) * batch / max(microbatches, 1))))
    profile = profile_sequential(model, model_input, rows=profile_rows, precision=train.precision)
    budget = parse_bytes(launch.max_memory_per_rank, "launch.max_memory_per_rank") \
        if launch.max_memory_per_rank is not None else None
    costs = [layer.seconds for layer in profile.layers]
    schedule = train.schedule
    cuttable = [layer.out_dtype.startswith(("float", "bfloat")) for layer in profile.layers]
    tried = []
    for stages in candidates:
        m = microbatches or min(4 * stages, stages * batch)

        def allowed(k: int, first: int, end: int, stages: int = stages, m: int = m) -> bool:
            # Gradients flow back only through float boundaries; every stage must fit the budget.
            if end < layers and not cuttable[end - 1]:
                return False
            return budget is None or stage_memory(profile, train, batch, first, end, k, stages, m, schedule).total <= budget

        try:
            cuts = balanced_cuts(costs, stages, allowed)  # the fastest cut among those allowed
        except ValueError:
            if budget is None:
                _raise_uncuttable(profile, stages)
            tried.append((stages, _best_memory(profile, train, batch, stages, m, schedule)))
            continue
        layout = HybridLayout(
            stages=stages, replicas=workers // stages, cuts=tuple(cuts),
            boundary_shapes=tuple(profile.layers[c - 1].out_shape for c in cuts[1:-1]),
            boundary_dtypes=tuple(profile.layers[c - 1].out_dtype for c in cuts[1:-1]),
            input_shape=model_input.shape, input_dtype=model_input.dtype, label_shape=model_input.label_shape,
            input_specs=model_input.specs,
            label_dtype=label_dtype, microbatches=m,
            schedule=schedule, grid=default_grid(stages, workers // stages), executor_links=tuple(links or ()),
            stage_grad_bytes=tuple(4.0 * sum(layer.params for layer in profile.layers[a:b])
                                   for a, b in zip(cuts, cuts[1:])),
            boundary_bytes=max(profile.layers[c - 1].out_bytes for c in cuts[1:-1]) * profile.rows / m)
        return layout, profile, hybrid_memory(profile, train, batch, cuts, m, schedule)
    listing = ", ".join(f"K={k}: {_mib(w)}" for k, w in tried)
    raise ResourceError(f"no hybrid layout fits launch.max_memory_per_rank={launch.max_memory_per_rank!r}: "
                        f"the largest stage needs at least {listing} per rank",
                        hint="use more workers (more stages), a smaller batch_size or more micro-batches, "
                             "or raise max_memory_per_rank")


def stage_counts(model: nn.Module, train: TrainConfig, batch_size: int, num_workers: int) -> list[int]:
    """The stage counts K a hybrid run may use (train.stages, or every K >= 2 dividing num_workers),
    each at most the model's top-level layers (a transformer's: embeddings, blocks, head); a model
    or option that allows none raises."""
    workers, batch, layers = num_workers, batch_size, len(pipeline_layers(model))
    if train.stages > layers:
        raise ConfigError(f"train.stages={train.stages} but the model has only {layers} top-level layer(s) "
                          "to cut between stages",
                          hint=f"use stages <= {layers}, or split the model into more nn.Sequential layers")
    wanted = [train.stages] if train.stages else [k for k in range(2, workers + 1) if workers % k == 0]
    candidates = [k for k in wanted if k <= layers]
    if not candidates:
        raise ConfigError(f"strategy='hybrid' with num_workers={workers} needs a stage count K >= 2 dividing "
                          f"{workers} and at most the model's {layers} top-level layer(s); there is none",
                          hint="change num_workers, or split the model into more layers")
    microbatches, k = train.microbatches, min(candidates)
    if microbatches and microbatches > k * batch:
        raise ConfigError(f"train.microbatches={microbatches} is larger than the per-replica batch "
                          f"({k} stages x batch_size {batch} = {k * batch} rows): some micro-batches would be empty",
                          hint=f"use microbatches <= {k * batch}, or raise batch_size")
    return candidates


def _best_memory(profile: ModelProfile, train: TrainConfig, batch_size: int, stages: int, microbatches: int,
                 schedule: str) -> int:
    """The smallest achievable largest-stage memory for K stages (for the error message)."""
    sizes = [stage_memory(profile, train, batch_size, i, i + 1, 0, stages, microbatches, schedule).total
             for i in range(len(profile.layers))]
    cuts = balanced_cuts(sizes, stages)
    return max(e.total for e in hybrid_memory(profile, train, batch_size, cuts, microbatches, schedule))


def describe(layout: HybridLayout, profile: ModelProfile, memory: list[MemoryEstimate]) -> dict[str, str]:
    """MLflow params: where the cuts fell and what each stage was predicted to cost."""
    costs = stage_costs([layer.seconds for layer in profile.layers], list(layout.cuts))
    return {
        "hybrid.stages": str(layout.stages), "hybrid.replicas": str(layout.replicas),
        "hybrid.microbatches": str(layout.microbatches), "hybrid.schedule": layout.schedule,
        "hybrid.stage_layers": " | ".join(f"{a}-{b - 1}" for a, b in zip(layout.cuts, layout.cuts[1:])),
        "hybrid.stage_ms": " | ".join(f"{1000 * c:.3f}" for c in costs),
        "hybrid.stage_memory_mib": " | ".join(f"{e.total / 2**20:.1f}" for e in memory),
        "hybrid.grid": str([list(r) for r in layout.grid]) + (" (placed on measured links at run time)"
                                                               if layout.executor_links else ""),
    }


def _raise_uncuttable(profile: ModelProfile, stages: int) -> None:
    blocked = [f"{layer.index} ({layer.kind}: {layer.out_dtype})" for layer in profile.layers[:-1]
               if not layer.out_dtype.startswith(("float", "bfloat"))]
    raise ModelError(f"the model cannot be cut into {stages} stages: gradients cannot flow back through the "
                     f"non-float outputs of layer(s) {', '.join(blocked)}",
                     hint="use fewer stages, or wrap each such layer with its neighbours in one nn.Sequential")


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB"
