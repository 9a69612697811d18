"""Driver: from options to a strategy's plan. `strategy="auto"` asks the planner (profile, calibrated
cluster, cost model); hybrid gets its stage layout and IST its partition layout; bad combinations
raise here, before any job. Composed by api.fit and api.plan.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sparkdl.config import DataConfig, LaunchConfig, TrackingConfig, TrainConfig, merged_section, train_with
from sparkdl.driver.calibration import calibrate, remeasure, session_facts

if TYPE_CHECKING:
    from sparkdl.config.embeddings import EmbeddingConfig
    from sparkdl.data.layout import FeedLayout
    from sparkdl.model.layouts import StrategyLayout
    from sparkdl.planner.resolved import ResolvedPlan


def worker_threads(launch: LaunchConfig, cluster: Any = None) -> int:
    """torch threads a training rank gets: what the calibration's ranks reported they ran with (the
    probe runs under the same launch.threads_per_worker, so executor/worker.py's own rule applies to
    it), else the configured count, else one."""
    if cluster is not None and cluster.threads_per_rank:
        return min(cluster.threads_per_rank)
    return launch.threads_per_worker or 1


def settle_without_planner(train: TrainConfig, launch: LaunchConfig) -> TrainConfig:
    """Under strategy="auto", the concrete strategy when there is nothing to plan: options only one
    strategy has (sync="diloco", stages, microbatches) name it, and one worker is data parallel."""
    if train.strategy != "auto":
        return train
    implied = train.implied_strategy
    if implied == "auto" and launch.num_workers == 1:
        implied = "data_parallel"
    return train if implied == "auto" else merged_section("train", train, {"strategy": implied})


def balanced_by_measurement(train: TrainConfig, launch: LaunchConfig, data: DataConfig, layout: Any) -> TrainConfig:
    """Under strategy="auto", exact data parallel and sharded re-split their batch by the speeds they
    measure all run long (batch_balance="dynamic"), not only as calibrated: a calibration is a
    snapshot, and a host that slows down later (a noisy neighbour) would otherwise set every rank's
    pace. Nothing moves while the ranks stay within executor/rebalance.py's hysteresis. Rows move
    as assembled tensors of one shape, so batches whose shape each batch decides (a tokenizer's
    padding or packing, ragged columns) keep equal shares."""
    from sparkdl.data.text import rows_keep_one_shape

    if train.strategy not in ("data_parallel", "sharded") or train.sync != "allreduce" \
            or train.batch_balance != "equal" or launch.backend != "torch" or launch.num_workers < 2 \
            or not rows_keep_one_shape(data.tokenizer, layout):
        return train
    return merged_section("train", train, {"batch_balance": "dynamic"})


def find_declared_islands(spark: Any, train: TrainConfig, launch: LaunchConfig) -> TrainConfig:
    """train.islands=K: the K islands the measured links form (planner/islands.py), as host groups."""
    from sparkdl.errors import ConfigError
    from sparkdl.planner.islands import find_islands, host_of

    count = train.islands
    cluster = calibrate(spark, launch.num_workers, launch.threads_per_worker)
    hosts = [host_of(e) for e in cluster.rank_executors]
    found = find_islands(hosts, cluster.latency_s, cluster.bandwidth_Bps, count) if hosts else None
    if found is None:
        raise ConfigError(f"train.islands={count}, but the {launch.num_workers} workers run on "
                          f"{len(set(hosts))} host(s): an island is one host or more",
                          hint="use fewer islands, or name them: islands=[['h1', 'h2'], ['h3', 'h4']]")
    return merged_section("train", train, {"islands": found.islands})


def make_plan(module: Any, data: DataConfig, train: TrainConfig, launch: LaunchConfig, tracking: TrackingConfig,
              num_features: Any, spark: Any, num_rows: int | None = None,
              fallback: bool = False) -> Any:
    """Profile the model, measure (or recall) the cluster, price every layout, choose one.

    When the calibration's two ends disagree on exact vs approximate, the cluster is measured once
    more and the plan decided on the best of both calibrations (planner/plan.py `decide`).
    With `fallback` (a fit under strategy="auto"), a model the planner cannot profile on the driver
    (a forward that depends on call counts, inputs it does not expect, ...) trains data parallel
    with a warning instead of failing: planning is an optimisation, not a new way to fail. Without
    it (sparkdl.plan) that is a ModelError."""
    import logging
    import warnings

    from sparkdl.comm import backend_class
    from sparkdl.errors import ModelError, ResourceError, SparkdlError
    from sparkdl.planner.candidates import price_plan, profile_model
    from sparkdl.planner.ist_pricing import ist_trial_layout
    from sparkdl.planner.cluster import for_model
    from sparkdl.planner.plan import NoFeasibleLayout
    from sparkdl.planner.step_trial import step_trial

    trial = step_trial(module, data, train, launch, num_features,
                       ist_trial_layout(module, data, launch, num_features))
    cluster = for_model(calibrate(spark, launch.num_workers, launch.threads_per_worker, trial=trial),
                        trial.key if trial is not None else "")
    ops = backend_class(launch.backend).ops
    try:
        threads = worker_threads(launch, cluster)
        costs = profile_model(module, data, train, launch, num_features, threads)
        result = price_plan(module, data, train, launch, costs, cluster, ops, num_rows)
    except NoFeasibleLayout as exc:
        raise ResourceError(f"the planner found no layout that fits: {exc}",
                            hint="raise launch.max_memory_per_rank, add workers, or lower batch_size") from None
    except SparkdlError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the user's model raises while profiled
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if not fallback:
            raise ModelError(f"the planner could not profile the model on the driver: {reason}",
                             hint="name a strategy instead of 'auto', e.g. strategy='data_parallel'") from exc
        message = (f"sparkdl: strategy='auto' could not profile the model on the driver ({reason}); "
                   "training data parallel. Name a strategy to silence this.")
        warnings.warn(message, stacklevel=3)
        logging.getLogger("sparkdl").warning(message)
        return None
    if result.hinge and cluster.probes == 1:
        result = _decide_again(spark, module, data, train, launch, costs, cluster, ops, num_rows, result, trial)
    logging.getLogger("sparkdl").info("%s", result.explain())
    if tracking.progress:
        print(result.explain(), flush=True)
    return result


def _decide_again(spark: Any, module: Any, data: DataConfig, train: TrainConfig, launch: LaunchConfig, costs: Any,
                  cluster: Any, ops: frozenset[str],
                  num_rows: int | None, first: Any, trial: Any = None) -> Any:
    """The calibration's ends disagreed: measure once more and decide on the best of both. The
    first plan stands (exact, with its hinge explained) when the second probe fails: a second
    opinion is an improvement, not a new way to fail."""
    import logging

    from sparkdl.planner.candidates import price_plan

    try:
        cluster = remeasure(spark, cluster, launch.threads_per_worker, trial)
        return price_plan(module, data, train, launch, costs, cluster, ops, num_rows)
    except Exception as exc:  # noqa: BLE001 - any failure of the second probe keeps the first plan
        logging.getLogger("sparkdl").warning("sparkdl: measuring the cluster again failed (%s: %s); keeping the "
                                             "first plan", type(exc).__name__, str(exc).splitlines()[0][:200])
        return first


def measured_links(spark: Any, train: TrainConfig, launch: LaunchConfig) -> tuple[tuple[str, str, float, float], ...]:
    """For an explicitly hybrid run: links between executors from an earlier calibration of this
    cluster, if one is cached (no probe is started for it); otherwise none (the default grid)."""
    if train.strategy != "hybrid" or launch.emulate_network:
        return ()
    from sparkdl.planner.cluster import cached

    cluster = cached(session_facts(spark, launch.num_workers))
    return cluster.executor_links() if cluster is not None else ()


def model_input(layout: FeedLayout, sample: Any = None) -> Any:
    """What the planner feeds the model: random rows of the feature width, or (input_cols runs) the
    probe batch of real rows, `sample` = (inputs, label, weight) as data/assemble.py makes it."""
    from sparkdl.planner.profile import ModelInput

    if sample is None or not layout.tensor_inputs:
        return ModelInput.of(layout.num_features)
    return ModelInput.from_sample(sample[0], sample[1])


def resolve(module: Any, data: DataConfig, train: TrainConfig, launch: LaunchConfig, tracking: TrackingConfig,
            layout: FeedLayout, spark: Any, num_rows: int | None = None, *, plan: ResolvedPlan | None = None,
            fallback: bool = True, sample: Any = None, embeddings: EmbeddingConfig | None = None,
            rows: Any = None) -> ResolvedPlan:
    """The one resolved plan of a run: a kept `plan` checked against this model and data, or the
    named strategy's layout, or (strategy="auto") the planner's choice and then its layout. Every
    configuration that cannot run raises here, before any job. The plan carries the train section
    the run trains with (`ResolvedPlan.train`). `fallback`: see make_plan; `sample`: the probe batch
    of an input_cols run (see model_input); `embeddings`, `rows`: a sparse_cols run's section and
    prepared DataFrame (its ids are sampled to price the tables' placement)."""
    from sparkdl.driver.checks import check_backend, check_fragments, check_strategy_inputs
    from sparkdl.planner.resolved import ResolvedPlan

    if layout.sparse:
        from sparkdl.driver.embedding_plan import resolve_embeddings

        return resolve_embeddings(module, data, train, launch, layout, embeddings,
                                  lambda: calibrate(spark, launch.num_workers, launch.threads_per_worker), rows, num_rows,
                                  kept=plan)
    inputs = model_input(layout, sample)
    if plan is not None:
        return reuse(plan, module, data, train, launch, layout, inputs)
    train = settle_without_planner(train, launch)
    auto = None
    if train.strategy == "auto":
        auto = make_plan(module, data, train, launch, tracking, inputs, spark, num_rows, fallback=fallback)
        train = merged_section("train", train, auto.options if auto is not None else {"strategy": "data_parallel"})
        if (auto is None or auto.strategy != "islands") and train.islands:
            train = merged_section("train", train, {"islands": 0})  # the planner chose a layout without them
        train = balanced_by_measurement(train, launch, data, layout)
    elif isinstance(train.islands, int) and train.islands and train.sync == "diloco":
        train = find_declared_islands(spark, train, launch)
    check_strategy_inputs(train, layout)
    check_backend(train, launch)
    check_fragments(module, train)
    links = auto.executor_links if auto is not None else measured_links(spark, train, launch)
    strategy_layout, params = plan_strategy(module, data, train, launch, layout, links, priced=auto is not None,
                                            inputs=inputs)
    if auto is not None:
        params.update(auto.as_params())
    return ResolvedPlan.build(train, launch.num_workers, strategy_layout, params, auto)


def reuse(plan: ResolvedPlan, module: Any, data: DataConfig, train: TrainConfig, launch: LaunchConfig,
          layout: FeedLayout, inputs: Any = None) -> ResolvedPlan:
    """A kept plan (sparkdl.plan's value, plan.json of an earlier run) applied to this run: its layout
    options replace the run's, and its layout must fit this model, input and world, else a
    ConfigError naming `plan` says what differs. Nothing is planned or measured again."""
    from sparkdl.driver.checks import check_backend, check_fragments, check_strategy_inputs
    from sparkdl.errors import ConfigError
    from sparkdl.planner.resolved import ResolvedPlan

    check_kept_world(plan, launch)
    named, kept = train.strategy, dict(plan.settings).get("strategy")
    if named not in ("auto", kept):
        raise ConfigError(f"train.strategy={named!r} contradicts plan=, which trains with {kept!r}",
                          hint=f"leave strategy unset (or 'auto') when passing a plan, or {_REPLAN}")
    train = train_with(data, train, launch, dict(plan.settings))
    check_strategy_inputs(train, layout)
    check_backend(train, launch)
    check_fragments(module, train)
    inputs = inputs if inputs is not None else model_input(layout)
    mismatch = _layout_mismatch(plan, module, data, train, launch, layout, inputs)
    if mismatch:
        raise ConfigError(f"plan= does not fit this run: {mismatch}", hint=_REPLAN)
    if plan.strategy in ("data_parallel", "diloco", "islands") or (plan.strategy == "ist" and plan.auto is None):
        from sparkdl.planner.stages import check_data_parallel_memory

        check_data_parallel_memory(module, data, train, launch, inputs)
    if plan.strategy == "ist" and train.ist_scale == "batchnorm":
        from sparkdl.strategies.ist import use_batch_statistics

        use_batch_statistics(module)  # the driver's copy must match the trained state's keys
    params = {**plan.as_params(), "plan.reused": "true"}
    return ResolvedPlan.build(train, launch.num_workers, plan.layout, params, plan.auto)


_REPLAN = "plan again for this model and data (sparkdl.plan), or drop plan= / plan_from_run="


def check_kept_world(plan: ResolvedPlan, launch: LaunchConfig) -> None:
    """A kept plan is for the world it was made for (cheap: checked before any Spark job)."""
    from sparkdl.errors import ConfigError

    if plan.world != launch.num_workers:
        raise ConfigError(f"plan= was made for {plan.world} workers, but launch.num_workers="
                          f"{launch.num_workers}", hint=f"pass num_workers={plan.world}, or {_REPLAN}")


def _stage_mismatch(kept: Any, module: Any, data: DataConfig, train: TrainConfig, launch: LaunchConfig,
                    inputs: Any) -> str:
    """What crosses the kept cuts must be what this model sends there (the receive buffers are
    sized from the layout), and every stage must still fit the memory budget; one-row dry run."""
    from sparkdl.config import parse_bytes
    from sparkdl.planner.profile import profile_sequential
    from sparkdl.planner.stages import stage_memory

    profile = profile_sequential(module, inputs, rows=1, precision=train.precision)
    for boundary, cut in enumerate(kept.cuts[1:-1]):
        layer = profile.layers[cut - 1]
        want = (tuple(kept.boundary_shapes[boundary]), kept.boundary_dtypes[boundary])
        if (tuple(layer.out_shape), layer.out_dtype) != want:
            return (f"after layer {cut - 1} its stages exchange {want[1]} rows of shape {list(want[0])}, this "
                    f"model's layer {cut - 1} outputs {layer.out_dtype} of shape {list(layer.out_shape)}")
    if launch.max_memory_per_rank is None:
        return ""
    budget = parse_bytes(launch.max_memory_per_rank, "launch.max_memory_per_rank")
    for stage in range(kept.stages):
        need = stage_memory(profile, train, data.batch_size, kept.cuts[stage], kept.cuts[stage + 1],
                            stage, kept.stages, kept.microbatches, kept.schedule).total
        if need > budget:
            return (f"its stage {stage} needs about {need / 2**20:.1f} MiB per rank at batch_size "
                    f"{data.batch_size}, over launch.max_memory_per_rank={launch.max_memory_per_rank!r}")
    return ""


def _layout_mismatch(plan: ResolvedPlan, module: Any, data: DataConfig, train: TrainConfig, launch: LaunchConfig,
                     layout: FeedLayout, inputs: Any) -> str:
    """What about this run the kept layout was not made for ("" when it fits)."""
    from sparkdl.model.layouts import HybridLayout, IstLayout

    kept = plan.layout
    if isinstance(kept, HybridLayout):
        from sparkdl.planner.transformer_cost import planned_layers

        layered = planned_layers(module, train.loss)  # a Sequential, or a transformer cut at its blocks
        if layered is None or len(layered) != kept.cuts[-1]:
            layers = len(layered) if layered is not None else f"a {type(module).__name__}"
            return (f"its hybrid cuts {list(kept.cuts)} are for an nn.Sequential of {kept.cuts[-1]} layers, "
                    f"the model has {layers}")
        module = layered
        if tuple(kept.input_specs) != tuple(inputs.specs):  # several inputs: their structure, shapes, dtypes
            return f"it was planned for the inputs {list(kept.input_specs)}, this data has {list(inputs.specs)}"
        if (tuple(kept.input_shape), kept.input_dtype) != (tuple(inputs.shape), inputs.dtype):
            return (f"it was planned for {kept.input_dtype} inputs of shape {list(kept.input_shape)} per row, this "
                    f"data has {inputs.dtype} of shape {list(inputs.shape)}")
        if (layout.label_dtype or "float32") != kept.label_dtype:
            return f"it was planned for {kept.label_dtype} labels, this run has {layout.label_dtype}"
        if kept.microbatches > kept.stages * data.batch_size:
            return (f"its {kept.microbatches} micro-batches exceed {kept.stages} stages x batch_size "
                    f"{data.batch_size} rows")
        return _stage_mismatch(kept, module, data, train, launch, inputs)
    elif isinstance(kept, IstLayout):
        from sparkdl.strategies.ist import ist_layout

        fresh = ist_layout(module, launch.num_workers, kept.sync_every, kept.scale, kept.seed)
        if (fresh.linears, fresh.norms, fresh.widths) != (kept.linears, kept.norms, kept.widths):
            return f"its IST layers (hidden widths {list(kept.widths)}) differ from the model's {list(fresh.widths)}"
    elif plan.strategy in ("hybrid", "ist"):
        return f"a {plan.strategy} plan without its layout"
    return ""


def plan_strategy(module: Any, data: DataConfig, train: TrainConfig, launch: LaunchConfig, layout: Any, links: Any = (),
                  priced: bool = False, inputs: Any = None) -> tuple[StrategyLayout, dict[str, str]]:
    """The strategy's driver-side layout (None for data parallel) and the MLflow params describing
    it; configurations that cannot run (stage counts, micro-batches, memory budget) raise here.
    `priced`: the planner chose this strategy and already priced its memory per rank against the
    budget (an IST rank keeps optimizer state for its subnet only, which the whole-model check of
    data parallel would overstate)."""
    from sparkdl.planner.stages import check_data_parallel_memory, check_sharded_memory, describe, plan_hybrid

    inputs = inputs if inputs is not None else model_input(layout)
    if train.strategy == "hybrid":
        hybrid, profile, memory = plan_hybrid(module, data, train, launch, inputs,
                                              layout.label_dtype or "float32", links)
        return hybrid, describe(hybrid, profile, memory)
    if train.strategy == "sharded":
        from sparkdl.planner.transformer_cost import planned_layers

        estimate = check_sharded_memory(module, data, train, launch, inputs)
        layers = len(planned_layers(module, train.loss) or [module]) or 1
        params = {"sharded.ranks": str(launch.num_workers), "sharded.layers": str(layers)}
        if estimate is not None:
            params["sharded.memory_per_rank_bytes"] = str(estimate.total)
        return None, params
    if not (priced and train.strategy == "ist"):
        check_data_parallel_memory(module, data, train, launch, inputs)
    if train.strategy == "ist":
        return plan_ist(module, train, launch)
    return None, {}


def plan_ist(module: Any, train: TrainConfig, launch: LaunchConfig) -> tuple[Any, dict[str, str]]:
    import logging
    import warnings

    from sparkdl.strategies.ist import MIN_NEURONS_PER_RANK, ist_layout, narrow_layers, use_batch_statistics

    layout = ist_layout(module, launch.num_workers, train.ist_sync_every, train.ist_scale, train.seed)
    narrow = narrow_layers(layout)
    if narrow:
        message = (f"sparkdl: IST deals each hidden layer's neurons over {layout.world} workers; "
                   f"{', '.join(narrow)} are narrower than {MIN_NEURONS_PER_RANK} x {layout.world}, where the "
                   "IST papers saw accuracy drop. Wider layers or fewer workers are safer.")
        warnings.warn(message, stacklevel=3)
        logging.getLogger("sparkdl").warning(message)
    if train.ist_scale == "batchnorm":
        use_batch_statistics(module)  # the driver's copy must match the trained state's keys
    return layout, {"ist.hidden_widths": str(list(layout.widths)), "ist.linear_layers": str(list(layout.linears)),
                    "ist.neurons_per_worker": str([w // layout.world for w in layout.widths])}
