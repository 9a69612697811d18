"""Pipeline bubble benchmark: hybrid step time against the (m + K - 1) law, GPipe vs 1F1B memory.

One barrier job (`sparkdl.run` on local[2], two ranks, K = 2 stages x D = 1 replica) times, inside
the same tasks and in alternating rounds, the hybrid strategy's training step for every micro-batch
count m in --microbatches and both schedules. The cuts, boundary shapes and micro-batch counts come
from the driver-side planner (`plan_hybrid`), as in a fit.

The law (ALGORITHMS.md, GPipe): with K balanced stages whose forward + backward of one micro-batch
takes t, a step takes (m + K - 1) t: the bubble fraction is (K - 1) / (m + K - 1). Each rank measures
its own stage's t for exactly the micro-batch sizes of that m (forward + backward on local data, no
communication), so the prediction uses the same work units as the step:

    predicted(m) = (m - 1) max_k (t_k + 2 c_k) + sum_k t_k + 2 sum_k c_k + u

(the hybrid term of ALGORITHMS.md's cost model with D = 1: = (m + K - 1) t + u for balanced stages
and free links), where c_k is one boundary message of stage k (an activation forward, its gradient
back) of that micro-batch size, measured as half a ping-pong between the two ranks, and u is the
optimizer update outside the pipelined part, measured locally (max over stages).

`ratio` = measured / predicted; the target is |ratio - 1| <= 0.20. `ideal_s` is the no-bubble time
of one stage on the whole batch (full-batch forward + backward, max over stages), for reference:
measured / ideal_s shows the bubble plus the cost of smaller matrix products.

Activation memory: the bytes autograd saves for backward, counted per micro-batch in flight by the
strategy (saved-tensor hooks, parameters excluded), peak per rank, GPipe vs 1F1B.

Prints one JSON object as the last line of stdout. Nothing here asserts a timing.
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

TARGET = 0.20
STAGES = 2


def sections(c: Any) -> tuple[Any, Any, Any]:
    """The sections the planner's hybrid functions take: data, train, launch."""
    return c.data, c.train, c.launch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", default="1,2,4,8,16", help="comma-separated micro-batch counts")
    parser.add_argument("--width", type=int, default=1024, help="hidden width of the MLP")
    parser.add_argument("--layers", type=int, default=5, help="Linear+ReLU blocks (cut into 2 stages)")
    parser.add_argument("--batch-size", type=int, default=1024, help="rows per rank per step (replica batch = 2x)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per configuration and round")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over every configuration (median)")
    args = parser.parse_args()
    args.microbatches = [int(v) for v in args.microbatches.split(",") if v.strip()]
    if min(args.microbatches) < 1 or max(args.microbatches) > STAGES * args.batch_size:
        parser.error("micro-batch counts must be in [1, 2 x batch size]")
    return args


def model_factory(width: int, layers: int) -> Any:
    from torch import nn

    blocks: list[Any] = [nn.Linear(64, width), nn.ReLU()]
    for _ in range(layers - 1):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(width, 10))


def plans(args: argparse.Namespace) -> dict[tuple[str, int], Any]:
    """The planner's layout for every (schedule, m), as a fit with those options would get it."""
    from sparkdl.config import RunConfig
    from sparkdl.planner.stages import plan_hybrid

    model = model_factory(args.width, args.layers)
    layouts = {}
    for schedule in ("gpipe", "1f1b"):
        for m in args.microbatches:
            config = RunConfig.from_kwargs(feature_cols=["f"], strategy="hybrid", stages=STAGES, num_workers=STAGES,
                                           batch_size=args.batch_size, microbatches=m, schedule=schedule).validate()
            layouts[(schedule, m)], _, _ = plan_hybrid(model, *sections(config), 64, "int64")
    return layouts


