"""The driver side of benchmarks/stragglers.py: runs on the multi-host bed's driver host, asks the
benchmark process (which owns the hosts' CPU capacities) to set each scenario, and trains every row
in it: the same MLP, rows, batch, optimizer and epochs for TorchDistributor's DDP and sparkdl's rows.

Per row: the training seconds and held-out eval loss at every epoch end (the curve), the fit's wall
time, and for sparkdl's rows the last epoch's pace (each rank's speed, the waiting share) and, for
`auto`, the layout it chose.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests" / "support")]

import bed_driver  # noqa: E402 - the bed's ask() (tests/support)

FEATURES = [f"f{i}" for i in range(16)]
SHAPE = {"width": 1024}
LR = 0.05


def net() -> nn.Module:
    width = SHAPE["width"]
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 3))


def data(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Three classes from a noisy nonlinear rule: the loss keeps falling for several epochs."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(count, len(FEATURES))).astype(np.float32)
    score = x[:, 0] + np.sin(2 * x[:, 1]) + x[:, 2] * x[:, 3] + 0.5 * rng.normal(size=count)
    y = np.digitize(score, [-0.6, 0.6]).astype(np.int64)
    return x, y


def sparkdl_row(train: Any, evaluation: Any, options: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    from sparkdl import TorchEstimator

    started = time.perf_counter()
    fitted = TorchEstimator(model=net, feature_cols=FEATURES, label_col="label", validation_df=evaluation,
                            batch_size=args.batch, epochs=args.epochs, num_workers=args.workers, optimizer="sgd",
                            lr=LR, seed=7, threads_per_worker=1, tracking=False, progress=False, **options).fit(train)
    wall = time.perf_counter() - started
    history = fitted.history
    seconds = [float(r["seconds"]) for r in history]
    last = history[-1]
    plan = fitted.plan
    return {"fit_wall_s": round(wall, 2), "train_s": round(sum(seconds), 3), "steps": int(sum(r["steps"] for r in history)),
            "curve": [[round(sum(seconds[: i + 1]), 3), float(r["val_loss"])] for i, r in enumerate(history)],
            "eval_loss": float(last["val_loss"]),
            "pace": {k: last[k] for k in ("rows_per_compute_s_by_rank", "wait_fraction", "slow_ranks") if k in last},
            "plan": plan.strategy if plan is not None else "",
            "options": {k: v for k, v in (plan.options if plan is not None else {}).items()
                        if isinstance(v, (int, float, str, bool))},
            # what auto measured of the hosts (each rank's speed) and priced
            "explain": plan.explain()[-2500:] if plan is not None and plan.auto is not None else ""}


def ddp_train(train_path: str, eval_path: str, epochs: int, batch: int, steps_per_epoch: int, width: int) -> Any:
    """TorchDistributor's train function: plain DDP (gloo) over this rank's share of the same rows,
    SGD at the same lr, the eval loss on the same held-out rows at every epoch end."""
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    train, evaluation = np.load(train_path), np.load(eval_path)
    x, y = torch.from_numpy(train[rank::world, :-1]), torch.from_numpy(train[rank::world, -1]).long()
    ex, ey = torch.from_numpy(evaluation[:, :-1]), torch.from_numpy(evaluation[:, -1]).long()
    SHAPE["width"] = width
    torch.manual_seed(7)
    model = net()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
    curve, started = [], time.perf_counter()
    for epoch in range(epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        for i in range(steps_per_epoch):
            take = order[i * batch:(i + 1) * batch]
            optimizer.zero_grad()
            F.cross_entropy(ddp(x[take]), y[take]).backward()
            optimizer.step()
        trained = time.perf_counter() - started
        with torch.no_grad():
            loss = float(F.cross_entropy(model(ex), ey))
        curve.append([round(trained, 3), loss])
        started += time.perf_counter() - started - trained  # evaluation time is not training time
    dist.destroy_process_group()
    return {"curve": curve} if rank == 0 else None


def ddp_row(shared: Path, args: argparse.Namespace) -> dict[str, Any]:
    from pyspark.ml.torch.distributor import TorchDistributor

    steps = args.train_rows // args.workers // args.batch
    started = time.perf_counter()
    out = TorchDistributor(num_processes=args.workers, local_mode=False, use_gpu=False).run(
        ddp_train, str(shared / "train.npy"), str(shared / "eval.npy"), args.epochs, args.batch, steps, args.width)
    curve = out["curve"]
    return {"fit_wall_s": round(time.perf_counter() - started, 2), "train_s": curve[-1][0],
            "steps": steps * args.epochs, "curve": curve, "eval_loss": curve[-1][1]}


ROWS = {"lockstep": {"strategy": "data_parallel", "batch_balance": "equal"},
        "dynamic": {"strategy": "data_parallel", "batch_balance": "dynamic"},
        "auto": {"strategy": "auto"}}


def run_row(name: str, spark: Any, train: Any, evaluation: Any, args: argparse.Namespace) -> dict[str, Any]:
    if name == "torchdistributor_ddp":
        return ddp_row(args.shared, args)
    options = dict(ROWS[name])
    if name == "dynamic":
        options["rebalance_every"] = args.rebalance_every
    return sparkdl_row(train, evaluation, options, args)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("master")
    parser.add_argument("out", type=Path)
    parser.add_argument("--shared", type=Path, required=True)
    parser.add_argument("--ask", required=True)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--scenarios", default="slow_host,noisy,even")
    parser.add_argument("--rows", default="lockstep,torchdistributor_ddp,dynamic,auto")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--train-rows", type=int, default=32768)
    parser.add_argument("--eval-rows", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rebalance-every", type=int, default=4)
    args = parser.parse_args()
    SHAPE["width"] = args.width
    bed_driver.ASK["dir"] = args.ask
    import pandas as pd
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(args.master).appName("sparkdl-stragglers")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.executor.cores", "1").config("spark.task.cpus", "1").config("spark.executor.memory", "1g")
             .config("spark.cores.max", str(args.workers))
             .config("spark.scheduler.minRegisteredResourcesRatio", "1.0")
             .config("spark.scheduler.maxRegisteredResourcesWaitingTime", "120s")
             .config("spark.sql.execution.arrow.pyspark.enabled", "true")
             # TorchDistributor's gloo advertises what the host name resolves to (127.0.0.1 here) unless told.
             .config("spark.executorEnv.GLOO_SOCKET_IFNAME", "eth0").getOrCreate())
    results: dict[str, Any] = {"rounds": [], "started": time.time()}
    try:
        x, y = data(args.train_rows + args.eval_rows, seed=3)
        table = np.concatenate([x, y[:, None].astype(np.float32)], axis=1)
        np.save(args.shared / "train.npy", table[: args.train_rows])
        np.save(args.shared / "eval.npy", table[args.train_rows:])
        frame = pd.DataFrame(x, columns=FEATURES).assign(label=y)
        train = spark.createDataFrame(frame.iloc[: args.train_rows]).repartition(args.workers).cache()
        evaluation = spark.createDataFrame(frame.iloc[args.train_rows:]).coalesce(1).cache()
        train.count(), evaluation.count()
        names = [r for r in args.rows.split(",") if r]
        for repeat in range(args.repeats):
            for scenario in [s for s in args.scenarios.split(",") if s]:
                capacities = bed_driver.ask({"do": "cpu", "scenario": scenario})
                # auto calibrates these capacities afresh (the cache is keyed by executors, not CPU limits)
                os.environ["SPARKDL_CACHE_DIR"] = str(args.shared / f"calibration-{scenario}-{repeat}")
                rows: dict[str, Any] = {}
                # lock-step first (its final loss is the target), the others in an order rotating by round
                others = [n for n in names if n != "lockstep"]
                shift = repeat % max(1, len(others))
                for name in (["lockstep"] if "lockstep" in names else []) + others[shift:] + others[:shift]:
                    started = time.monotonic()
                    noisy = bed_driver.ask({"do": "noisy", "on": True}) if scenario == "noisy" else {}
                    try:
                        rows[name] = run_row(name, spark, train, evaluation, args)
                    except Exception as exc:  # noqa: BLE001 - reported; the next row still runs
                        rows[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000],
                                      "trace": traceback.format_exc()[-2500:]}
                    finally:
                        if noisy:
                            rows[name]["noisy"] = bed_driver.ask({"do": "noisy", "on": False})
                    rows[name]["row_s"] = round(time.monotonic() - started, 1)
                    print(f"[stragglers] {repeat} {scenario} {name}: {json.dumps(rows[name])[:500]}",
                          file=sys.stderr, flush=True)
                    results["rounds"].append({"repeat": repeat, "scenario": scenario, "row": name,
                                              "capacities": capacities, **rows[name]})
                    args.out.write_text(json.dumps(results, indent=1))
        results["params"] = sum(p.numel() for p in net().parameters())
        results["steps_per_epoch"] = args.train_rows // args.workers // args.batch
        args.out.write_text(json.dumps(results, indent=1))
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
