"""Data-parallel step time with gradient averaging overlapped with backward, against averaging
after backward and against DistributedDataParallel, on the multi-host bed (issue 43 item 5).

    .venv/bin/python benchmarks/overlap.py [--workers 2] [--networks 1gbit,100mbit] [--repeats 5] [--steps 5]
    .venv/bin/python benchmarks/overlap.py --model gpt --batch 16 --link 20mbit,100mbit,1gbit  (issue 53 part 6)

Needs root (tests/support/multihost.py). W worker hosts (network namespaces with their own
addresses and shaped links; no Spark: one Python process per host, one rank, one torch thread), the
same MLP (--width, --depth: 2.4M parameters, 9.6 MB of fp32 gradients by default; --model gpt: the GPT of
examples/language_model.py, 137k parameters, with a fit's weighted token batches) and the same
per-rank batches for three rows, run in the same processes one after the other in every round
(the order rotated each round), so their ratios are side by side:
  sparkdl_overlap    DataParallel, train.overlap_grads=True (buckets reduced during backward)
  sparkdl_after      DataParallel, train.overlap_grads=False (every bucket after backward)
  ddp                torch's DistributedDataParallel (gloo, default buckets) on the process group
                     sparkdl's communicator opened: what torchrun's env:// init gives, minus the launcher
A round times --steps steps of each row after --warmup steps; figures are the median over --repeats
rounds of the mean step time (the slowest rank's). Target: sparkdl_overlap / ddp <= 1.05 at 100 Mbit/s
and 1 Gbit/s. Prints JSON (and writes it to --out when given).
"""
from __future__ import annotations

import argparse
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
ROWS = ("sparkdl_overlap", "sparkdl_after", "ddp")
PORT = 29611


