"""Driver script of the standalone tests: one data-parallel fit on a spark:// master, its weights and
history written to OUT (torch.save). With --kill-marker, the rank-1 executor's whole JVM
(CoarseGrainedExecutorBackend), and then rank 1's Python worker, are killed with SIGKILL at rank 1's
first step from the 8th on at which a checkpoint is loadable (the manifest lists a step), once per
marker file; with --checkpoint-dir the fit resumes from its checkpoints.

Why both, and why wait for the manifest: a Python worker outlives its killed JVM until a peer's
failure reaches it (many steps on a loaded machine: it could save the run's last checkpoint, and
the retry would resume from the end), and a step is loadable one save after it was taken
(executor/checkpoint_async.py). Killing the executor's whole process tree at a step where the
manifest is known durable makes the resumed step fall inside the run.

    python standalone_fit.py MASTER OUT [--checkpoint-dir DIR] [--kill-marker PATH] [--slot-wait S]
"""
from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import numpy as np
import torch
from torch import nn

FEATURES = [f"f{i}" for i in range(6)]
MARKER = {"path": "", "checkpoints": ""}
CALLS = {"n": 0}


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def executor_jvm(pid: int) -> int | None:
    """The CoarseGrainedExecutorBackend among this process's ancestors."""
    while pid > 1:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        if b"CoarseGrainedExecutorBackend" in cmdline:
            return pid
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the parent's pid
    return None


def loadable() -> bool:
    """Whether the run's checkpoint manifest (written by rank 0 once a step is complete) exists."""
    return not MARKER["checkpoints"] or any(Path(MARKER["checkpoints"]).glob("*/manifest.json"))


def killing_loss(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    CALLS["n"] += 1
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 1 and CALLS["n"] >= 8 and MARKER["path"] and not os.path.exists(MARKER["path"]) and loadable():
        Path(MARKER["path"]).touch()
        jvm = executor_jvm(os.getpid())
        if jvm is not None:
            os.kill(jvm, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    return nn.functional.cross_entropy(output, labels)


def rows_df(spark):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(11)
    x = rng.normal(size=(160, 6))
    y = (x[:, 0] + x[:, 1] > 0).astype(int) + (x[:, 2] > 1).astype(int)
    rows = [(*map(float, r), int(t)) for r, t in zip(x, y)]
    return spark.sparkContext.parallelize(rows, 2).toDF(FEATURES + ["label"]).cache()


def estimator(**options):  # type: ignore[no-untyped-def]
    from sparkdl import TorchEstimator

    return TorchEstimator(model=net, feature_cols=FEATURES, label_col="label", batch_size=8, epochs=2, num_workers=2,
                          optimizer="sgd", lr=0.1, momentum=0.9, seed=5, strategy="data_parallel", tracking=False,
                          progress=False, loss=killing_loss, **options)


def reference_fit(spark):  # type: ignore[no-untyped-def]
    """The uninterrupted run's weights, on any session (the tests' local-cluster one)."""
    MARKER["path"], MARKER["checkpoints"] = "", ""
    return estimator().fit(rows_df(spark)).torch_module().state_dict()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("master")
    parser.add_argument("out")
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--kill-marker", default="")
    parser.add_argument("--slot-wait", type=float, default=60.0)
    args = parser.parse_args()
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(args.master).appName("sparkdl-standalone-test")
             .config("spark.ui.enabled", "false").config("spark.executor.memory", "768m")
             .config("spark.task.maxFailures", "4").getOrCreate())
    MARKER["path"], MARKER["checkpoints"] = args.kill_marker, args.checkpoint_dir or ""
    options = dict(checkpoint_dir=args.checkpoint_dir, checkpoint_every=3) if args.checkpoint_dir else {}
    model = estimator(slot_wait_s=args.slot_wait, **options).fit(rows_df(spark))
    torch.save({"state": model.torch_module().state_dict(), "history": model.history}, args.out)
    spark.stop()


if __name__ == "__main__":
    main()
