"""Where a compat call runs: barrier tasks on the cluster (one torchrun node per task), or child
processes on the driver (TorchDistributor(local_mode=True), HorovodRunner(np<0)). Both open an MLflow
run when tracking is on and hand rank 0 its id, so `mlflow.log_metric` inside the function lands in it.
"""
from __future__ import annotations

import os
import pickle
import re
import tempfile
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Mapping

from sparkdl.config import LaunchConfig, RunConfig, TrackingConfig, TrainConfig
from sparkdl.config.sections import option_owners
from sparkdl.errors import ConfigError, RankFunctionError, TrainingError
from sparkdl.wire.child import ChildCall, torchrun_variables

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from sparkdl.tracking.mlflow_run import RunTracker

COMPAT_SECTIONS = ("launch", "tracking")  # what a compat run takes of sparkdl's options


@dataclass(frozen=True)
class CompatOptions:
    """sparkdl's own options a compat run obeys: timeouts, slot_wait_s, channel, tracking, ..."""

    launch: LaunchConfig
    tracking: TrackingConfig
    train: TrainConfig  # defaults: the shared-path checks read its checkpoint_dir (none)


def compat_options(peer: str, workers: int, options: Mapping[str, Any]) -> CompatOptions:
    """The launch and tracking sections from sparkdl keyword options; every rank's output reaches
    the driver unless rank_output says otherwise."""
    owners = option_owners()
    foreign = sorted(k for k in options if owners.get(k) not in COMPAT_SECTIONS and k in owners)
    if foreign:
        raise ConfigError(f"{peer} takes sparkdl's launch and tracking options only; {', '.join(foreign)} "
                          f"belong to {owners[foreign[0]]}", hint="your function trains the model itself: "
                          "set such values inside it; launch options are e.g. timeout_s, slot_wait_s, channel")
    config = RunConfig.from_kwargs(**{"rank_output": "all", **options, "num_workers": workers})
    config.launch.validate()
    config.tracking.validate()
    return CompatOptions(config.launch, config.tracking, config.train)


def pickled_call(fn: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], what: str, spark: Any = None) -> bytes:
    """(fn, args, kwargs) pickled by value for the ranks; a clear error naming `what` if it cannot be.
    `spark`: the session whose executors run the ranks (None: the driver's own child processes)."""
    from sparkdl.driver.checks import check_picklable_value
    from sparkdl.driver.shipping import ship_by_value

    # What the ranks cannot import (a notebook's or script's own module) travels by value.
    ship_by_value(fn, *args, *kwargs.values(), spark=spark)
    return check_picklable_value((fn, tuple(args), dict(kwargs)), what)


def open_tracker(peer: str, options: CompatOptions, params: Mapping[str, Any], run_id: str) -> RunTracker:
    from sparkdl.tracking.mlflow_run import RunTracker

    t = options.tracking
    tracker = RunTracker(t.tracking, t.tracking_uri, t.experiment, t.run_name)
    tracker.start(params={"compat.distributor": peer, **params}, tags={"sparkdl.run_id": run_id,
                                                                       "sparkdl.compat": peer})
    return tracker


def rank0_mlflow_env(tracker: RunTracker) -> tuple[tuple[str, str], ...]:
    """What makes `mlflow.log_metric` in rank 0's process log into the run sparkdl opened."""
    if not tracker.run_id:
        return ()
    uri = str(tracker.tracking_uri or "")
    if uri and "://" not in uri and not uri.startswith("databricks"):
        uri = os.path.abspath(uri)  # a relative store path: the child's working directory is its own
    return (("MLFLOW_RUN_ID", tracker.run_id), ("MLFLOW_TRACKING_URI", uri))


def run_on_cluster(spark: SparkSession, call: ChildCall, tasks: int, options: CompatOptions,
                   params: Mapping[str, Any], df: DataFrame | None = None) -> Any:
    """The call on `tasks` barrier tasks; rank 0's return value (every rank's with results="all")."""
    from sparkdl.driver.attempts import tracked_submit
    from sparkdl.driver.checks import before_training
    from sparkdl.driver.job import ensure_training_slots, new_run_id
    from sparkdl.wire.spec import TrainSpec

    launch = options.launch
    ensure_training_slots(spark, tasks, launch)
    before_training(spark, options.train, launch, tasks)
    run_id = new_run_id()
    tracker = open_tracker(call.name, options, params, run_id)
    call = replace(call, rank0_env=rank0_mlflow_env(tracker))
    spec = TrainSpec(run_id=run_id, data=RunConfig().data, train=options.train, launch=launch,
                     tracking=replace(options.tracking, progress=False), layout=None, child=call)
    job_df = df if df is not None else spark.range(0, tasks, 1, tasks)
    try:
        result, _ = tracked_submit(spark, job_df, spec, tracker)
    except TrainingError as exc:
        raise rank_error(call.name, exc) from None
    tracker.finish("FINISHED")
    return result