def make_train_fn(args: argparse.Namespace, layouts: dict[tuple[str, int], Any]) -> Any:
    width, layers, batch, steps, repeats = args.width, args.layers, args.batch_size, args.steps, args.repeats

    def train_fn(ctx: Any) -> dict[str, Any]:
        import torch
        import torch.nn.functional as F

        from sparkdl.strategies.hybrid import Hybrid, microbatch_sizes

        generator = torch.Generator().manual_seed(ctx.rank)
        features = torch.randn(batch, 64, generator=generator)
        labels = torch.randint(0, 10, (batch,), generator=generator)
        strategies = {}
        for key, layout in layouts.items():
            torch.manual_seed(0)
            strategy = Hybrid(ctx.comm, layout)
            strategy.setup(model_factory(width, layers), lambda p: torch.optim.SGD(p, lr=1e-3), F.cross_entropy)
            strategies[key] = strategy

        def local_compute(strategy: Any, sizes: list[int]) -> float:
            """Forward + backward of this rank's stage on micro-batches of these sizes, no messages."""
            layout = strategy.layout
            shape = layout.input_shape if strategy.stage == 0 else layout.boundary_shapes[strategy.stage - 1]
            module = strategy.module()
            times = []
            for _ in range(3):
                started = time.perf_counter()
                for rows in sizes:
                    x = torch.randn(rows, *shape).requires_grad_(strategy.stage > 0)
                    y = module(x)
                    (F.cross_entropy(y, torch.zeros(rows, dtype=torch.long)) if strategy.stage == layout.stages - 1
                     else y).backward(None if strategy.stage == layout.stages - 1 else torch.ones_like(y))
                times.append(time.perf_counter() - started)
                module.zero_grad()
            return statistics.median(times) / len(sizes)

        step_times: dict[str, list[float]] = {f"{s}:{m}": [] for s, m in layouts}
        for _ in range(repeats):
            for (schedule, m), strategy in strategies.items():
                strategy.train_step(features, labels)  # warm-up step (allocations, first messages)
                ctx.comm.barrier()
                started = time.perf_counter()
                for _ in range(steps):
                    strategy.train_step(features, labels)
                ctx.comm.barrier()
                step_times[f"{schedule}:{m}"].append((time.perf_counter() - started) / steps)
        per_micro = {f"{s}:{m}": local_compute(strategies[(s, m)], microbatch_sizes(STAGES * batch, m))
                     for s, m in layouts}
        some = next(iter(strategies.values()))
        # c: one boundary message (activation or its gradient) of each micro-batch size, timed as half
        # a ping-pong between the two stages' ranks.
        peer = 1 - ctx.rank
        width_out = some.layout.boundary_shapes[0]
        link_s = {}
        for m in sorted({m for _, m in layouts}):
            rows = microbatch_sizes(STAGES * batch, m)[0]
            buffer = torch.zeros(rows, *width_out)
            times = []
            for _ in range(7):
                ctx.comm.barrier()
                started = time.perf_counter()
                if ctx.rank == 0:
                    ctx.comm.send(buffer, peer, 7).wait()
                    ctx.comm.recv(buffer, peer, 8)
                else:
                    ctx.comm.recv(buffer, peer, 7)
                    ctx.comm.send(buffer, peer, 8).wait()
                times.append((time.perf_counter() - started) / 2)
            link_s[str(m)] = statistics.median(times[1:])
        optimizer_times = []
        for param in some.module().parameters():
            param.grad = torch.zeros_like(param)  # a step skips parameters without gradients
        for _ in range(5):
            started = time.perf_counter()
            some._optimizer.step()  # noqa: SLF001 - the update outside the pipelined part of a step
            optimizer_times.append(time.perf_counter() - started)
        full_batch = local_compute(next(iter(strategies.values())), [STAGES * batch])
        mine = {"stage": some.stage, "step_s": step_times, "link_s": link_s, "micro_s": per_micro,
                "full_batch_s": full_batch, "optimizer_s": statistics.median(optimizer_times),
                "activation_bytes": {f"{s}:{m}": st.epoch_metrics()["activation_bytes"] for (s, m), st in
                                     strategies.items()},
                "param_bytes": next(iter(strategies.values())).epoch_metrics()["param_bytes"]}
        return ctx.comm.allgather_object(mine)

    return train_fn


