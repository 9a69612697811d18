"""Allreduce benchmark: bus bandwidth of sparkdl's communicators against the bare launchers.

Four configurations, world size 2, measured in the same run (issue 4):
  torch_sparkdl    `sparkdl.run(train_fn, num_workers=2, backend="torch")` in barrier tasks on local[2];
                   train_fn times `ctx.comm.allreduce(buf)` (torch.distributed gloo underneath)
  horovod_sparkdl  the same with backend="horovod" (ctx.comm.allreduce -> hvd.allreduce_)
  torch_bare       `python -m torch.distributed.run --standalone --nproc_per_node=2 THIS --worker torch`:
                   torch.distributed.all_reduce (gloo) called directly
  horovod_bare     `horovodrun -np 2 --gloo -H localhost:2 python THIS --worker horovod`: hvd.allreduce_
                   called directly

Every configuration runs the same timing loop (`time_allreduce`): for each buffer size (float32, MB =
2**20 bytes) a barrier, --warmup untimed allreduces, a barrier, then --iters timed allreduces; the
time per allreduce is the slowest rank's (gathered with an allgather of objects). torch uses one
intra-op thread in every worker. --repeats rounds run the four configurations each (in a rotating
order, so drift hits all of them alike); figures are medians over rounds.

  bus bandwidth = size_bytes * 2 (n - 1) / n / seconds_per_allreduce   (NCCL-tests convention; n = 2)

GB/s are 10**9 bytes/s. The reference upper bound on one host is the memory-copy bandwidth of a
numpy copy of the same buffer in one process (bytes copied / s): a ring allreduce over loopback
moves at least that much data through memory per rank. Launch cost (process/task start, imports,
rendezvous, backend init) and teardown are reported separately and are not part of any bandwidth.
overhead_pct = (bare_bw / sparkdl_bw - 1) * 100; the target is <= 5%.

Prints one JSON object as the last line of stdout. Nothing here asserts a timing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MB = 2 ** 20
GB = 1e9
TARGET_OVERHEAD_PCT = 5.0
WORLD = 2
CONFIGS = ("torch_sparkdl", "torch_bare", "horovod_sparkdl", "horovod_bare")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=lambda s: [int(v) for v in s.split(",") if v.strip()],
                        default=[1, 4, 16, 64, 256], help="comma-separated buffer sizes in MB (2**20 bytes)")
    parser.add_argument("--iters", type=int, default=10, help="timed allreduces per size")
    parser.add_argument("--warmup", type=int, default=2, help="untimed allreduces per size before timing")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of all four configurations (median)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="subset of " + ",".join(CONFIGS))
    parser.add_argument("--launch-timeout", type=float, default=300.0, help="seconds per bare launch")
    parser.add_argument("--worker", choices=("torch", "horovod"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if min(args.iters, args.repeats) < 1 or args.warmup < 0 or not args.sizes_mb or min(args.sizes_mb) < 1:
        parser.error("--iters and --repeats must be >= 1, --warmup >= 0, sizes >= 1 MB")
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = set(args.configs) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configurations {sorted(unknown)}; choose from {CONFIGS}")
    return args


# ---------------------------------------------------------------- the timing loop (every configuration)

def time_allreduce(allreduce: Callable[[Any], Any], barrier: Callable[[], None],
                   gather: Callable[[Any], list[Any]], sizes_mb: list[int], iters: int,
                   warmup: int) -> list[dict[str, Any]]:
    """Seconds per allreduce for each size: the slowest rank's, identical on every rank."""
    import torch

    results = []
    for size_mb in sizes_mb:
        buf = torch.ones(size_mb * MB // 4, dtype=torch.float32)
        barrier()
        for _ in range(warmup):
            allreduce(buf)
        barrier()
        start = time.perf_counter()
        for _ in range(iters):
            allreduce(buf)
        elapsed = time.perf_counter() - start
        per_rank = [float(t) for t in gather(elapsed)]
        results.append({"size_mb": size_mb, "seconds": max(per_rank) / iters,
                        "per_rank_seconds": [t / iters for t in per_rank]})
        del buf
    return results


def bus_bandwidth_gbs(size_mb: int, seconds: float, world: int = WORLD) -> float:
    return size_mb * MB * 2 * (world - 1) / world / seconds / GB


# ---------------------------------------------------------------- bare workers (--worker torch|horovod)

def worker_main(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    if args.worker == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()

        def gather(obj: Any) -> list[Any]:
            out: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(out, obj)
            return out

        allreduce, barrier = dist.all_reduce, dist.barrier
    else:
        import horovod.torch as hvd

        hvd.init()
        rank = hvd.rank()
        allreduce, barrier, gather = hvd.allreduce_, hvd.barrier, hvd.allgather_object
    entered = time.time()
    timings = time_allreduce(allreduce, barrier, gather, args.sizes_mb, args.iters, args.warmup)
    exited = time.time()
    if rank == 0:
        Path(args.out).write_text(json.dumps({"entered": entered, "exited": exited, "timings": timings}))
    if args.worker == "torch":
        dist.destroy_process_group()
    else:
        hvd.shutdown()


def run_bare(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """One launch of the bare launcher; returns timings plus launch/teardown seconds."""
    with tempfile.TemporaryDirectory(prefix="sparkdl-bench-allreduce-") as tmp:
        out = os.path.join(tmp, "result.json")
        script = [str(Path(__file__).resolve()), "--worker", kind, "--out", out,
                  "--sizes-mb", ",".join(map(str, args.sizes_mb)), "--iters", str(args.iters),
                  "--warmup", str(args.warmup)]
        env = dict(os.environ)
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        if kind == "torch":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
                   *script]
        else:
            horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
            cmd = [horovodrun, "-np", str(WORLD), "--gloo", "-H", f"localhost:{WORLD}", sys.executable, *script]
        called = time.time()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.launch_timeout)
        returned = time.time()
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"{' '.join(cmd)} failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n"
                               f"{proc.stderr[-3000:]}")
        result = json.loads(Path(out).read_text())
    return {"timings": result["timings"], "launch_s": result["entered"] - called,
            "teardown_s": returned - result["exited"], "wall_s": returned - called}


