"""Build the planner's candidates for one model, configuration and cluster, and choose (driver side).

Compute: each top-level layer's forward + backward is timed on the driver with a rank's thread count
(planner/profile.py) and converted to FLOPs at the driver's measured matrix-product rate; a rank's
time is then those FLOPs at the rank's measured rate (planner/cluster.py), so layers that run below
peak (small or element-wise ones) keep their real cost. Network: the slowest measured link, or the
emulated one. Then every candidate of ALGORITHMS.md's list is priced by planner/cost.py:
data parallel; DiLoCo with H from the measured compute and sync times (planner/uneven.py); hybrid for each K dividing W with m in {K, 2K, 4K, 8K};
IST for eligible MLPs. Infeasible ones stay in the table with the reason.

Every candidate is priced twice when the calibration measured its spread: as measured (medians) and
at its optimistic end (best repeats, ranks within HETEROGENEOUS of each other counted as equal), and
planner/plan.py `decide` switches to an approximate strategy only when it wins at both ends.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from sparkdl.config.elastic import is_elastic
from sparkdl.config import DataConfig, LaunchConfig, TrainConfig
from sparkdl.planner.budget import rank_memory_budget
from sparkdl.data.epochs import epoch_plan, expected_row_counts
from sparkdl.planner import cost
from sparkdl.planner.cluster import ClusterInfo
from sparkdl.planner.ends import HETEROGENEOUS, CalibrationEnd, calibration_ends, island_groups
from sparkdl.planner.islands import IslandLinks
from sparkdl.planner.outer_candidates import (island_candidate, streamed_rounds, streaming_candidate, streaming_options,
                                              user_wire)
from sparkdl.planner.speed import matmul_flops
from sparkdl.planner.partition import balanced_cuts
from sparkdl.planner.plan import Candidate, Plan, decide
from sparkdl.planner.plan_notes import explained, plan_notes
from sparkdl.planner.profile import ModelInput, ModelProfile, profile_sequential
from sparkdl.planner.stages import optimizer_bytes_per_param
from sparkdl.planner.step_trial import full_step_s, lock_step_s, scale_to_trial
from sparkdl.planner.steps_to_loss import rounds_factor, with_steps_factors
from sparkdl.planner.transformer_cost import planned_layers, priced_as_transformer, transformer_facts
from sparkdl.planner.ist_pricing import IST_R, ist_estimate, ist_refusal
from sparkdl.planner.uneven import H_MIN, balanced, diloco_rounds



def layer_costs(model: nn.Module, num_features: "ModelInput | int", rows: int, driver_flops: float,
                speed_ratio: float, precision: str = "32") -> tuple[ModelProfile, tuple[cost.LayerCost, ...]]:
    """Per-layer cost from two timed batch sizes: time(n) = overhead + n x per-row time, the per-row
    time expressed in FLOPs at the driver's matrix-product rate, the overhead scaled by the rank's
    speed relative to the driver (speed_ratio = driver FLOP/s / rank FLOP/s)."""
    small = max(1, rows // 8)
    whole = not isinstance(model, nn.Sequential)
    seq = nn.Sequential(model) if whole else model
    large_profile = profile_sequential(seq, ModelInput.of(num_features), rows=rows, precision=precision,
                                       whole_model=whole)
    small_profile = profile_sequential(seq, ModelInput.of(num_features), rows=small, precision=precision,
                                       whole_model=whole)
    layers = []
    for big, little in zip(large_profile.layers, small_profile.layers):
        per_row = max((big.seconds - little.seconds) / (rows - small), 0.0) if rows > small else big.seconds / rows
        overhead = max(big.seconds - per_row * rows, 0.0)
        target = seq[big.index]
        trainable = sum(p.numel() for p in target.parameters() if p.requires_grad)
        layers.append(cost.LayerCost(params=trainable, frozen_params=big.params - trainable,
                                     flops=per_row * driver_flops / 3, out_bytes=big.out_bytes,
                                     saved_bytes=big.saved_bytes, kind=big.kind,
                                     in_features=getattr(target, "in_features", 0),
                                     out_features=getattr(target, "out_features", 0),
                                     overhead_s=overhead * speed_ratio, backward_share=big.backward_share))
    return large_profile, tuple(layers)


@dataclass(frozen=True)
class ModelCosts:
    """The model as measured on the driver, whatever the cluster: per-row work in FLOPs and fixed
    costs (per layer call, per step) at the driver's speed, scaled to a rank's speed when priced."""

    profile: ModelProfile
    layers: tuple[cost.LayerCost, ...]
    subnet: tuple[cost.LayerCost, ...] | None  # one rank's IST subnet, when IST applies
    step_overhead_s: float  # loss, optimizer update, zero_grad
    driver_flops: float
    threads: int
    num_features: int  # feature_cols runs; 0 when input_bytes says what a row weighs
    input_bytes: float = 0.0  # per row, of an input_cols run's inputs as delivered
    transformer_note: str = ""  # a transformer's counted costs beside the measured (planner/transformer_cost.py)
    profile_s: float = 0.0  # wall seconds profiling took on the driver


def build_plan(model: nn.Module, data: DataConfig, train: TrainConfig, launch: LaunchConfig,
               num_features: "ModelInput | int", cluster: ClusterInfo, backend_ops: frozenset[str], threads: int = 1,
               num_rows: int | None = None) -> Plan:
    """Price every candidate layout and choose; `num_rows` (the training rows, when known) lets the
    choice weigh the whole run, not only one step."""
    costs = profile_model(model, data, train, launch, num_features, threads)
    return price_plan(model, data, train, launch, costs, cluster, backend_ops, num_rows)


def profile_model(model: nn.Module, data: DataConfig, train: TrainConfig, launch: LaunchConfig,
                  num_features: "ModelInput | int", threads: int = 1) -> ModelCosts:
    """Time the model's layers, its IST subnet and one full step on the driver with a rank's threads,
    on random feature rows or (input_cols runs, a ModelInput) the run's own sample rows."""
    import time

    began = time.perf_counter()
    model_input = ModelInput.of(num_features)
    rows = data.batch_size
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)  # time layers as a rank will run them
    try:
        driver_flops = matmul_flops(threads)
        profile, layers = layer_costs(planned_layers(model, train.loss) or model, num_features, rows, driver_flops,
                                      1.0, train.precision)
        transformer = transformer_facts(model, model_input.sample) if model_input.sample is not None else None
        measured_flops = sum(layer.flops for layer in layers)
        layers = priced_as_transformer(layers, transformer, train.precision)
        note = transformer.describe(data.batch_size, train.precision, measured_flops) if transformer else ""
        subnet = _ist_subnet_costs(model, launch.num_workers, num_features, rows, driver_flops, 1.0)
        try:
            full_step = full_step_s(model, train, num_features, rows)
        except Exception:  # noqa: BLE001 - a custom loss with other targets: no overhead term
            full_step = 0.0
        overhead = max(full_step - sum(layer.seconds for layer in profile.layers), 0.0)
    finally:
        torch.set_num_threads(previous)
    width = model_input.shape[0] if model_input.sample is None and len(model_input.shape) == 1 else 0
    return ModelCosts(profile, layers, subnet, overhead, driver_flops, threads, width,
                      0.0 if width else model_input.bytes_per_row, note, time.perf_counter() - began)


