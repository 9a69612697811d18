"""Allreduce benchmark: bus bandwidth of sparkdl's communicators against the bare launchers.

Four configurations, world size 2, measured in the same run (issue 4):
  torch_sparkdl    `sparkdl.run(train_fn, num_workers=2, backend="torch")` in barrier tasks on local[2];
                   train_fn times `ctx.comm.allreduce(buf)` (torch.distributed gloo underneath)
  horovod_sparkdl  the same with backend="horovod" (ctx.comm.allreduce -> hvd.allreduce_)
  torch_bare       `python -m torch.distributed.run --standalone --nproc_per_node=2 THIS --worker torch`:
                   torch.distributed.all_reduce (gloo) called directly
  horovod_bare     `horovodrun -np 2 --gloo -H localhost:2 python THIS --worker horovod`: hvd.allreduce_
                   called directly
and two diagnostic baselines (drop them with --configs):
  torch_direct / horovod_direct   the same bare workers started by plain Popen in this session, with
                   the env torchrun / horovodrun would give them. torchrun and horovodrun start every
                   rank in a new session; with kernel.sched_autogroup_enabled=1 that puts each rank in
                   its own CFS autogroup, which on a busy host changes its CPU share. sparkdl's ranks
                   (Spark Python workers) stay in the driver's session, like these.

Every configuration runs the same timing loop (`time_allreduce`): for each buffer size (float32, MB =
2**20 bytes) a barrier, --warmup untimed allreduces, a barrier, then --iters timed allreduces; the
time per allreduce is the slowest rank's (gathered with an allgather of objects). torch uses one
intra-op thread in every worker. --repeats rounds run every configuration once each (in a rotating
order, so drift hits all of them alike); figures are medians over rounds. `*_iter_busbw_gbs` is a
noise-robust companion: the median over all timed iterations of the slowest rank's per-iteration time.

Two checks isolate sparkdl's own cost from the host: `wrapper_ab` (inside the sparkdl tasks: the same
process and group alternate ctx.comm.allreduce with the raw call it wraps, ABBA blocks) and
`wrapper_cpu` (driver only, no collective: Communicator.allreduce with the backend call stubbed out,
against calling the stub directly; ns per call).

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
CONFIGS = ("torch_sparkdl", "torch_bare", "horovod_sparkdl", "horovod_bare", "torch_direct", "horovod_direct")


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
    """Seconds per allreduce for each size, identical on every rank: `seconds` is the slowest rank's
    loop time / iters; `median_iter_seconds` the median over iterations of the slowest rank's time
    for that iteration (less sensitive to a preempted iteration on a shared host)."""
    import torch

    results = []
    for size_mb in sizes_mb:
        buf = torch.ones(size_mb * MB // 4, dtype=torch.float32)
        barrier()
        for _ in range(warmup):
            allreduce(buf)
        barrier()
        marks = [time.perf_counter()]
        for _ in range(iters):
            allreduce(buf)
            marks.append(time.perf_counter())
        steps = [b - a for a, b in zip(marks, marks[1:])]
        per_rank = gather((marks[-1] - marks[0], steps))
        slowest_steps = [max(rank_steps[i] for _, rank_steps in per_rank) for i in range(iters)]
        results.append({"size_mb": size_mb, "seconds": max(total for total, _ in per_rank) / iters,
                        "median_iter_seconds": statistics.median(slowest_steps),
                        "per_rank_seconds": [total / iters for total, _ in per_rank]})
        del buf
    return results


def wrapper_ab(ctx: Any, backend: str, sizes_bytes: tuple[int, ...] = (4, MB), calls: int = 10,
               blocks: int = 10) -> list[dict[str, Any]]:
    """Same process, same group, interleaved: ctx.comm.allreduce against the raw call it wraps
    (torch.distributed.all_reduce / hvd.allreduce_). Isolates the Communicator's own cost."""
    import torch

    if backend == "torch":
        import torch.distributed as dist

        raw: Callable[[Any], Any] = dist.all_reduce
    else:
        import horovod.torch as hvd

        raw = hvd.allreduce_
    out = []
    for nbytes in sizes_bytes:
        buf = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)
        for _ in range(3):
            ctx.comm.allreduce(buf)
            raw(buf)
        samples: dict[str, list[float]] = {"sparkdl": [], "raw": []}
        pair = (("sparkdl", ctx.comm.allreduce), ("raw", raw))
        for block in range(blocks):
            for name, fn in (pair if block % 2 == 0 else pair[::-1]):  # ABBA: no order bias
                ctx.comm.barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    fn(buf)
                samples[name].append((time.perf_counter() - start) / calls)
        gathered = ctx.comm.allgather_object(samples)
        row: dict[str, Any] = {"bytes": nbytes}
        for name in ("sparkdl", "raw"):
            # per block the slowest rank, then the median over blocks
            row[f"{name}_us"] = round(statistics.median(
                max(g[name][b] for g in gathered) for b in range(blocks)) * 1e6, 1)
        row["diff_us"] = round(row["sparkdl_us"] - row["raw_us"], 1)
        out.append(row)
    return out


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


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_direct(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """Diagnostic baseline: the same two bare workers started by plain Popen in THIS session, with
    the env contract torchrun / horovodrun would set (torchrun and horovodrun start every rank in a
    new session, which on a host with kernel.sched_autogroup_enabled=1 changes its CPU share)."""
    with tempfile.TemporaryDirectory(prefix="sparkdl-bench-allreduce-") as tmp:
        out = os.path.join(tmp, "result.json")
        script = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--out", out,
                  "--sizes-mb", ",".join(map(str, args.sizes_mb)), "--iters", str(args.iters),
                  "--warmup", str(args.warmup)]
        server = None
        called = time.time()
        envs = []
        if kind == "torch":
            port = free_port()
            for rank in range(WORLD):
                envs.append({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                             "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(WORLD),
                             "OMP_NUM_THREADS": "1"})
        else:
            from horovod.runner.gloo_run import create_slot_env_vars
            from horovod.runner.http.http_server import RendezvousServer

            from sparkdl.comm.horovod import slot_plan

            plan = slot_plan(["localhost"] * WORLD)
            server = RendezvousServer()
            port = server.start()
            server.init(plan)
            for rank in range(WORLD):
                env = {k: str(v) for k, v in create_slot_env_vars(plan[rank]).items()}
                env.update({"HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1", "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
                            "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
                            "HOROVOD_GLOO_IFACE": "lo"})
                envs.append(env)
        try:
            procs = [subprocess.Popen(script, env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True) for env in envs]
            errors = [p.communicate(timeout=args.launch_timeout)[1] for p in procs]
        finally:
            if server is not None:
                server.stop()
        returned = time.time()
        if any(p.returncode for p in procs) or not os.path.exists(out):
            raise RuntimeError(f"direct {kind} launch failed: {[e[-2000:] for e in errors]}")
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


