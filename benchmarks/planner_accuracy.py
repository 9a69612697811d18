"""Planner accuracy: does the planner pick the measured-fastest layout, and how close are its predictions?

Grid (issue 7): 2 model shapes (a wide MLP 64-512-512-10, which IST can partition, and a deep narrow
one, 64-128 then 7 blocks of Linear 128 + LayerNorm + ReLU, which it cannot) x 3 emulated networks
(10 Gbit/s at 0.05 ms, 100 Mbit/s at 0.5 ms, 10 Mbit/s at 2 ms; `launch.emulate_network`; an emulated
link is never faster than the real loopback, and the planner uses the slower of the two) x 2
memory budgets (none, and 60 % of data parallel's predicted need, which excludes it) = 12 cells, two
workers on local[2], batch 64 per worker. In each cell the planner (`build_plan`, as `strategy="auto"`
runs it: driver-side profile, calibrated cluster, emulated network) prices every candidate and
chooses; then one barrier job (`sparkdl.run` with the same emulated network) runs every feasible
candidate's strategy in the same tasks for enough steps to cover its synchronisation period (DiLoCo
H, IST R; 3 timed steps for the others, after one warm-up) and times the mean step (slowest rank).

Reported per cell: the choice, the measured fastest, whether the choice is within 10 % of it, and
|predicted - measured| / measured for every candidate. Targets: choice within 10 % of the fastest in
>= 90 % of cells; median relative error <= 25 %.

Prints one JSON object as the last line of stdout. Nothing here asserts anything.
On real (shaped) links between hosts, with a CPU hog per host, and time to data parallel's loss:
benchmarks/planner_accuracy_bed.py (issue 53).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

NETWORKS = {"10Gbit": (10.0, 0.05), "100Mbit": (0.1, 0.5), "10Mbit": (0.01, 2.0)}  # gbps, latency ms


def sections(c: Any) -> tuple[Any, Any, Any]:
    """The sections the planner's hybrid functions take: data, train, launch."""
    return c.data, c.train, c.launch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--timed-steps", type=int, default=3)
    parser.add_argument("--cells", default="", help="only these cell names (comma-separated), for quick checks")
    return parser.parse_args()


def wide() -> Any:
    from torch import nn

    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def deep() -> Any:
    """Deep and narrow, with LayerNorm blocks: IST cannot partition it."""
    from torch import nn

    layers: list[Any] = [nn.Linear(64, 128), nn.ReLU()]
    for _ in range(7):
        layers += [nn.Sequential(nn.Linear(128, 128), nn.LayerNorm(128), nn.ReLU())]
    return nn.Sequential(*layers, nn.Linear(128, 10))


MODELS = {"wide": wide, "deep": deep}


def steps_for(candidate: Any, timed: int) -> int:
    options = dict(candidate.options)
    if candidate.strategy == "diloco":
        return int(options["sync_every"])
    if candidate.strategy == "ist":
        return int(options["ist_sync_every"])
    return timed


def make_train_fn(model_name: str, runs: list[dict[str, Any]], batch: int) -> Any:
    def train_fn(ctx: Any) -> list[dict[str, Any]]:
        import torch
        import torch.nn.functional as F

        from sparkdl.config import TrainConfig
        from sparkdl.strategies.data_parallel import DataParallel
        from sparkdl.strategies.hybrid import Hybrid
        from sparkdl.strategies.ist import Ist

        generator = torch.Generator().manual_seed(ctx.rank)
        features = torch.randn(batch, 64, generator=generator)
        labels = torch.randint(0, 10, (batch,), generator=generator)
        results = []
        for run in runs:
            options = run["options"]
            x, y, weight = features, labels, 1.0
            if options.get("batch_balance") == "speed":  # as the built-in loop does (executor/balance.py)
                from sparkdl.executor.balance import agree_on_shares, loss_weight

                shares = agree_on_shares(ctx.comm, ctx.rank, batch, None)
                rows = torch.arange(shares[ctx.rank]) % batch
                x, y, weight = features[rows], labels[rows], loss_weight(shares, ctx.rank)
            if run["strategy"] in ("data_parallel", "diloco"):
                strategy: Any = DataParallel(ctx.comm, None, TrainConfig(sync=options.get("sync", "allreduce"),
                                                                        sync_every=options.get("sync_every", 50)),
                                             loss_weight=weight)
            elif run["strategy"] == "hybrid":
                strategy = Hybrid(ctx.comm, run["layout"], TrainConfig())
            else:
                strategy = Ist(ctx.comm, run["layout"], TrainConfig())
            torch.manual_seed(0)
            strategy.setup(MODELS[model_name](), lambda p: torch.optim.Adam(p, lr=1e-3), F.cross_entropy)
            strategy.train_step(x, y)  # warm-up
            ctx.comm.barrier()
            started = time.perf_counter()
            for _ in range(run["steps"]):
                strategy.train_step(x, y)
            ctx.comm.barrier()
            mine = (time.perf_counter() - started) / run["steps"]
            results.append(max(ctx.comm.allgather_object(mine)))
        return results

    return train_fn


