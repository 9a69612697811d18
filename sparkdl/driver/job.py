"""Driver side of a launch: check slots, submit the barrier mapInArrow job, collect rank 0's result.

Spark retries a barrier stage that cannot get all its slots for ~10 minutes before failing, so the
slot count is checked first and a shortfall fails within `launch.slot_wait_s` (unset: Spark's own
barrier-check budget) with both numbers.
"""
from __future__ import annotations

import logging
import re
import time
import uuid
from dataclasses import replace
from typing import Any

from pyspark.sql import DataFrame, SparkSession

from sparkdl.errors import ConfigError, InsufficientSlotsError, TrainingError
from sparkdl.wire.spec import TrainSpec
from sparkdl.wire.codec import RESULT_SCHEMA, collect_parts, loads_history, loads_result, output_lines, parse_failure
from sparkdl.executor.worker import make_task
from sparkdl.spark.session import facts, is_local_master, task_cpus


log = logging.getLogger("sparkdl")


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def concurrent_slots(spark: SparkSession, profile: Any = None, wanted: int = 0) -> int:
    """Tasks Spark can run at once now (spark/session.py: the JVM's barrier count, or under Spark Connect
    the master URL, executor settings or a probe job of `wanted` tasks)."""
    return facts(spark).slots(profile, wanted)


# Spark's own patience for a barrier stage short of slots (its defaults: 15 s x 40 checks).
BARRIER_CHECK_INTERVAL = "spark.scheduler.barrier.maxConcurrentTasksCheck.interval"
BARRIER_CHECK_FAILURES = "spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures"
SLOT_WAIT_REPORT_S = 15.0  # how often the wait says where it stands


def spark_seconds(text: str | None, default: float) -> float:
    """A Spark time setting in seconds ("15s", "2min", "500ms", "1h"; a bare number is seconds)."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*(ms|s|sec|m|min|h|d)?\s*", str(text or ""))
    if not match:
        return default
    scale = {"ms": 1e-3, None: 1.0, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
    return float(match.group(1)) * scale[match.group(2)]


def slot_wait_seconds(spark: SparkSession, wait_s: float | None) -> float:
    """launch.slot_wait_s, or unset: as long as Spark's barrier-scheduling check would wait (its
    interval x maxFailures), so a cluster still registering executors is given Spark's own patience."""
    if wait_s is not None:
        return float(wait_s)
    conf = facts(spark).conf
    interval = spark_seconds(conf(BARRIER_CHECK_INTERVAL, "15s"), 15.0)
    try:
        failures = int(conf(BARRIER_CHECK_FAILURES, "40") or 40)
    except ValueError:
        failures = 40
    return max(interval * failures, 0.0)


def executors_final(spark: SparkSession) -> bool:
    """Whether every executor the application will get has registered, so waiting cannot add
    slots: local-cluster[N, ...] with its N up, or spark.executor.instances up with dynamic
    allocation off. Unknown (a standalone master without instances, dynamic allocation, Spark
    Connect) is never final: those are waited for."""
    session = facts(spark)
    match = re.fullmatch(r"local-cluster\[\s*(\d+)\s*,.*\]", session.master())
    expected = int(match.group(1)) if match else None
    if expected is None and (session.conf("spark.dynamicAllocation.enabled", "false") or "").lower() != "true":
        try:
            expected = int(session.conf("spark.executor.instances", "0") or 0) or None
        except ValueError:
            expected = None
    return expected is not None and len(session.executors()) >= expected


