"""Horovod: one training function (workloads.horovod_steps: hvd.DistributedOptimizer, SGD, the same
MLP and batch) run unchanged by `horovodrun -np 2 --gloo` and by `sparkdl.run(..., backend="horovod")`
(sparkdl's horovod communicator initialises Horovod inside the barrier tasks, rendezvous through
Spark). Both report the slowest rank's median step seconds after warm-up steps. Target: sparkdl <=
1.05x horovodrun.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from peers_parts import common  # noqa: E402

FEATURES, HIDDEN, CLASSES, BATCH, STEPS, WARMUP = 64, 512, 10, 256, 200, 20


def sparkdl_horovod_train(ctx: Any) -> dict[str, Any]:
    from peers_parts.workloads import horovod_steps

    result = horovod_steps(FEATURES, HIDDEN, CLASSES, BATCH, STEPS, WARMUP)
    import torch

    result["threads"] = torch.get_num_threads()
    return result


def run_sparkdl() -> dict[str, Any]:
    import sparkdl

    return sparkdl.run(sparkdl_horovod_train, num_workers=common.WORLD, backend="horovod", progress=False)


def run_horovodrun() -> dict[str, Any]:
    _, _, result = common.run_workload("horovodrun", "horovod", features=FEATURES, hidden=HIDDEN, classes=CLASSES,
                                       batch=BATCH, steps=STEPS, warmup=WARMUP)
    return result


def horovod_error() -> str | None:
    try:
        import horovod.torch  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - recorded verbatim
        return f"{type(exc).__name__}: {exc}"
    if not os.path.exists(os.path.join(os.path.dirname(sys.executable), "horovodrun")):
        return "horovodrun is not installed beside this interpreter"
    return None


def measure(spark: Any, args: Any) -> dict[str, Any]:
    error = horovod_error()
    if error:
        return {"part": "horovod", "figures": {}, "runs": {}, "ratios": [], "errors": {"horovod": error},
                "notes": ["Horovod missing: run `make bench` (builds it with scripts/build_horovod.sh)"]}
    runs: dict[str, list[float]] = {"sparkdl_horovod_step_ms": [], "horovodrun_step_ms": []}
    threads = {}
    for round_no in range(args.repeats):
        common.log(f"horovod round {round_no + 1}/{args.repeats}")
        # ABBA within the round: drift on this shared host hits both launchers alike.
        first, second, third, fourth = run_sparkdl(), run_horovodrun(), run_horovodrun(), run_sparkdl()
        threads = {"sparkdl": first.get("threads"), "horovodrun": "OMP_NUM_THREADS=1"}
        runs["sparkdl_horovod_step_ms"].append(500 * (first["step_s"] + fourth["step_s"]))
        runs["horovodrun_step_ms"].append(500 * (second["step_s"] + third["step_s"]))
    return {"part": "horovod", "figures": {k: round(common.median(v), 3) for k, v in runs.items()},
            "runs": {k: [round(x, 3) for x in v] for k, v in runs.items()},
            "ratios": [common.ratio_entry("step time: sparkdl horovod backend / horovodrun",
                                          list(zip(runs["sparkdl_horovod_step_ms"], runs["horovodrun_step_ms"])),
                                          1.05, "lower")],
            "notes": [f"the same function (peers_parts.workloads.horovod_steps) under both launchers: MLP "
                      f"{FEATURES}-{HIDDEN}-{HIDDEN}-{CLASSES}, batch {BATCH} per rank, {STEPS} timed steps after "
                      f"{WARMUP}; intra-op threads {threads}; each round runs sparkdl, horovodrun, horovodrun, "
                      "sparkdl (ABBA) and averages each side's two runs"],
            "errors": {}}


if __name__ == "__main__":
    common.run_alone(measure, __doc__.splitlines()[0])