def run_on_driver(call: ChildCall, processes: int, options: CompatOptions, params: Mapping[str, Any]) -> Any:
    """The call in `processes` child processes of this driver (one torchrun node); rank 0's return
    value (every rank's with results="all"). Their output is printed here, prefixed [rank r]."""
    from sparkdl.driver.job import new_run_id
    from sparkdl.executor.child_process import child_env, first_failure, rank_failure
    from sparkdl.executor.child_rank import run_children
    from sparkdl.executor.rendezvous import free_port
    run_id = new_run_id()
    tracker = open_tracker(call.name, options, params, run_id)
    address, port = "127.0.0.1", free_port("127.0.0.1")
    envs = []
    server = None
    try:
        if call.framework == "horovod":
            from sparkdl.comm.horovod_env import start_rendezvous

            server, horovod_port = start_rendezvous([address] * processes)
        for rank in range(processes):
            variables = torchrun_variables(rank, processes, rank, processes, 0, 1, address, port, run_id)
            variables.update(dict(call.env))
            if rank == 0:
                variables.update(dict(rank0_mlflow_env(tracker)))
            if server is not None:
                from sparkdl.comm.horovod_env import horovod_variables

                variables.update(horovod_variables([address] * processes, rank, address, horovod_port,
                                                   options.launch.timeout_s, options.launch.horovod_env))
            envs.append(child_env(variables, call.use_gpu))
        with tempfile.TemporaryDirectory(prefix="sparkdl-local-") as workdir:
            outcomes = run_children(call, envs, workdir, list(range(processes)), prefix_always=True,
                                    sibling_grace_s=options.launch.peer_failure_delay_s)
    except BaseException as exc:  # Ctrl-C included: the run ends FAILED, named, never RUNNING
        tracker.set_tags({"sparkdl.failed_with": f"{type(exc).__name__}: {str(exc).strip()[:500]}"})
        tracker.finish("FAILED")
        raise
    finally:
        if server is not None:
            server.stop()
    failed = first_failure(outcomes)
    if failed is not None:
        rank, error = failed
        tracker.finish("FAILED")
        raise rank_error(call.name, failure=(rank, rank_failure(rank, error)))
    tracker.finish("FINISHED")
    values = [pickle.loads(o.result) if o.result else None for o in outcomes]
    return values if call.results == "all" else values[0]


_LINE = re.compile(r"training failed on rank (\d+): (.*?)(?: \(on host [^)]*\))?$")


def rank_error(peer: str, exc: TrainingError | None = None,
               failure: tuple[int, BaseException] | None = None) -> TrainingError:
    """One RankFunctionError naming the rank, the user's exception type and message, and the rank's
    traceback, from the cluster's TrainingError or a local child's failure."""
    if failure is not None:
        rank, error = failure
        kind = type(error)
        name = kind.__qualname__ if kind.__module__ in ("builtins", "__main__") else f"{kind.__module__}.{kind.__qualname__}"
        message, trace = str(error), getattr(error, "rank_traceback", "")
    else:
        assert exc is not None
        first = str(exc.message).splitlines()[0] if exc.message else ""
        match = _LINE.match(first)
        if match is None:
            return exc  # not a rank's own exception (slots, a lost executor): sparkdl's error says it
        rank = int(getattr(exc, "rank", match.group(1)))
        name, _, message = match.group(2).partition(": ")
        text = str(getattr(exc, "rank_text", ""))
        trace = text.split("\n", 1)[1] if "\n" in text else ""
    shown = f"\n\nrank {rank}'s traceback:\n{trace.rstrip()}" if trace.strip() else ""
    return RankFunctionError(f"{peer}: the function failed on rank {rank}: {name}: {message}{shown}",
                             hint="the traceback above is the rank's own; every rank's output reached this log "
                                  "prefixed [rank r]", rank=rank, exception_type=name, exception_message=message,
                             rank_traceback=trace)