def price_plan(model: nn.Module, data: DataConfig, train: TrainConfig, launch: LaunchConfig, costs: ModelCosts,
               cluster: ClusterInfo, backend_ops: frozenset[str], num_rows: int | None = None) -> Plan:
    """Price every candidate at each end of the calibration and decide (planner/plan.py `decide`):
    an approximate strategy must win at both ends. Data parallel with rows re-split by speed is
    offered when the ranks are unequal as measured (medians): it changes no update, so it needs no
    robustness across the ends, and the optimistic end (best repeats) sees a CPU-quota'd host at
    full speed (one short matrix product fits in its quota slice)."""
    budget = rank_memory_budget(launch, cluster)
    ends = calibration_ends(cluster, launch, island_groups(cluster, train.islands, launch,
                                                                   backend_ops))
    unequal = max(ends[0].speeds) > HETEROGENEOUS * min(ends[0].speeds)
    # DiLoCo's H from the measured end's compute and sync times, the same at both ends (decide
    # compares the same candidates).
    measured_work = _workload(data, train, launch, costs, ends[0])[0]
    from sparkdl.strategies.diloco import layer_groups

    steps = run_steps(data, train, launch, num_rows) if num_rows else None
    every = (diloco_rounds(cost.data_parallel(measured_work, ends[0].net).compute_s * measured_work.accumulate,
                           cost.outer_sync_s(measured_work.params, measured_work.world, ends[0].net,
                                             user_wire(train))[0], train.fragments, steps,
                           rounds_factor(measured_work.params, measured_work.world, train.sync_dtype)),
             streamed_rounds(measured_work, ends[0].net, train, len(layer_groups(model)), "subgroup" in backend_ops,
                             steps))
    priced = [with_steps_factors(_price_end(model, data, train, launch, costs, end, budget, backend_ops, unequal,
                                            every), measured_work.params, launch.num_workers)
              for end in ends]
    decision = decide(priced[0], priced[1] if len(priced) > 1 else None, train.approximate_min_speedup, steps)
    measured = ends[0]
    emulated = launch.emulate_network
    return Plan(candidates=tuple(explained(priced[0], decision, train.approximate_min_speedup)),
                chosen=decision.index, world=launch.num_workers, latency_s=measured.latency_s,
                bandwidth_Bps=measured.bandwidth_Bps, emulated=bool(emulated), memory_budget=budget,
                notes=tuple(plan_notes(data, launch, cluster, costs, ends, unequal, decision))
                + _overlap_notes(measured_work, ends[0].net, train, launch) + _trial_notes(data, costs, cluster, ends[0]),
                executor_links=() if emulated else cluster.executor_links(), hinge=decision.hinge, steps=steps)


