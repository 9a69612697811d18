"""The planner's overlap model (planner/overlap.py, issue 53 part 1) against a measured overlapped
data-parallel step, on the multi-host bed.

    .venv/bin/python benchmarks/overlap_model.py [--workers 2] [--networks 20mbit,100mbit,1gbit]

Needs root (tests/support/multihost.py). W worker hosts (network namespaces, shaped links, one rank
and one torch thread each, gloo, no Spark), the same MLP (--width, --depth) on each. Per network:
  measured_wait_ms     the step's time blocked in finish() waiting for the buckets (sparkdl
                       DataParallel, train.overlap_grads=True): the exposed allreduce as it ran, on
                       the rank that ended backward last (the least-waiting rank of each step: the
                       others also wait out the compute skew, max_rank_wait_ms)
  measured_excess_ms   the W-rank overlapped step minus the same step without any communication
                       (the exposed allreduce plus what the background transfer slows compute by)
  predicted_hooks_ms   the model fed with the ready times post-accumulate hooks measured on a real
                       backward (profile.gradient_times) and transfers priced by allreduce_s on the
                       link as measured here (a 4-byte and a 1 MiB allreduce give latency and bandwidth,
                       the 1 MiB one beside matrix products how much a busy rank slows a transfer:
                       busy_slowdown; predicted_hooks_unslowed_ms leaves that out)
  predicted_planner_ms cost.data_parallel on per-layer times from profile_sequential (FLOP shares
                       and measured backward shares), the same link
  old_formula_ms       the formula this replaced: max(0, T_AR(grad bytes) - T_bwd)
Medians over --repeats rounds of --steps steps (step times: the slowest rank's). Prints JSON (--out writes it).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RATES = {"10gbit": 10_000_000_000, "1gbit": 1_000_000_000, "100mbit": 100_000_000, "20mbit": 20_000_000}
PORT = 29671


def build_model(width: int, depth: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(256, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def link(comm: Any, world: int) -> Any:
    """The link as a collective sees it: latency per hop and bandwidth fitted to allreduce_s, and
    how much longer a 1 MiB allreduce takes while this rank computes (matrix products polled
    against its completion: a bucket's transfer beside backward)."""
    import torch
    import torch.distributed as dist

    from sparkdl.planner import cost

    def median_s(numel: int, busy: bool = False) -> float:
        tensor, a = torch.zeros(numel), torch.randn(256, 256)
        times = []
        for _ in range(5):
            comm.barrier()
            started = time.perf_counter()
            if busy:  # torch.distributed's own handle: the Communicator's has no completion test
                pending = dist.all_reduce(tensor, async_op=True)
                while not pending.is_completed():
                    a @ a
                pending.wait()
            else:
                comm.allreduce(tensor)
            times.append(time.perf_counter() - started)
        return max(comm.allgather_object(statistics.median(times)))

    small, big_bytes = median_s(1), 1 << 20
    big = median_s(big_bytes // 4)
    busy = median_s(big_bytes // 4, busy=True)
    hops = 2 * (world - 1)
    latency = small / hops
    bandwidth = hops / world * big_bytes / max(big - small, 1e-9)
    return cost.Network(latency_s=latency, bandwidth_Bps=bandwidth, busy_slowdown=max(1.0, busy / big))


def predictions(args: argparse.Namespace, comm: Any, world: int) -> dict[str, float]:
    import torch.nn.functional as F

    from sparkdl.planner import cost, overlap
    from sparkdl.planner.profile import gradient_times, profile_sequential

    net = link(comm, world)
    x, y = batch(args)
    model = build_model(args.width, args.depth)
    times = gradient_times(model, x, lambda out: F.cross_entropy(out, y), repeats=5)
    buckets = overlap.measured_buckets(times.param_bytes, times.ready_s)
    hooks = overlap.timeline(buckets, [cost.allreduce_s(b.nbytes, world, net) for b in buckets], times.backward_s,
                             busy_slowdown=net.busy_slowdown)
    profile = profile_sequential(model, 256, rows=args.batch, repeats=5)
    flops = 1e9  # any rate: per-layer seconds become FLOPs at it and back
    layers = tuple(cost.LayerCost(params=layer.params, flops=layer.seconds * flops / (3 * args.batch),
                                  out_bytes=layer.out_bytes, saved_bytes=layer.saved_bytes,
                                  backward_share=layer.backward_share) for layer in profile.layers)
    work = cost.Workload(layers=layers, world=world, rows=args.batch, flops_per_s=flops, optimizer_bytes_per_param=8)
    planner = cost.data_parallel(work, net, overlap=1.0)
    quiet = dataclasses.replace(net, busy_slowdown=1.0)
    unslowed = overlap.timeline(buckets, [cost.allreduce_s(b.nbytes, world, quiet) for b in buckets], times.backward_s)
    backward = sum(cost.backward_layers_s(work))
    old = max(0.0, cost.allreduce_s(work.params * 4, world, net) - backward)
    return {"predicted_hooks_ms": 1e3 * hooks.exposed_s, "predicted_planner_ms": 1e3 * planner.comm_s,
            "predicted_hooks_unslowed_ms": 1e3 * unslowed.exposed_s, "busy_slowdown": net.busy_slowdown,
            "old_formula_ms": 1e3 * old, "hooks_backward_ms": 1e3 * times.backward_s,
            "planner_backward_ms": 1e3 * backward, "buckets": len(buckets),
            "last_bucket_transfer_ms": 1e3 * cost.allreduce_s(buckets[-1].nbytes, world, net),
            "link_latency_ms": 1e3 * net.latency_s, "link_mbit_s": net.bandwidth_Bps * 8 / 1e6}


def batch(args: argparse.Namespace) -> tuple[Any, Any]:
    import torch

    generator = torch.Generator().manual_seed(100 + args.rank)
    return torch.randn(args.batch, 256, generator=generator), torch.randint(0, 10, (args.batch,), generator=generator)


def timed(step: Any, args: argparse.Namespace, comm: Any) -> tuple[float, list[float]]:
    """(seconds a step, seconds blocked in collectives in each step) over --steps steps after --warmup."""
    from sparkdl.comm.base import blocked_seconds

    for _ in range(args.warmup):
        step()
    comm.barrier()
    waits, started = [], time.perf_counter()
    for _ in range(args.steps):
        blocked = blocked_seconds()
        step()
        waits.append(blocked_seconds() - blocked)
    return (time.perf_counter() - started) / args.steps, waits


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    from sparkdl.comm.base import WorldInfo
    from sparkdl.comm.torch_dist import TorchDistCommunicator
    from sparkdl.config import TrainConfig
    from sparkdl.model.objectives import LOSSES
    from sparkdl.strategies.data_parallel import DataParallel

    torch.set_num_threads(1)
    hosts = tuple(args.hosts.split(","))
    world = WorldInfo(rank=args.rank, size=len(hosts), local_rank=0, local_size=1, hosts=hosts,
                      master_addr=hosts[0], master_port=args.port)
    comm = TorchDistCommunicator(world, 600)
    x, y = batch(args)
    strategy = DataParallel(comm, None, TrainConfig(overlap_grads=True))
    strategy.setup(build_model(args.width, args.depth), lambda p: torch.optim.SGD(p, lr=0.01), LOSSES["cross_entropy"])
    local = build_model(args.width, args.depth)
    local_optimizer = torch.optim.SGD(local.parameters(), lr=0.01)

    def local_step() -> None:
        local_optimizer.zero_grad()
        F.cross_entropy(local(x), y).backward()
        local_optimizer.step()

    rounds: list[dict[str, Any]] = []
    for _ in range(args.repeats):
        step_s, waits = timed(lambda: strategy.train_step(x, y), args, comm)
        local_s, _ = timed(local_step, args, comm)
        rounds.append({"step": step_s, "waits": waits, "local": local_s})
    predicted = predictions(args, comm, len(hosts))
    everyone = comm.allgather_object(rounds)
    if args.rank == 0:
        # A step's exposed allreduce is the wait of the rank that ended backward last: the others
        # also wait for it (compute skew between loaded ranks), so per step the smallest wait.
        worst = [{"step": max(r[i]["step"] for r in everyone), "local": max(r[i]["local"] for r in everyone),
                  "wait": statistics.median(min(r[i]["waits"][k] for r in everyone) for k in range(args.steps)),
                  "wait_slowest_rank": statistics.median(max(r[i]["waits"][k] for r in everyone)
                                                         for k in range(args.steps))}
                 for i in range(args.repeats)]
        Path(args.out).write_text(json.dumps({"rounds": worst, "predicted": predicted,
                                              "params": sum(p.numel() for p in local.parameters())}))
    comm.close()


def summarise(network: str, raw: dict[str, Any]) -> dict[str, Any]:
    rounds = raw["rounds"]

    def median_ms(key: str) -> float:
        return round(1e3 * statistics.median(r[key] for r in rounds), 2)

    measured_wait = median_ms("wait")
    excess = round(statistics.median(1e3 * (r["step"] - r["local"]) for r in rounds), 2)
    predicted = {k: round(v, 2) if isinstance(v, float) else v for k, v in raw["predicted"].items()}
    return {"network": network, "step_ms": median_ms("step"), "local_step_ms": median_ms("local"),
            "measured_wait_ms": measured_wait, "max_rank_wait_ms": median_ms("wait_slowest_rank"),
            "measured_excess_ms": excess, **predicted,
            "hooks_over_wait": round(predicted["predicted_hooks_ms"] / measured_wait, 3) if measured_wait else None,
            "planner_over_wait": round(predicted["predicted_planner_ms"] / measured_wait, 3) if measured_wait else None}


def run_network(bed: Any, args: argparse.Namespace, index: int, network: str) -> dict[str, Any]:
    for host in bed.workers:
        bed.shape(host, RATES[network])
    out = bed.shared / f"overlap-model-{network}.json"
    hosts = ",".join(h.address for h in bed.workers)
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--hosts", hosts,
            "--port", str(PORT + index), "--out", str(out)]
    for key in ("repeats", "steps", "warmup", "batch", "width", "depth"):
        argv += [f"--{key}", str(getattr(args, key))]
    procs = [bed.start_on(host, argv + ["--rank", str(rank)], f"overlap-model-{network}",
                          env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
             for rank, host in enumerate(bed.workers)]
    for proc in procs:
        proc.process.wait(timeout=args.timeout)
    if not out.exists():
        logs = "\n".join(p.log.read_text(errors="replace")[-3000:] for p in procs)
        raise SystemExit(f"{network}: the workers wrote nothing:\n{logs}")
    raw = json.loads(out.read_text())
    return {**summarise(network, raw), "params": raw["params"]}


def controller(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    import multihost

    why = multihost.why_not()
    if why:
        raise SystemExit(f"overlap_model needs the multi-host bed: {why}")
    root = Path("/var/tmp") / f"sparkdl-overlap-model-{os.getpid()}"
    shutil.rmtree(root, ignore_errors=True)
    started, load_before = time.time(), os.getloadavg()
    networks: list[dict[str, Any]] = []
    try:
        bed = multihost.Bed(root, workers=args.workers).start(spark=False)
        try:
            for index, network in enumerate(args.networks.split(",")):
                networks.append(run_network(bed, args, index, network))
                print(json.dumps(networks[-1]), file=sys.stderr)
        finally:
            bed.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {"benchmark": "overlap_model", "hosts": f"{args.workers} worker hosts (network namespaces on one "
              f"machine, {os.cpu_count()} cores), one rank and one torch thread each, gloo",
              "model": f"MLP 256-{args.width}x{args.depth}-10", "batch_per_rank": args.batch,
              "repeats": args.repeats, "steps": args.steps, "networks": networks,
              "seconds": round(time.time() - started, 1), "loadavg_start": [round(x, 2) for x in load_before],
              "loadavg_end": [round(x, 2) for x in os.getloadavg()]}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--networks", default="20mbit,100mbit,1gbit")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--out", default="")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--hosts", default="")
    parser.add_argument("--port", type=int, default=PORT)
    args = parser.parse_args()
    worker(args) if args.worker else controller(args)


if __name__ == "__main__":
    main()