# ---------------------------------------------------------------- sparkdl configurations (driver)

def make_spark() -> Any:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(f"local[{WORLD}]").appName("sparkdl-bench-allreduce")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def make_train_fn(sizes_mb: list[int], iters: int, warmup: int) -> Callable[[Any], Any]:
    def train_fn(ctx: Any) -> dict[str, Any]:
        import torch

        torch.set_num_threads(1)
        entered = time.time()
        timings = time_allreduce(ctx.comm.allreduce, ctx.comm.barrier, ctx.comm.allgather_object,
                                 sizes_mb, iters, warmup)
        return {"entered": entered, "exited": time.time(), "timings": timings,
                "bytes_sent": ctx.comm.bytes_sent, "threads": torch.get_num_threads()}

    return train_fn


def run_sparkdl(backend: str, args: argparse.Namespace) -> dict[str, Any]:
    import sparkdl

    train_fn = make_train_fn(args.sizes_mb, args.iters, args.warmup)
    called = time.time()
    result = sparkdl.run(train_fn, num_workers=WORLD, backend=backend, tracking=False, progress=False)
    returned = time.time()
    return {"timings": result["timings"], "launch_s": result["entered"] - called,
            "teardown_s": returned - result["exited"], "wall_s": returned - called}


# ---------------------------------------------------------------- reference and report