def _trial_notes(data: DataConfig, costs: ModelCosts, cluster: ClusterInfo, end: CalibrationEnd) -> tuple[str, ...]:
    """explain()'s lines on the model step (and IST round) timed on the ranks against the driver's profile."""
    if end.step_s <= 0:
        return ()
    layers, _, overhead = _at_rank_speed(costs, end)
    profiled = cost.layers_compute_s(layers, data.batch_size, min(end.speeds)) + overhead
    factor = scale_to_trial(profiled, end.step_s)
    used = f"every layer's cost scaled by {factor:.2f} to match it" if factor != 1.0 else \
        "too far from the profile to trust: the profile's costs stand"
    best = lock_step_s(cluster.best_step_s)
    return (f"compute: the model's training step timed on the ranks: {end.step_s * 1e3:.2f} ms at batch "
            f"{data.batch_size} (slowest rank's median of up to {cluster.step_repeats} steps, within "
            f"{cluster.step_rse:.1%}; best {best * 1e3:.2f} ms); the driver's profile alone predicted "
            f"{profiled * 1e3:.2f} ms: {used}",) + ((
        f"IST: one round of {cluster.ist_every} steps timed on the ranks prices it: "
        f"{end.ist_round[0] * 1e3:.2f} ms a subnet step, {end.ist_round[1] * 1e3:.1f} ms the sync",)
        if end.ist_round[0] > 0 else ())


def _overlap_notes(work: cost.Workload, net: cost.Network, train: TrainConfig, launch: LaunchConfig
                   ) -> tuple[str, ...]:
    """explain()'s line on data parallel's gradient buckets against backward (planner/overlap.py)."""
    line = cost.overlap_note(work, net, grad_overlap(train, launch))
    return (f"data parallel's gradients: {line}",) if line else ()


def run_steps(data: DataConfig, train: TrainConfig, launch: LaunchConfig, num_rows: int,
              row_counts: Sequence[int] | None = None) -> int:
    """The run's optimizer steps over `num_rows` training rows, by the rule every rank follows
    (data/epochs.py): over `row_counts` when the shards are known, else the equal shards of a
    round-robin repartition. With batches shared by speed only the global batch matters (every
    row once over all ranks), so any split of it gives these steps."""
    workers = launch.num_workers
    shards = tuple(row_counts) if row_counts is not None else expected_row_counts(num_rows, workers)
    by_speed = train.batch_balance == "speed" and workers > 1
    shares = (data.batch_size,) * workers if by_speed else None
    return epoch_plan(shards, data, shares).steps * train.epochs


def grad_overlap(train: TrainConfig, launch: LaunchConfig) -> float:
    """The share of backward that data parallel's allreduce hides behind: all of it with gradient
    buckets reduced during backward (train.overlap_grads on the torch backend, whose allreduce runs in
    the background; not under an emulated network, which averages after backward), else none."""
    return 1.0 if train.overlap_grads and launch.backend == "torch" and not launch.emulate_network else 0.0


