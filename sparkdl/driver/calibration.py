"""The planner's view of the cluster: Spark's facts about it, the calibration probe's measurements
(driver/probe.py) cached by planner/cluster.py, and the run's model step timed on the ranks beside
them (planner/step_trial.py)."""
from __future__ import annotations

from typing import Any


def session_facts(spark: Any, workers: int) -> Any:
    """Spark's facts about the cluster a run of `workers` ranks would use, as planner data
    (planner.cluster.ClusterFacts): master, executors, task slots, executor memory, GPU amounts."""
    from sparkdl.planner.cluster import ClusterFacts
    from sparkdl.spark.session import facts, task_cpus

    session = facts(spark)
    return ClusterFacts(master=session.master(), workers=workers, executors=session.executors(),
                        slots=session.slots(wanted=workers),
                        executor_memory=session.conf("spark.executor.memory", "1g") or "1g",
                        pyspark_memory=session.conf("spark.executor.pyspark.memory", "") or "",
                        gpus_per_executor=float(session.conf("spark.executor.resource.gpu.amount", "0") or 0),
                        gpus_per_task=float(session.conf("spark.task.resource.gpu.amount", "0") or 0),
                        task_cpus=task_cpus(session.conf("spark.task.cpus", "1")))


def calibrate(spark: Any, workers: int, threads_per_worker: int | None = None, refresh: bool = False,
              trial: Any = None) -> Any:
    """The planner's ClusterInfo for `workers` ranks: cached when fresh and measured under the same
    launch.threads_per_worker, else measured by the calibration probe (driver/probe.py) and cached.
    `trial` (planner/step_trial.StepTrial): the run's model step, timed on the ranks with the
    calibration, or alone when the cluster's figures are cached but this model was not timed."""
    import time

    from sparkdl.driver.probe import run_probe
    from sparkdl.planner.cluster import cached, cluster_from_probe, remember

    facts = session_facts(spark, workers)
    info = None if refresh else cached(facts)
    if info is not None and info.threads_option != (threads_per_worker or 0):
        info = None  # measured under other threads: measured again
    if info is not None and (trial is None or info.step_key == trial.key):
        return info
    if trial is not None:
        from sparkdl.driver.shipping import ship_by_value

        ship_by_value(trial.model, spark=spark)  # a model class the executors cannot import travels by value
    if info is not None:
        return _with_model_step(spark, info, facts, trial, threads_per_worker)
    started = time.perf_counter()
    probe = run_probe(spark, workers, threads_per_worker, trial)
    _say_failed_step(probe)
    # Spark's facts again, now that the probe's tasks ran: an executor still registering when the
    # calibration began can be listed without its port, and the cache would be keyed on that.
    facts = session_facts(spark, workers)
    info = cluster_from_probe(facts, probe, time.perf_counter() - started, threads_per_worker)
    remember(info, facts)
    return info


def _with_model_step(spark: Any, info: Any, facts: Any, trial: Any, threads_per_worker: int | None) -> Any:
    """The cached calibration plus this model's step timed on the ranks by a probe of that alone;
    the calibration as it was when that probe fails (the driver's profile then prices the model)."""
    import logging

    from sparkdl.driver.probe import run_probe
    from sparkdl.planner.cluster import remember, with_step

    try:
        probe = run_probe(spark, info.workers, threads_per_worker, trial, cluster=False)
        _say_failed_step(probe)
        timed = with_step(info, probe)
    except Exception as exc:  # noqa: BLE001 - a trial is an improvement, not a new way to fail
        logging.getLogger("sparkdl").warning("sparkdl: timing the model's step on the executors failed (%s: %s); "
                                             "pricing it from the driver's profile", type(exc).__name__,
                                             str(exc).splitlines()[0][:200] if str(exc) else "")
        return info
    remember(timed, facts)
    return timed


def _say_failed_step(probe: dict[str, Any]) -> None:
    """One warning when a rank could not time the model's step (the plan then prices it from the
    driver's profile): the user sees why explain() has no measured step."""
    if probe.get("step_error"):
        import logging

        logging.getLogger("sparkdl").warning("sparkdl: a rank could not time the model's training step (%s); the "
                                             "planner prices it from the driver's profile", probe["step_error"])


def remeasure(spark: Any, cluster: Any, threads_per_worker: int | None = None, trial: Any = None) -> Any:
    """`cluster` merged with a fresh calibration (best of both, planner.cluster.merge), cached: for a
    decision the first calibration's ends disagreed on."""
    import logging

    from sparkdl.planner.cluster import merge, remember

    logging.getLogger("sparkdl").info("sparkdl: the calibration's two ends disagree on exact vs approximate "
                                      "updates; measuring the cluster once more")
    merged = merge(cluster, calibrate(spark, cluster.workers, threads_per_worker, refresh=True, trial=trial))
    remember(merged, session_facts(spark, cluster.workers))
    return merged
