"""Fault trials (issue 8): what each failure costs, and how fast sparkdl notices.

Two workers on local-cluster[2,1,1024] (separate executor JVMs), data parallel, an MLP on 4000
synthetic rows (batch 32: 63 steps per epoch, 2 epochs), checkpoints every 10 steps. Faults are
injected by the loss function of the second rank at global step 25:
- kill:      SIGKILL of its Python worker (no clean-up). Expected: the fit completes after a retry,
             resuming from the checkpoint of step 20 (5 steps lost). Time to detect: the kill until
             the driver decides to retry; time to recover: the kill until the first step after resume.
- exception: a ValueError. Expected: no retry, a TrainingError naming rank 1 and the exception line.
             Time to detect: the raise until the driver raises.
- stall:     SIGSTOP of its Python worker (timeout_s=10). Expected: the collectives time out and the
             fit fails. Time to detect: the stop until the driver raises (target: timeout_s + a few s).
Every stopped process is killed afterwards. Each fault `--trials` times.

Prints one JSON object as the last line of stdout. Nothing here asserts anything.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

FAULT_STEP = 25
EVERY = 10
FAULT = {"kind": "", "dir": ""}  # shipped by value with the loss
CALLS = {"n": 0}


def faulty_loss(output: Any, labels: Any) -> Any:
    """Cross-entropy; rank 1 injects FAULT["kind"] at its FAULT_STEP-th step, once per trial directory."""
    import torch

    CALLS["n"] += 1
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    directory = Path(FAULT["dir"])
    injected = directory / "injected"
    if rank == 1 and injected.exists() and not (directory / "resumed").exists():
        (directory / "resumed").write_text(repr(time.time()))  # first step of the attempt after the fault
    if rank == 1 and CALLS["n"] == FAULT_STEP and not injected.exists():
        injected.write_text(repr(time.time()))
        (directory / "pid").write_text(str(os.getpid()))
        if FAULT["kind"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif FAULT["kind"] == "stall":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            raise ValueError("injected fault")
    return torch.nn.functional.cross_entropy(output, labels)


def mlp() -> Any:
    from torch import nn

    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=10.0)
    return parser.parse_args()


def trial(df: Any, kind: str, timeout_s: float) -> dict[str, Any]:
    from sparkdl import TorchEstimator
    from sparkdl.errors import SparkdlError

    directory = Path(tempfile.mkdtemp(prefix=f"sparkdl-fault-{kind}-"))
    FAULT.update(kind=kind, dir=str(directory))
    estimator = TorchEstimator(model=mlp, loss=faulty_loss, feature_cols=[f"x{i}" for i in range(16)],
                               label_col="label", batch_size=32, epochs=2, num_workers=2, optimizer="sgd", lr=0.05,
                               seed=0, strategy="data_parallel", tracking=False, progress=False,
                               checkpoint_dir=str(directory / "ck"), checkpoint_every=EVERY, timeout_s=timeout_s)
    started = time.time()
    outcome, error, model = "completed", "", None
    try:
        model = estimator.fit(df)
    except SparkdlError as exc:
        outcome, error = "failed", str(exc).splitlines()[0][:300]
    ended = time.time()
    injected = float((directory / "injected").read_text()) if (directory / "injected").exists() else None
    resumed = float((directory / "resumed").read_text()) if (directory / "resumed").exists() else None
    pid = int((directory / "pid").read_text()) if (directory / "pid").exists() else None
    if pid is not None and kind == "stall":
        try:
            os.kill(pid, signal.SIGKILL)  # never leave a stopped worker behind
        except ProcessLookupError:
            pass
    record: dict[str, Any] = {"fault": kind, "outcome": outcome, "error": error, "wall_s": round(ended - started, 2)}
    if injected is not None:
        if outcome == "failed":
            record["detect_s"] = round(ended - injected, 2)
        if resumed is not None:
            record["recover_s"] = round(resumed - injected, 2)
    if model is not None:
        from_step = next((h["resumed_from_step"] for h in model.history if "resumed_from_step" in h), None)
        record["resumed_from_step"] = from_step
        record["steps_lost"] = FAULT_STEP - from_step if from_step is not None else None
        record["steps"] = [h["steps"] for h in model.history]
    return record


def main() -> None:
    args = parse_args()
    os.environ["PYSPARK_PYTHON"] = sys.executable
    import numpy as np
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local-cluster[2,1,1024]").appName("sparkdl-bench-faults")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.executor.memory", "1g").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    started = time.perf_counter()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4000, 16))
    y = (x[:, :4].argmax(axis=1)).astype(int)
    df = spark.sparkContext.parallelize([(*map(float, r), int(t)) for r, t in zip(x, y)], 2) \
        .toDF([f"x{i}" for i in range(16)] + ["label"]).cache()
    df.count()
    records = []
    for repeat in range(args.trials):
        for kind in ("kill", "exception", "stall"):
            record = trial(df, kind, args.timeout_s)
            record["trial"] = repeat
            records.append(record)
            print(json.dumps(record), file=sys.stderr)

    def summary(kind: str) -> dict[str, Any]:
        rows = [r for r in records if r["fault"] == kind]
        out: dict[str, Any] = {"trials": len(rows), "outcomes": sorted({r["outcome"] for r in rows})}
        for key in ("detect_s", "recover_s", "steps_lost", "wall_s"):
            values = [r[key] for r in rows if r.get(key) is not None]
            if values:
                out[f"median_{key}"] = statistics.median(values)
                out[f"max_{key}"] = max(values)
        return out

    result = {"benchmark": "faults", "master": "local-cluster[2,1,1024]", "workers": 2, "fault_step": FAULT_STEP,
              "checkpoint_every": EVERY, "timeout_s": args.timeout_s,
              "summary": {kind: summary(kind) for kind in ("kill", "exception", "stall")},
              "trials": records, "seconds": round(time.perf_counter() - started, 1)}
    spark.stop()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