def main() -> None:
    args = parse_args()
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    import sparkdl
    from sparkdl.comm import backend_class
    from sparkdl.config import RunConfig
    from sparkdl.planner.candidates import build_plan
    from sparkdl.planner.stages import plan_hybrid
    from sparkdl.driver.planning import calibrate
    from sparkdl.strategies.ist import ist_layout

    spark = (SparkSession.builder.master("local[2]").appName("sparkdl-bench-planner")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    started = time.perf_counter()
    cluster = calibrate(spark, 2, 1, refresh=True)
    ops = backend_class("torch").ops
    wanted = {c for c in args.cells.split(",") if c}
    cells = []
    for model_name, factory in MODELS.items():
        for net_name, (gbps, latency_ms) in NETWORKS.items():
            for budget_name in ("none", "excludes_dp"):
                name = f"{model_name}/{net_name}/{budget_name}"
                if wanted and name not in wanted:
                    continue
                base = RunConfig.from_kwargs(feature_cols=[f"x{i}" for i in range(64)], batch_size=args.batch_size,
                                             num_workers=2, optimizer="adam", threads_per_worker=1,
                                             emulate_network={"latency_ms": latency_ms, "gbps": gbps}).validate()
                if budget_name == "excludes_dp":
                    free = build_plan(factory(), base.data, base.train, base.launch, 64, cluster, ops, threads=1)
                    dp = next(c for c in free.candidates if c.strategy == "data_parallel")
                    base = base.merged({"launch": {"max_memory_per_rank": int(0.6 * dp.memory_bytes)}}).validate()
                plan = build_plan(factory(), base.data, base.train, base.launch, 64, cluster, ops, threads=1)
                runs = []
                for index, candidate in enumerate(plan.candidates):
                    if not candidate.feasible:
                        continue
                    options = dict(candidate.options)
                    layout = None
                    if candidate.strategy == "hybrid":
                        config = base.merged({"train": options}).validate()
                        layout, _, _ = plan_hybrid(factory(), *sections(config), 64, "int64")
                    elif candidate.strategy == "ist":
                        layout = ist_layout(factory(), 2, int(options["ist_sync_every"]), "scale", 0)
                    runs.append({"index": index, "strategy": candidate.strategy, "options": options, "layout": layout,
                                 "steps": steps_for(candidate, args.timed_steps)})
                measured = sparkdl.run(make_train_fn(model_name, runs, args.batch_size), num_workers=2,
                                       threads_per_worker=1, progress=False,
                                       emulate_network={"latency_ms": latency_ms, "gbps": gbps})
                rows = []
                for run, seconds in zip(runs, measured):
                    c = plan.candidates[run["index"]]
                    rows.append({"candidate": c.label, "predicted_s": round(c.predicted_step_s, 6),
                                 "measured_s": round(seconds, 6),
                                 "rel_error": round(abs(c.predicted_step_s - seconds) / seconds, 3),
                                 "chosen": run["index"] == plan.chosen})
                fastest = min(rows, key=lambda r: r["measured_s"])
                chosen = next(r for r in rows if r["chosen"])
                cell = {"cell": name, "chosen": chosen["candidate"], "measured_fastest": fastest["candidate"],
                        "chosen_over_fastest": round(chosen["measured_s"] / fastest["measured_s"], 3),
                        "choice_ok": chosen["measured_s"] <= 1.10 * fastest["measured_s"],
                        "memory_budget": base.launch.max_memory_per_rank, "candidates": rows}
                cells.append(cell)
                print(f"{name}: chose {cell['chosen']} ({1e3 * chosen['measured_s']:.1f} ms), fastest "
                      f"{cell['measured_fastest']} ({1e3 * fastest['measured_s']:.1f} ms) -> "
                      f"{'ok' if cell['choice_ok'] else 'MISS'}; median error "
                      f"{statistics.median(r['rel_error'] for r in rows):.2f}", file=sys.stderr)
    errors = [r["rel_error"] for c in cells for r in c["candidates"]]
    share_ok = sum(c["choice_ok"] for c in cells) / max(len(cells), 1)
    result = {"benchmark": "planner_accuracy", "workers": 2, "master": "local[2]", "batch_per_worker": args.batch_size,
              "networks_gbps_latency_ms": NETWORKS,
              "cluster": {"flops_per_s": cluster.flops_per_s, "probe_s": round(cluster.probe_s, 2)},
              "cells": cells, "choice_within_10pct_share": round(share_ok, 3),
              "median_rel_error": round(statistics.median(errors), 3) if errors else None,
              "targets": {"choice_share": 0.9, "median_rel_error": 0.25},
              "met": share_ok >= 0.9 and bool(errors) and statistics.median(errors) <= 0.25,
              "seconds": round(time.perf_counter() - started, 1)}
    spark.stop()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
