"""Driver: from options to a strategy's plan. `strategy="auto"` asks the planner (profile, calibrated
cluster, cost model); hybrid gets its stage layout and IST its partition layout; bad combinations
raise here, before any job. Composed by api.fit and api.plan.
"""
from __future__ import annotations

from typing import Any

from sparkdl.config import RunConfig


def worker_threads(spark: Any, config: RunConfig) -> int:
    """torch threads a training rank will get (as launch/worker.py chooses them)."""
    import os

    if config.launch.threads_per_worker:
        return config.launch.threads_per_worker
    master = spark.sparkContext.master
    if master.startswith("local"):
        return max(1, (os.cpu_count() or 1) // config.launch.num_workers)
    return max(1, int(spark.sparkContext.getConf().get("spark.task.cpus", "1")))


def settle_without_planner(config: RunConfig) -> RunConfig:
    """Under strategy="auto", the concrete strategy when there is nothing to plan: options only one
    strategy has (sync="diloco", stages, microbatches) name it, and one worker is data parallel."""
    train = config.train
    if train.strategy != "auto":
        return config
    implied = train.implied_strategy
    if implied == "auto" and config.launch.num_workers == 1:
        implied = "data_parallel"
    return config if implied == "auto" else config.merged({"train": {"strategy": implied}})


def make_plan(module: Any, config: RunConfig, num_features: int, spark: Any, num_rows: int | None = None,
              fallback: bool = False) -> Any:
    """Profile the model, measure (or recall) the cluster, price every layout, choose one.

    With `fallback` (a fit under strategy="auto"), a model the planner cannot profile on the driver
    (a forward that depends on call counts, inputs it does not expect, ...) trains data parallel
    with a warning instead of failing: planning is an optimisation, not a new way to fail. Without
    it (sparkdl.plan) that is a ModelError."""
    import logging
    import warnings

    from sparkdl.comm import backend_class
    from sparkdl.errors import ModelError, ResourceError, SparkdlError
    from sparkdl.planner.candidates import build_plan
    from sparkdl.planner.cluster import cluster_info
    from sparkdl.planner.plan import NoFeasibleLayout

    threads = worker_threads(spark, config)
    cluster = cluster_info(spark, config.launch.num_workers, config.launch.threads_per_worker)
    try:
        result = build_plan(module, config, num_features, cluster, backend_class(config.launch.backend).ops, threads,
                            num_rows)
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
    logging.getLogger("sparkdl").info("%s", result.explain())
    if config.tracking.progress:
        print(result.explain(), flush=True)
    return result


def measured_links(spark: Any, config: RunConfig) -> tuple[tuple[str, str, float, float], ...]:
    """For an explicitly hybrid run: links between executors from an earlier calibration of this
    cluster, if one is cached (no probe is started for it); otherwise none (the default grid)."""
    if config.train.strategy != "hybrid" or config.launch.emulate_network:
        return ()
    from sparkdl.planner.cluster import cached_cluster_info

    cluster = cached_cluster_info(spark, config.launch.num_workers)
    return cluster.executor_links() if cluster is not None else ()


def plan_strategy(module: Any, config: RunConfig, layout: Any, links: Any = ()) -> tuple[Any, dict[str, str]]:
    """The strategy's driver-side plan (None for data parallel) and the MLflow params describing it;
    configurations that cannot run (stage counts, micro-batches, memory budget) raise here."""
    from sparkdl.planner.stages import check_data_parallel_memory, describe, plan_hybrid

    if config.train.strategy == "hybrid":
        hybrid, profile, memory = plan_hybrid(module, config, layout.num_features, layout.label_dtype or "float32",
                                              links)
        return hybrid, describe(hybrid, profile, memory)
    check_data_parallel_memory(module, config, layout.num_features)
    if config.train.strategy == "ist":
        return plan_ist(module, config)
    return None, {}


def plan_ist(module: Any, config: RunConfig) -> tuple[Any, dict[str, str]]:
    import logging
    import warnings

    from sparkdl.strategies.ist import MIN_NEURONS_PER_RANK, ist_layout, narrow_layers, use_batch_statistics

    train = config.train
    layout = ist_layout(module, config.launch.num_workers, train.ist_sync_every, train.ist_scale, train.seed)
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