def summarise(args: argparse.Namespace, ranks: list[dict[str, Any]], layouts: dict[tuple[str, int], Any]) -> dict:
    from sparkdl.strategies.hybrid import microbatch_sizes

    rows = []
    for (schedule, m), layout in layouts.items():
        key = f"{schedule}:{m}"
        measured = statistics.median(max(r["step_s"][key][i] for r in ranks) for i in range(args.repeats))
        t = [r["micro_s"][key] for r in sorted(ranks, key=lambda r: r["stage"])]  # by stage
        micro = len(microbatch_sizes(STAGES * args.batch_size, m))
        optimizer = max(r["optimizer_s"] for r in ranks)
        link = max(r["link_s"][str(m)] for r in ranks)
        c = [link] * (STAGES - 1) + [0.0]  # stage k's outgoing boundary; the last stage has none
        predicted = (micro - 1) * max(tk + 2 * ck for tk, ck in zip(t, c)) + sum(t) + 2 * sum(c) + optimizer
        ideal = max(r["full_batch_s"] for r in ranks)
        rows.append({
            "schedule": schedule, "microbatches": micro, "step_s": round(measured, 5),
            "predicted_s": round(predicted, 5), "ratio": round(measured / predicted, 3),
            "within_target": abs(measured / predicted - 1) <= TARGET,
            "law_factor": round((micro + STAGES - 1) / micro, 3),
            "bubble_fraction": round((STAGES - 1) / (micro + STAGES - 1), 3),
            "micro_stage_s": [round(v, 6) for v in t], "boundary_message_s": round(link, 6),
            "optimizer_s": round(optimizer, 5), "ideal_s": round(ideal, 5),
            "step_over_ideal": round(measured / ideal, 3),
            "activation_bytes_per_rank": [int(r["activation_bytes"][key]) for r in ranks],
            "stage_layers": [f"{a}-{b - 1}" for a, b in zip(layout.cuts, layout.cuts[1:])],
        })
    memory = {}
    for m in args.microbatches:
        g = next(r for r in rows if r["schedule"] == "gpipe" and r["microbatches"] == min(m, STAGES * args.batch_size))
        f = next(r for r in rows if r["schedule"] == "1f1b" and r["microbatches"] == g["microbatches"])
        memory[str(m)] = {"gpipe_peak_bytes": max(g["activation_bytes_per_rank"]),
                          "1f1b_peak_bytes": max(f["activation_bytes_per_rank"]),
                          "1f1b_over_gpipe": round(max(f["activation_bytes_per_rank"]) /
                                                   max(max(g["activation_bytes_per_rank"]), 1), 3)}
    return {"rows": rows, "activation_memory": memory,
            "met": all(r["within_target"] for r in rows),
            "param_bytes_per_rank": [int(r["param_bytes"]) for r in ranks]}


def main() -> None:
    args = parse_args()
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    import sparkdl

    spark = (SparkSession.builder.master("local[2]").appName("sparkdl-bench-pipeline")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    layouts = plans(args)
    started = time.perf_counter()
    ranks = sparkdl.run(make_train_fn(args, layouts), num_workers=STAGES, threads_per_worker=1, progress=False)
    summary = summarise(args, ranks, layouts)
    for row in summary["rows"]:
        print(f"{row['schedule']:5s} m={row['microbatches']:2d}: step {1000 * row['step_s']:8.2f} ms, law "
              f"{1000 * row['predicted_s']:8.2f} ms (x{row['law_factor']}), ratio {row['ratio']:.3f}; activations "
              f"{[round(b / 2**20, 2) for b in row['activation_bytes_per_rank']]} MiB", file=sys.stderr)
    result = {
        "benchmark": "pipeline_bubble", "stages": STAGES, "replicas": 1, "world": STAGES, "master": "local[2]",
        "model": f"MLP 64-{args.width}x{args.layers}-10", "batch_per_rank": args.batch_size,
        "replica_batch": STAGES * args.batch_size, "steps": args.steps, "repeats": args.repeats,
        "threads_per_rank": 1, "target_abs_ratio_error": TARGET, "seconds": round(time.perf_counter() - started, 1),
        **summary,
    }
    spark.stop()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
