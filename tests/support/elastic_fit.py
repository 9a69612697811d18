"""Driver script of the spot-safe tests (tests/spark/test_elastic.py): one fit on a spark:// master
of 1-core workers, its weights, history and output written to OUT (torch.save). With --kill-marker,
the process of rank --kill-rank kills its Spark Worker and its executor JVM (SIGKILL: the host is
gone for good, nothing relaunches the executor) at its --kill-call-th loss call, once per marker
file.

    python elastic_fit.py MASTER OUT --checkpoint-dir DIR [--workers 3] [--min-workers 2] [--grow]
        [--kill-marker PATH] [--kill-rank 2] [--kill-call 9] [--strategy data_parallel] [--sync allreduce]
        [--resume-run ID] [--epochs 4] [--batch 8] [--step-sleep S] [--tracking-uri URI --experiment NAME]

With --tracking-uri the fit is tracked there (its MLflow run id saved as "run_id"); else untracked.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

FEATURES = [f"f{i}" for i in range(6)]
KILL = {"path": "", "rank": 2, "call": 9, "sleep": 0.0}
CALLS = {"n": 0}


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def ancestors_named(pid: int, names: tuple[bytes, ...]) -> list[int]:
    """This process's ancestors whose command line names one of `names` (nearest first)."""
    found = []
    while pid > 1:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        if any(name in cmdline for name in names):
            found.append(pid)
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return found


def killing_loss(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    CALLS["n"] += 1
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == KILL["rank"] and CALLS["n"] == KILL["call"] and KILL["path"] and not os.path.exists(KILL["path"]):
        Path(KILL["path"]).touch()
        # The Worker first (it would launch a new executor), then the executor: a host gone for good.
        for pid in reversed(ancestors_named(os.getpid(), (b"deploy.worker.Worker", b"CoarseGrainedExecutorBackend"))):
            os.kill(pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    if KILL["sleep"]:
        time.sleep(KILL["sleep"])  # slower steps: time for a replacement to register while the run trains
    return nn.functional.cross_entropy(output, labels)


def rows_df(spark, rows: int = 240):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(11)
    x = rng.normal(size=(rows, 6))
    y = (x[:, 0] + x[:, 1] > 0).astype(int) + (x[:, 2] > 1).astype(int)
    data = [(*map(float, r), int(t)) for r, t in zip(x, y)]
    return spark.sparkContext.parallelize(data, 6).toDF(FEATURES + ["label"]).cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("master")
    parser.add_argument("out")
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--min-workers", type=int, default=0)
    parser.add_argument("--max-workers", type=int, default=0)
    parser.add_argument("--grow", action="store_true")
    parser.add_argument("--kill-marker", default="")
    parser.add_argument("--kill-rank", type=int, default=2)
    parser.add_argument("--kill-call", type=int, default=9)
    parser.add_argument("--strategy", default="data_parallel")
    parser.add_argument("--sync", default="allreduce")
    parser.add_argument("--resume-run", default=None)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--keep", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--tracking-uri", default=None)
    parser.add_argument("--experiment", default=None)
    args = parser.parse_args()
    from pyspark.sql import SparkSession

    from sparkdl import TorchEstimator

    spark = (SparkSession.builder.master(args.master).appName("sparkdl-elastic-test")
             .config("spark.ui.enabled", "false").config("spark.executor.memory", "640m")
             .config("spark.task.maxFailures", "4").getOrCreate())
    KILL.update(path=args.kill_marker, rank=args.kill_rank, call=args.kill_call, sleep=args.step_sleep)
    df = rows_df(spark)
    sync = {"sync": "diloco", "sync_every": 4} if args.sync == "diloco" else {}
    estimator = TorchEstimator(
        model=net, feature_cols=FEATURES, label_col="label", batch_size=args.batch, epochs=args.epochs,
        num_workers=args.workers, min_workers=args.min_workers, max_workers=args.max_workers,
        grow_workers=args.grow, replacement_wait_s=5.0, slot_wait_s=60.0, optimizer="sgd", lr=0.1, momentum=0.9,
        seed=5, strategy=args.strategy, tracking=args.tracking_uri is not None, tracking_uri=args.tracking_uri,
        experiment=args.experiment, progress=False, loss=killing_loss,
        validation_df=rows_df(spark, 96), checkpoint_dir=args.checkpoint_dir, checkpoint_every=3,
        keep_checkpoints=args.keep, resume_run=args.resume_run, peer_failure_delay_s=0.5, timeout_s=60.0, **sync)
    model = estimator.fit(df)
    runs = [p.name for p in Path(args.checkpoint_dir).iterdir() if p.is_dir()]
    torch.save({"state": model.torch_module().state_dict(), "history": json.loads(json.dumps(model.history)),
                "runs": runs, "run_id": model.run_id}, args.out)
    spark.stop()


if __name__ == "__main__":
    main()