def make_train_fn(backend: str, sizes_mb: list[int], iters: int, warmup: int) -> Callable[[Any], Any]:
    def train_fn(ctx: Any) -> dict[str, Any]:
        import torch

        torch.set_num_threads(1)
        entered = time.time()
        timings = time_allreduce(ctx.comm.allreduce, ctx.comm.barrier, ctx.comm.allgather_object,
                                 sizes_mb, iters, warmup)
        exited = time.time()
        return {"entered": entered, "exited": exited, "timings": timings, "bytes_sent": ctx.comm.bytes_sent,
                "threads": torch.get_num_threads(), "wrapper_ab": wrapper_ab(ctx, backend),
                "ab_s": time.time() - exited}

    return train_fn


def run_sparkdl(backend: str, args: argparse.Namespace) -> dict[str, Any]:
    import sparkdl

    train_fn = make_train_fn(backend, args.sizes_mb, args.iters, args.warmup)
    called = time.time()
    result = sparkdl.run(train_fn, num_workers=WORLD, backend=backend, tracking=False, progress=False)
    returned = time.time()
    # The A/B check after the timed loop is not teardown: it is subtracted.
    return {"timings": result["timings"], "launch_s": result["entered"] - called,
            "teardown_s": returned - result["exited"] - result["ab_s"], "wall_s": returned - called,
            "wrapper_ab": result["wrapper_ab"], "threads": result["threads"]}


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


def wrapper_cpu_ns(calls: int = 200_000, repeats: int = 5) -> dict[str, float]:
    """Python cost of Communicator.allreduce itself, no collective: the backend call is replaced by a
    no-op in this (driver) process only, and compared with calling that no-op directly. Best of
    `repeats` (timeit convention), nanoseconds per call."""
    import types
    from unittest import mock

    import torch
    import torch.distributed as dist

    from sparkdl.comm.base import WorldInfo
    from sparkdl.comm.horovod import HorovodCommunicator
    from sparkdl.comm.torch_dist import TorchDistCommunicator

    world = WorldInfo(rank=0, size=2, local_rank=0, local_size=2, hosts=("h", "h"), master_addr="h", master_port=1)
    buf = torch.ones(1)

    def noop(tensor: Any, op: Any = None, **_: Any) -> Any:
        return tensor

    def best(fn: Callable[[], Any]) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - start) / calls * 1e9)
        return min(times)

    torch_comm = TorchDistCommunicator.__new__(TorchDistCommunicator)
    torch_comm.world, torch_comm.bytes_sent, torch_comm._use_gpu = world, 0, False
    hvd_stub = types.SimpleNamespace(allreduce_=noop, Sum=0, Average=1, Max=2, Min=3)
    hvd_comm = HorovodCommunicator.__new__(HorovodCommunicator)
    hvd_comm.world, hvd_comm.bytes_sent, hvd_comm.hvd = world, 0, hvd_stub
    with mock.patch.object(dist, "all_reduce", noop):
        torch_wrapped = best(lambda: torch_comm.allreduce(buf))
        torch_raw = best(lambda: dist.all_reduce(buf, op=dist.ReduceOp.SUM))
    hvd_wrapped = best(lambda: hvd_comm.allreduce(buf))
    hvd_raw = best(lambda: hvd_stub.allreduce_(buf, op=hvd_stub.Sum))
    return {"torch_wrapper_ns": round(torch_wrapped, 1), "torch_direct_call_ns": round(torch_raw, 1),
            "torch_extra_ns": round(torch_wrapped - torch_raw, 1),
            "horovod_wrapper_ns": round(hvd_wrapped, 1), "horovod_direct_call_ns": round(hvd_raw, 1),
            "horovod_extra_ns": round(hvd_wrapped - hvd_raw, 1)}