def _at_rank_speed(costs: ModelCosts, end: CalibrationEnd
                   ) -> tuple[tuple[cost.LayerCost, ...], tuple[cost.LayerCost, ...] | None, float]:
    """The driver's profile at this end's slowest rank (lock-step): its layers, IST's subnet layers
    and the per-step cost, fixed costs scaled by driver FLOP/s / rank FLOP/s (a slower rank runs them
    slower alike)."""
    ratio = costs.driver_flops / min(end.speeds)
    layers = tuple(dataclasses.replace(layer, overhead_s=layer.overhead_s * ratio) for layer in costs.layers)
    subnet = tuple(dataclasses.replace(layer, overhead_s=layer.overhead_s * ratio) for layer in costs.subnet) \
        if costs.subnet else None
    return layers, subnet, costs.step_overhead_s * ratio


def _workload(data: DataConfig, train: TrainConfig, launch: LaunchConfig, costs: ModelCosts, end: CalibrationEnd
              ) -> tuple[cost.Workload, tuple[cost.LayerCost, ...] | None]:
    """One rank's step as this end prices it, at the slowest rank's speed (lock-step), and IST's
    subnet layers alike; every cost scaled to the model step timed on the ranks where there is one
    (planner/step_trial.py: the profile splits the step among layers, the trial says how long it is)."""
    slowest = min(end.speeds)
    layers, subnet, overhead = _at_rank_speed(costs, end)
    factor = scale_to_trial(cost.layers_compute_s(layers, data.batch_size, slowest) + overhead, end.step_s)
    if factor != 1.0:
        layers, subnet, overhead = _scaled(layers, factor), _scaled(subnet, factor) if subnet else None, \
            overhead * factor
    per_param = optimizer_bytes_per_param(dataclasses.replace(train, sync="allreduce"))
    work = cost.Workload(layers=layers, world=launch.num_workers, rows=data.batch_size,
                         flops_per_s=slowest, optimizer_bytes_per_param=per_param,
                         input_bytes_per_row=costs.input_bytes or 4.0 * costs.num_features,
                         step_overhead_s=overhead, accumulate=train.accumulate_steps)
    return work, subnet


def _scaled(layers: tuple[cost.LayerCost, ...], factor: float) -> tuple[cost.LayerCost, ...]:
    """Layers whose work and fixed cost take `factor` times as long."""
    return tuple(dataclasses.replace(layer, flops=layer.flops * factor, overhead_s=layer.overhead_s * factor)
                 for layer in layers)


def _price_end(model: nn.Module, data: DataConfig, train: TrainConfig, launch: LaunchConfig, costs: ModelCosts,
               end: CalibrationEnd, budget: float | None, backend_ops: frozenset[str],
               unequal: bool, diloco_every: tuple[int, int]) -> list[Candidate]:
    """Every candidate priced with this end's speeds and network."""
    work, subnet = _workload(data, train, launch, costs, end)
    ist = ist_estimate(model, work, end.net, subnet, ist_refusal(data, costs.input_bytes > 0), end.ist_round)
    candidates = _candidates(model, data, train, launch, work, end.net, budget, backend_ops, costs.profile, ist,
                             islands=end.islands, diloco_every=diloco_every)
    if unequal:
        # DT-FM: rows re-split by speed; every rank then takes about the mean rank's time per step.
        estimate = balanced(work, end.net, end.speeds, work.input_bytes_per_row, grad_overlap(train, launch))
        feasible, why = _fits(estimate.memory_bytes, budget)
        how = "dynamic" if "send_recv" in backend_ops else "speed"  # rows moved point to point, else fixed shares
        candidates.insert(1, Candidate("data_parallel", (("strategy", "data_parallel"), ("sync", "allreduce"),
                                                         ("batch_balance", how)),
                                       estimate.step_s, estimate.bytes_per_step, estimate.memory_bytes, feasible, why,
                                       compute_s=estimate.compute_s, comm_s=estimate.comm_s))
    return candidates


def _ist_subnet_costs(model: nn.Module, workers: int, num_features: "ModelInput | int", rows: int,
                      driver_flops: float, ratio: float) -> tuple[cost.LayerCost, ...] | None:
    """The measured cost of one rank's IST subnet (round 0), or None when IST does not apply (it
    trains MLPs on one float feature vector: never tensor columns)."""
    from sparkdl.strategies.ist import extract_subnet, ist_layout, partition

    if workers < 2 or ModelInput.of(num_features).sample is not None:
        return None
    try:
        layout = ist_layout(model, workers, IST_R, "scale", 0)
    except Exception:  # noqa: BLE001 - ineligible: the candidate carries the reason
        return None
    subnet = extract_subnet(model, layout, partition(layout, 0), 0)
    return layer_costs(subnet, num_features, rows, driver_flops, ratio)[1]