def memcpy_gbs(size_mb: int, iters: int) -> float:
    """Bytes copied per second by numpy (one process, one thread), median of `iters` copies."""
    import numpy as np

    src = np.ones(size_mb * MB // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    times = []
    for _ in range(max(iters, 3)):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return size_mb * MB / statistics.median(times) / GB


def summarize(rounds: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> dict[str, Any]:
    per_size = []
    for i, size_mb in enumerate(args.sizes_mb):
        row: dict[str, Any] = {"size_mb": size_mb, "bytes": size_mb * MB}
        for config, runs in rounds.items():
            bws = [bus_bandwidth_gbs(size_mb, r["timings"][i]["seconds"]) for r in runs]
            row[f"{config}_busbw_gbs"] = round(statistics.median(bws), 3)
            row[f"{config}_busbw_gbs_all"] = [round(b, 3) for b in bws]
            row[f"{config}_ms"] = round(statistics.median(r["timings"][i]["seconds"] for r in runs) * 1e3, 3)
        for backend in ("torch", "horovod"):
            s, b = row.get(f"{backend}_sparkdl_busbw_gbs"), row.get(f"{backend}_bare_busbw_gbs")
            if s and b:
                row[f"{backend}_overhead_pct"] = round((b / s - 1) * 100, 2)
        row["memcpy_gbs"] = round(memcpy_gbs(size_mb, args.iters), 3)
        per_size.append(row)
    overheads = [row[k] for row in per_size for k in ("torch_overhead_pct", "horovod_overhead_pct") if k in row]
    launch = {config: {"launch_s": round(statistics.median(r["launch_s"] for r in runs), 2),
                       "teardown_s": round(statistics.median(r["teardown_s"] for r in runs), 2),
                       "launch_s_all": [round(r["launch_s"], 2) for r in runs]}
              for config, runs in rounds.items()}
    return {"per_size": per_size, "launch": launch,
            "max_overhead_pct": max(overheads) if overheads else None,
            "meets_target": all(o <= TARGET_OVERHEAD_PCT for o in overheads) if overheads else None}


def main() -> None:
    args = parse_args()
    if args.worker:
        worker_main(args)
        return
    began = time.time()
    spark_s = 0.0
    if any(c.endswith("_sparkdl") for c in args.configs):
        start = time.time()
        make_spark()
        spark_s = time.time() - start
    runners: dict[str, Callable[[], dict[str, Any]]] = {
        "torch_sparkdl": lambda: run_sparkdl("torch", args),
        "torch_bare": lambda: run_bare("torch", args),
        "horovod_sparkdl": lambda: run_sparkdl("horovod", args),
        "horovod_bare": lambda: run_bare("horovod", args),
    }
    rounds: dict[str, list[dict[str, Any]]] = {c: [] for c in args.configs}
    for r in range(args.repeats):
        order = args.configs[r % len(args.configs):] + args.configs[: r % len(args.configs)]
        for config in order:
            outcome = runners[config]()
            rounds[config].append(outcome)
            print(f"round {r + 1}/{args.repeats} {config}: launch {outcome['launch_s']:.1f}s, "
                  + ", ".join(f"{t['size_mb']}MB {bus_bandwidth_gbs(t['size_mb'], t['seconds']):.2f}GB/s"
                              for t in outcome["timings"]), file=sys.stderr, flush=True)
    import torch

    report = {"benchmark": "allreduce", "world_size": WORLD, "dtype": "float32", "sizes_mb": args.sizes_mb,
              "iters": args.iters, "warmup": args.warmup, "repeats": args.repeats, "cpus": os.cpu_count(),
              "torch": torch.__version__, "configs": args.configs,
              "busbw_formula": "size_bytes * 2*(n-1)/n / seconds_per_allreduce, n=2; GB = 1e9 bytes; MB = 2**20 bytes",
              "upper_bound": "memcpy_gbs: numpy copy of the same buffer in one process (bytes copied / s)",
              "overhead_formula": "(bare_busbw / sparkdl_busbw - 1) * 100",
              "target_overhead_pct": TARGET_OVERHEAD_PCT, "spark_session_s": round(spark_s, 2)}
    report.update(summarize(rounds, args))
    report["wall_s"] = round(time.time() - began, 1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