def ensure_slots(spark: SparkSession, num_workers: int, wait_s: float | None, profile: Any = None,
                 gpus_per_worker: int = 0) -> int:
    """Wait (executors may still be registering) up to wait_s (None: Spark's barrier-check budget)
    for num_workers slots, saying how the wait goes every SLOT_WAIT_REPORT_S, else raise."""
    # Only a cluster manager adds executors over time; a local master's slot count is final, and
    # so is a cluster's whose executors have all registered (more would need more executors).
    master = facts(spark).master()
    slots = concurrent_slots(spark, profile, num_workers)
    final = slots >= num_workers or is_local_master(master) or executors_final(spark)
    budget = 0.0 if final else slot_wait_seconds(spark, wait_s)
    start = time.monotonic()
    next_report = start  # said at once, then every SLOT_WAIT_REPORT_S
    while True:
        now = time.monotonic()
        if slots >= num_workers or now - start >= budget:
            break
        if now >= next_report:
            log.warning("sparkdl: waiting for task slots: %d of %d free after %.0f s (up to %.0f s for executors "
                        "to register; launch.slot_wait_s)", slots, num_workers, now - start, budget)
            next_report = now + SLOT_WAIT_REPORT_S
        time.sleep(min(0.5, max(budget - (now - start), 0.01)))
        slots = concurrent_slots(spark, profile, num_workers)
        if slots < num_workers and executors_final(spark):  # all there now, and still short: waiting adds none
            break
    waited = f" after waiting {time.monotonic() - start:.0f} s" if budget else ""
    if slots < num_workers and gpus_per_worker:
        raise InsufficientSlotsError(
            f"num_workers={num_workers} with gpus_per_worker={gpus_per_worker} needs {num_workers} tasks "
            f"with {gpus_per_worker} GPU(s) each at once, but the executors' GPUs and cores allow only {slots}{waited}",
            hint=f"lower num_workers to {max(slots, 1)} or gpus_per_worker, or give executors more GPUs "
                 f"(spark.executor.resource.gpu.amount and a discovery script)")
    if slots < num_workers:
        raise InsufficientSlotsError(
            f"num_workers={num_workers} needs {num_workers} task slots at once, but Spark ({master}) "
            f"can run only {slots} tasks at the same time{waited}",
            hint=f"lower num_workers to {max(slots, 1)}, or give Spark more executor cores "
                 f"(e.g. master local[{num_workers}] or more executors); a barrier job needs every slot at once; "
                 f"launch.slot_wait_s waits longer for executors still registering")
    return slots


def training_profile(spark: SparkSession, gpus_per_worker: int) -> Any:
    """A stage-level ResourceProfile asking `gpus_per_worker` GPUs per task for the training stage
    only, so a CPU-default application (no spark.task.resource.gpu.amount) can train on GPUs;
    None when not asked for. Needs executors that have GPUs (spark.executor.resource.gpu.*)."""
    return gpu_task_profile(spark, float(gpus_per_worker)) if gpus_per_worker else None


def ensure_training_slots(spark: SparkSession, world_size: int, launch: Any) -> Any:
    """ensure_slots under the training stage's ResourceProfile (GPUs included); returns that profile."""
    session = facts(spark)
    master = session.master()
    if launch.gpus_per_worker and is_local_master(master):
        raise ConfigError(f"gpus_per_worker={launch.gpus_per_worker} needs stage-level scheduling, which "
                          f"Spark's {master} master does not have",
                          hint="run on a cluster manager (standalone, local-cluster, YARN, Kubernetes) whose "
                               "executors have GPUs, or set spark.task.resource.gpu.amount for the application")
    executor_gpus = float(session.conf("spark.executor.resource.gpu.amount", "0") or 0)
    if launch.gpus_per_worker and not executor_gpus:
        raise ConfigError(f"gpus_per_worker={launch.gpus_per_worker} asks GPUs for the training stage, but the "
                          "executors declare none (spark.executor.resource.gpu.amount is not set)",
                          hint="start the application with spark.executor.resource.gpu.amount and "
                               "spark.executor.resource.gpu.discoveryScript (conf/spark/gpu-cluster.conf)")
    profile = training_profile(spark, launch.gpus_per_worker)
    ensure_slots(spark, world_size, launch.slot_wait_s, profile, launch.gpus_per_worker)
    return profile


def gpu_task_profile(spark: SparkSession, gpus_per_task: float) -> Any:
    """A task ResourceProfile with `gpus_per_task` GPUs (a fraction lets 1/amount tasks share one)."""
    from pyspark.resource import ResourceProfileBuilder, TaskResourceRequests

    cpus = task_cpus(facts(spark).conf("spark.task.cpus", "1"))
    requests = TaskResourceRequests().cpus(cpus).resource("gpu", float(gpus_per_task))
    return ResourceProfileBuilder().require(requests).build