def summarize(rounds: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> dict[str, Any]:
    per_size = []
    for i, size_mb in enumerate(args.sizes_mb):
        row: dict[str, Any] = {"size_mb": size_mb}
        for config, runs in rounds.items():
            bws = [bus_bandwidth_gbs(size_mb, r["timings"][i]["seconds"]) for r in runs]
            row[f"{config}_busbw_gbs"] = round(statistics.median(bws), 3)
            row[f"{config}_busbw_gbs_all"] = [round(b, 3) for b in bws]
            # Noise-robust companion: median over every timed iteration of every round.
            steps = [r["timings"][i]["median_iter_seconds"] for r in runs]
            row[f"{config}_iter_busbw_gbs"] = round(bus_bandwidth_gbs(size_mb, statistics.median(steps)), 3)
        for backend in ("torch", "horovod"):
            for base, label in (("bare", ""), ("direct", "_vs_direct")):
                for kind, suffix in (("busbw_gbs", ""), ("iter_busbw_gbs", "_iter")):
                    s, b = row.get(f"{backend}_sparkdl_{kind}"), row.get(f"{backend}_{base}_{kind}")
                    if s and b:
                        row[f"{backend}_overhead_pct{label}{suffix}"] = round((b / s - 1) * 100, 2)
        row["memcpy_gbs"] = round(memcpy_gbs(size_mb, args.iters), 3)
        per_size.append(row)
    overheads = [row[k] for row in per_size for k in ("torch_overhead_pct", "horovod_overhead_pct") if k in row]
    launch = {config: {"launch_s": round(statistics.median(r["launch_s"] for r in runs), 2),
                       "teardown_s": round(statistics.median(r["teardown_s"] for r in runs), 2),
                       "launch_s_all": [round(r["launch_s"], 2) for r in runs]}
              for config, runs in rounds.items()}
    wrapper: dict[str, Any] = {}
    for config, runs in rounds.items():
        if runs and "wrapper_ab" in runs[0]:
            wrapper[config] = [{"bytes": row["bytes"],
                                **{k: round(statistics.median(r["wrapper_ab"][j][k] for r in runs), 1)
                                   for k in ("sparkdl_us", "raw_us", "diff_us")}}
                               for j, row in enumerate(runs[0]["wrapper_ab"])]
            wrapper[config + "_threads"] = runs[0]["threads"]
    return {"per_size": per_size, "launch": launch, "wrapper_ab": wrapper, "wrapper_cpu": wrapper_cpu_ns(),
            "max_overhead_pct": max(overheads) if overheads else None,
            "meets_target": all(o <= TARGET_OVERHEAD_PCT for o in overheads) if overheads else None}


def autogroup() -> int | None:
    try:
        return int(Path("/proc/sys/kernel/sched_autogroup_enabled").read_text())
    except (OSError, ValueError):
        return None


def main() -> None:
    args = parse_args()
    if args.worker:
        worker_main(args)
        return
    began = time.time()
    load_before = os.getloadavg()
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
        "torch_direct": lambda: run_direct("torch", args),
        "horovod_direct": lambda: run_direct("horovod", args),
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
              "target_overhead_pct": TARGET_OVERHEAD_PCT, "spark_session_s": round(spark_s, 2),
              # The host is shared: a 1-minute load above the core count means other work competed.
              "loadavg_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
              # torchrun and horovodrun start every rank in a new session (own CFS autogroup when this
              # is 1); sparkdl's ranks are Spark Python workers in the driver's session.
              "sched_autogroup_enabled": autogroup()}
    report.update(summarize(rounds, args))
    report["wall_s"] = round(time.time() - began, 1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