def build_model(width: int, depth: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(256, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def build_gpt(d_model: int, layers: int, seq_len: int) -> Any:
    """The small GPT of examples/language_model.py (d=64, 2 blocks: 137,216 parameters, 549 KB of
    fp32 gradients: the issue-53 20 Mbit/s case), seeded like build_model."""
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    from language_model import gpt

    torch.manual_seed(0)
    return gpt(d_model, layers, 4, seq_len)


def make_workload(args: argparse.Namespace) -> tuple[Any, list[tuple[Any, Any, Any]]]:
    """(model factory, per-rank batches of (inputs, labels, weights)). The GPT's batches carry
    weights of ones, as a fit's token batches do (executor/loop.py _triples): the weighted path, its
    weight total riding in the first bucket."""
    import torch

    generator = torch.Generator().manual_seed(100 + args.rank)
    if args.model == "gpt":
        tokens = [torch.randint(0, 256, (args.batch, args.seq_len + 1), generator=generator) for _ in range(4)]
        return (lambda: build_gpt(args.d_model, args.layers, args.seq_len),
                [(t[:, :-1].contiguous(), t[:, 1:].contiguous(), torch.ones(args.batch)) for t in tokens])
    return (lambda: build_model(args.width, args.depth),
            [(torch.randn(args.batch, 256, generator=generator),
              torch.randint(0, 10, (args.batch,), generator=generator), None) for _ in range(4)])


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from sparkdl.comm.base import WorldInfo, blocked_seconds
    from sparkdl.comm.torch_dist import TorchDistCommunicator
    from sparkdl.config import TrainConfig
    from sparkdl.model.objectives import LOSSES
    from sparkdl.strategies.data_parallel import DataParallel

    torch.set_num_threads(1)
    hosts = tuple(args.hosts.split(","))
    world = WorldInfo(rank=args.rank, size=len(hosts), local_rank=0, local_size=1, hosts=hosts,
                      master_addr=hosts[0], master_port=args.port)
    comm = TorchDistCommunicator(world, 600)
    factory, batches = make_workload(args)
    rows: dict[str, Any] = {}
    for name in ROWS[:2]:
        strategy = DataParallel(comm, None, TrainConfig(overlap_grads=name == "sparkdl_overlap"))
        strategy.setup(factory(), lambda p: torch.optim.SGD(p, lr=0.01), LOSSES["cross_entropy"])
        rows[name] = (lambda s: lambda x, y, w: s.train_step(x, y, w))(strategy)
    ddp = DistributedDataParallel(factory())
    ddp_optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)

    def ddp_step(x: Any, y: Any, w: Any) -> None:
        ddp_optimizer.zero_grad()
        out = ddp(x)
        F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
        ddp_optimizer.step()

    rows["ddp"] = ddp_step
    params = sum(p.numel() for p in ddp.parameters())
    times: dict[str, list[float]] = {name: [] for name in ROWS}
    waits: dict[str, list[float]] = {name: [] for name in ROWS}
    sent: dict[str, list[int]] = {name: [] for name in ROWS[:2]}
    for round_number in range(args.repeats):
        order = ROWS[round_number % 3:] + ROWS[:round_number % 3]
        for name in order:
            for step in range(args.warmup):
                rows[name](*batches[step % len(batches)])
            comm.barrier()
            before, blocked = comm.bytes_sent, blocked_seconds()
            started = time.perf_counter()
            for step in range(args.steps):
                rows[name](*batches[step % len(batches)])
            times[name].append((time.perf_counter() - started) / args.steps)
            waits[name].append((blocked_seconds() - blocked) / args.steps)  # DDP's waits are its own: ~0 here
            if name in sent:
                sent[name].append((comm.bytes_sent - before) // args.steps)
    everyone = comm.allgather_object({"times": times, "waits": waits})
    if args.rank == 0:
        slowest = {name: [max(r["times"][name][i] for r in everyone) for i in range(args.repeats)] for name in ROWS}
        result = {"params": params, "grad_mb": round(params * 4 / 1e6, 2), "step_s_per_round": slowest,
                  "wait_s_per_round_rank0": waits, "bytes_per_step_rank0": {k: v[0] for k, v in sent.items()}}
        Path(args.out).write_text(json.dumps(result))
    comm.close()


def summarise(network: str, raw: dict[str, Any]) -> dict[str, Any]:
    rounds = raw["step_s_per_round"]
    median_ms = {name: round(1000 * statistics.median(rounds[name]), 2) for name in ROWS}

    def ratio(a: str, b: str) -> dict[str, Any]:
        per_round = [round(x / y, 3) for x, y in zip(rounds[a], rounds[b])]
        return {"median": round(statistics.median(per_round), 3), "per_round": per_round}

    overlap_vs_ddp = ratio("sparkdl_overlap", "ddp")
    return {"network": network, "step_ms_median": median_ms,
            "step_ms_per_round": {k: [round(1000 * x, 1) for x in v] for k, v in rounds.items()},
            "overlap_over_ddp": overlap_vs_ddp, "after_over_ddp": ratio("sparkdl_after", "ddp"),
            "overlap_over_after": ratio("sparkdl_overlap", "sparkdl_after"),
            "target_overlap_over_ddp_le": 1.05, "met": overlap_vs_ddp["median"] <= 1.05,
            "wait_ms_median_rank0": {k: round(1000 * statistics.median(v), 1)
                                     for k, v in raw["wait_s_per_round_rank0"].items() if k != "ddp"},
            "bytes_per_step_rank0": raw["bytes_per_step_rank0"]}


def describe_model(args: argparse.Namespace) -> str:
    if args.model == "gpt":
        return f"GPT of examples/language_model.py (d={args.d_model}, {args.layers} blocks, {args.seq_len} tokens)"
    return f"MLP 256-{args.width}x{args.depth}-10"


def controller(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    import multihost

    why = multihost.why_not()
    if why:
        raise SystemExit(f"overlap needs the multi-host bed: {why}")
    root = Path("/var/tmp") / f"sparkdl-overlap-{os.getpid()}"
    shutil.rmtree(root, ignore_errors=True)
    started, load_before = time.time(), os.getloadavg()
    networks: list[dict[str, Any]] = []
    raw_params = None
    try:
        bed = multihost.Bed(root, workers=args.workers).start(spark=False)
        try:
            hosts = ",".join(h.address for h in bed.workers)
            for index, network in enumerate(args.networks.split(",")):
                for host in bed.workers:
                    bed.shape(host, RATES[network])
                out = bed.shared / f"overlap-{network}.json"
                argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--hosts", hosts,
                        "--port", str(PORT + index), "--out", str(out)]
                for key in ("repeats", "steps", "warmup", "batch", "width", "depth", "model", "d_model", "layers",
                            "seq_len"):
                    argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
                procs = [bed.start_on(host, argv + ["--rank", str(rank)], f"overlap-{network}",
                                      env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
                         for rank, host in enumerate(bed.workers)]
                for proc in procs:
                    proc.process.wait(timeout=args.timeout)
                if not out.exists():
                    logs = "\n".join(p.log.read_text(errors="replace")[-3000:] for p in procs)
                    raise SystemExit(f"{network}: the workers wrote nothing:\n{logs}")
                raw = json.loads(out.read_text())
                raw_params = raw["params"], raw["grad_mb"]
                networks.append(summarise(network, raw))
                print(json.dumps(networks[-1]), file=sys.stderr)
        finally:
            bed.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {"benchmark": "overlap", "hosts": f"{args.workers} worker hosts (network namespaces on one machine, "
              f"{os.cpu_count()} cores), one rank and one torch thread each, gloo",
              "model": describe_model(args), "params": raw_params and raw_params[0],
              "grad_mb": raw_params and raw_params[1], "batch_per_rank": args.batch, "repeats": args.repeats,
              "steps": args.steps, "warmup": args.warmup, "networks": networks,
              "seconds": round(time.time() - started, 1), "loadavg_start": [round(x, 2) for x in load_before],
              "loadavg_end": [round(x, 2) for x in os.getloadavg()]}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--networks", "--link", default="100mbit,1gbit", help="comma-separated: 20mbit, 100mbit, 1gbit")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", default="")
    # worker side (started by the controller on each bed host)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--hosts", default="")
    parser.add_argument("--port", type=int, default=PORT)
    args = parser.parse_args()
    worker(args) if args.worker else controller(args)


if __name__ == "__main__":
    main()