def submit(spark: SparkSession, df: DataFrame, spec: TrainSpec) -> tuple[Any, list[dict[str, Any]], list[str]]:
    """Run the barrier job; returns (the trained model's parts (trained_model.ModelParts) or
    train_fn's result, history, the tail of rank 0's output when the driver channel did not carry
    it). The slots are checked again right before it (one py4j call when they are there): executors
    may have gone since the entry point checked, and a barrier stage short of slots retries
    silently for minutes."""
    from contextlib import ExitStack

    from sparkdl.driver.parts import open_sink, gather_parts

    profile = ensure_training_slots(spark, spec.world_size, spec.launch)
    with ExitStack() as cleanup:
        sink = open_sink(spark, spec, cleanup) if spec.train_fn is None else None
        spec = replace(spec, model_sink=sink.sink if sink is not None else None, executor_cores=_executor_cores(spark))
        job = df.mapInArrow(make_task(spec), RESULT_SCHEMA, barrier=True, profile=profile)
        group = f"sparkdl-{spec.run_id}", f"sparkdl training run {spec.run_id} ({spec.world_size} workers)"
        try:
            with facts(spark).job_group(*group):
                rows = _collect(df, job, spec, profile)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - turned into one readable error below
            raise training_error(exc) from None
        parts = collect_parts(rows)
        history = loads_history(parts)
        if spec.child is not None:
            from sparkdl.driver.parts import child_results

            values = child_results(sink, parts, spec.world_size * spec.child.processes_per_task)
            result = values if spec.child.results == "all" else values[0]
        else:
            result = loads_result(parts) if sink is None else gather_parts(sink, parts)
        return result, history, output_lines(parts)


def _executor_cores(spark: SparkSession) -> int | None:
    """Each executor's cores as the driver's conf says: a rank's threads may use its share of them."""
    from sparkdl.spark.session import executor_cores

    session = facts(spark)
    return executor_cores(session.master(), session.conf("spark.executor.cores"))


_CAUSE = re.compile(r"^(Caused by: )?[\w.$]+(Error|Exception)\b")


def _collect(df: DataFrame, job: DataFrame, spec: TrainSpec, profile: Any) -> list[Any]:
    try:
        if not spec.packed_rows:
            return job.collect()
        from sparkdl.data.packed_delivery import one_block_per_arrow_batch

        with one_block_per_arrow_batch(df.sparkSession):
            return job.collect()
    except Exception as exc:  # noqa: BLE001
        if "BarrierJobUnsupportedRDDChainException" not in str(exc):
            raise
    if spec.packed_rows:
        raise ConfigError("Spark refuses a barrier stage over this DataFrame's plan (e.g. a union), and its rows "
                          "were packed into blocks (data.delivery), which cannot be dealt over the workers again",
                          hint="set data.delivery='spark' (the rows are then repartitioned), or repartition "
                               "the DataFrame before training")
    # Spark refuses barrier stages over some RDD chains (union, partition pruning); it says so at
    # submission, before any task runs. A shuffle boundary is always accepted.
    log.warning("sparkdl: this DataFrame's plan cannot run in a barrier stage as it is (e.g. a union); "
                "repartitioning it to %d partitions", spec.world_size)
    from sparkdl.data.shards import balanced, dealt_counts

    dealt, _ = balanced(df, spec.world_size)
    if spec.row_counts:  # counted per kept partition: dealt anew, the ranks' counts move with the rows
        spec = replace(spec, row_counts=dealt_counts(spec.row_counts, spec.world_size))
    return dealt.mapInArrow(make_task(spec), RESULT_SCHEMA, barrier=True, profile=profile).collect()


def training_error(exc: BaseException) -> TrainingError:
    """The failing rank and its exception line, pulled out of Spark's long stack trace."""
    text = str(exc)
    failure = parse_failure(text)
    if failure is not None:
        rank, line = failure
        return TrainingError(f"training failed on rank {rank}: {line}",
                             hint="the full worker traceback is in the executor log (stderr of the task)")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("at ")]
    causes = [ln for ln in lines if _CAUSE.match(ln) and "Job aborted" not in ln]
    summary = " | ".join(dict.fromkeys([lines[1] if len(lines) > 1 else text[:300]] + causes[:3]))
    return TrainingError(f"the training job failed: {summary[:2000]}",
                         hint="see the executor logs (stderr of the failed task) for the full traceback")