def _fits(memory: float, budget: float | None) -> tuple[bool, str]:
    if budget is not None and memory > budget:
        return False, f"needs {memory / 2**20:.1f} MiB per rank, over the budget"
    return True, ""


def _candidates(model: nn.Module, data: DataConfig, train: TrainConfig, launch: LaunchConfig, work: cost.Workload,
                net: cost.Network, budget: float | None, backend_ops: frozenset[str], profile: ModelProfile,
                ist: tuple[cost.Estimate, bool, str], islands: IslandLinks | None = None,
                diloco_every: tuple[int, int] = (H_MIN, H_MIN)) -> list[Candidate]:
    """`ist`: IST's estimate, whether it may train the run and why not (planner/ist_pricing.py);
    `islands`: the islands the measured links form (an islands candidate is priced on them);
    `diloco_every`: H of plain and of streamed DiLoCo, chosen on the measured calibration."""
    from sparkdl.strategies.diloco import layer_groups

    out: list[Candidate] = []

    def add(strategy: str, options: dict[str, Any], estimate: cost.Estimate, feasible: bool, reason: str) -> None:
        if feasible and launch.emulate_speed and strategy in ("hybrid", "ist"):
            feasible, reason = False, "launch.emulate_speed emulates data-parallel ranks only"
        if feasible and (strategy in ("hybrid", "ist") or options.get("islands")) and is_elastic(launch):
            feasible, reason = False, "the run may change its workers (min_workers/max_workers): its stages, " \
                                      "subnets or islands are not re-cut from a checkpoint"
        if feasible:
            feasible, reason = _fits(estimate.memory_bytes, budget)
        out.append(Candidate(strategy=strategy, options=tuple(options.items()),
                             predicted_step_s=estimate.step_s, bytes_per_step=estimate.bytes_per_step,
                             memory_bytes=estimate.memory_bytes, feasible=feasible, reason=reason,
                             compute_s=estimate.compute_s, comm_s=estimate.comm_s))

    add("data_parallel", {"strategy": "data_parallel", "sync": "allreduce"},
        cost.data_parallel(work, net, grad_overlap(train, launch)), True, "")
    add("diloco", {"strategy": "data_parallel", "sync": "diloco", "sync_every": diloco_every[0]},
        cost.diloco(work, net, diloco_every[0], user_wire(train)), True, "")
    workers = work.world
    layers = len(profile.layers)
    streamed = streaming_options(train, len(layer_groups(model)), "subgroup" in backend_ops, diloco_every[1])
    if streamed is not None and workers >= 2:
        add(*streaming_candidate(work, net, streamed), True, "")
    if islands is not None:
        add(*island_candidate(work, islands, train, streamed), True, "")
    if workers >= 2:
        gathers = "allgather" in backend_ops
        add("sharded", {"strategy": "sharded"}, cost.sharded(work, net), gathers,
            "" if gathers else "the backend has no allgather")
    has_p2p = {"send_recv", "subgroup"} <= backend_ops
    for stages in [k for k in range(2, workers + 1) if workers % k == 0]:
        for micro in sorted({stages, 2 * stages, 4 * stages, 8 * stages}):
            options = {"strategy": "hybrid", "stages": stages, "microbatches": micro}
            pipelined = planned_layers(model, train.loss) is not None
            if not pipelined or stages > layers:
                why = f"{stages} stages > {layers} layers" if pipelined else \
                    "not an nn.Sequential or a transformer to cut (loss='model' runs the whole forward)" \
                    if train.loss == "model" else "not an nn.Sequential or a transformer of a known family"
                out.append(Candidate("hybrid", tuple(options.items()), math.inf, math.inf, math.inf, False, why))
                continue
            if micro > stages * work.rows:
                continue
            cuts = balanced_cuts([layer.seconds for layer in profile.layers], stages)
            add("hybrid", options, cost.hybrid(work, net, cuts, micro, train.schedule == "1f1b"),
                has_p2p, "" if has_p2p else "the backend has no point-to-point messages")
    if workers >= 2:
        add("ist", {"strategy": "ist", "ist_sync_every": IST_R}, *ist)
    return out
