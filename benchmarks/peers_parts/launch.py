"""Launch overhead: seconds from the call to the end of the first training step, and the wall time
of a no-op job, for sparkdl (`sparkdl.run`, barrier tasks in the running Spark application),
TorchDistributor (a barrier job whose tasks each spawn torchrun) and bare torchrun (2 local ranks).

The first step is the same everywhere: build the MLP, one forward and backward pass on a synthetic
batch and the gradient allreduce (sparkdl: ctx.comm.allreduce of every gradient; the others: DDP).
The Spark session is already running for sparkdl and TorchDistributor (notebooks and jobs have one);
bare torchrun needs none. Target: sparkdl <= 0.5x TorchDistributor.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from peers_parts import common  # noqa: E402
from peers_parts.workloads import mlp, synthetic  # noqa: E402

FEATURES, HIDDEN, CLASSES, BATCH = 64, 512, 10, 256


def sparkdl_noop(ctx: Any) -> None:
    return None


def sparkdl_first_step(ctx: Any) -> float:
    import torch

    x, y = synthetic(BATCH, FEATURES, CLASSES, seed=ctx.rank)
    model = mlp(FEATURES, HIDDEN, CLASSES)
    torch.nn.CrossEntropyLoss()(model(x), y).backward()
    for parameter in model.parameters():
        ctx.comm.allreduce(parameter.grad, op="avg")
    return time.time()


def distributor_noop() -> None:
    return None


def distributor_first_step() -> float:
    from peers_parts.workloads import first_step

    return first_step(FEATURES, HIDDEN, CLASSES, BATCH)


def run_sparkdl(fn: Any) -> Any:
    import sparkdl

    return sparkdl.run(fn, num_workers=common.WORLD, progress=False)


def run_distributor(fn: Any) -> Any:
    from pyspark.ml.torch.distributor import TorchDistributor

    return TorchDistributor(num_processes=common.WORLD, local_mode=False, use_gpu=False).run(fn)


def run_torchrun(mode: str) -> tuple[float, dict[str, Any]]:
    """(wall seconds, rank 0's JSON with the call's wall clock added) of a bare torchrun launch."""
    called, wall, result = common.run_workload("torchrun", mode, timeout_s=600)
    result["called"] = called
    return wall, result


def measure(spark: Any, args: Any) -> dict[str, Any]:
    # Distributor functions run in torchrun children that import them by reference.
    os.environ["PYTHONPATH"] = common.bare_env()["PYTHONPATH"]
    runs: dict[str, list[float]] = {k: [] for k in (
        "sparkdl_noop_fresh_workers_s", "sparkdl_noop_s", "distributor_noop_s", "torchrun_noop_s",
        "sparkdl_first_step_s", "distributor_first_step_s", "torchrun_first_step_s")}
    run_distributor(distributor_noop)  # so that round 1 starts like the others: after a TorchDistributor job
    for round_no in range(args.repeats):
        common.log(f"launch round {round_no + 1}/{args.repeats}")
        # TorchDistributor's tasks leave Spark's Python workers unusable for reuse: the first sparkdl
        # job after one starts fresh workers (interpreter + imports). Reported apart; the figures
        # compared are those of a session whose workers exist, as after any earlier job.
        runs["sparkdl_noop_fresh_workers_s"].append(common.timed(lambda: run_sparkdl(sparkdl_noop))[0])
        runs["sparkdl_noop_s"].append(common.timed(lambda: run_sparkdl(sparkdl_noop))[0])
        called = time.time()
        runs["sparkdl_first_step_s"].append(run_sparkdl(sparkdl_first_step) - called)
        runs["distributor_noop_s"].append(common.timed(lambda: run_distributor(distributor_noop))[0])
        called = time.time()
        runs["distributor_first_step_s"].append(run_distributor(distributor_first_step) - called)
        runs["torchrun_noop_s"].append(run_torchrun("noop")[0])
        _, result = run_torchrun("first_step")
        runs["torchrun_first_step_s"].append(result["first_step_done"] - result["called"])
    figures = {name: round(common.median(values), 3) for name, values in runs.items()}
    pairs = lambda a, b: list(zip(runs[a], runs[b]))  # noqa: E731
    return {"part": "launch", "figures": figures, "runs": {k: [round(v, 3) for v in vs] for k, vs in runs.items()},
            "ratios": [common.ratio_entry("launch, no-op job: sparkdl / TorchDistributor",
                                          pairs("sparkdl_noop_s", "distributor_noop_s"), 0.5, "lower"),
                       common.ratio_entry("launch, call to first step: sparkdl / TorchDistributor",
                                          pairs("sparkdl_first_step_s", "distributor_first_step_s"), 0.5, "lower"),
                       common.ratio_entry("launch, call to first step: sparkdl / bare torchrun (info)",
                                          pairs("sparkdl_first_step_s", "torchrun_first_step_s"), None, "lower")],
            "notes": ["seconds; the Spark session already runs for sparkdl and TorchDistributor (both reuse "
                      "its executors); bare torchrun starts 2 fresh Python processes with no Spark",
                      "TorchDistributor's barrier tasks leave Spark's Python workers unusable for reuse (new "
                      "worker pids after its job), so each round first times a sparkdl no-op on fresh workers "
                      "(sparkdl_noop_fresh_workers_s: interpreter start and imports, once per application "
                      "without TorchDistributor), then the compared figures on the workers that job left",
                      "TorchDistributor starts torchrun and fresh Python processes on every call by design"],
            "errors": {}}


if __name__ == "__main__":
    common.run_alone(measure, __doc__.splitlines()[0])
