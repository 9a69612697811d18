"""The training work every launcher runs, so each comparison times the same code: the MLP, the
first-step probe, the DDP step loop (torchrun) and the Horovod step loop (horovodrun and sparkdl's
horovod backend). Run as a module under torchrun/horovodrun: `python -m peers_parts.workloads --mode M`.
Imports only torch (and horovod in its mode): ranks must not pay for pyspark or sparkdl imports."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any


def mlp(features: int, hidden: int, classes: int) -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, classes))


def synthetic(rows: int, features: int, classes: int, seed: int) -> tuple[Any, Any]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return (torch.rand(rows, features, generator=generator),
            torch.randint(0, classes, (rows,), generator=generator))


def ddp_epochs(rank: int, rows_per_rank: int, features: int, hidden: int, classes: int, batch: int,
               epochs: int) -> list[dict[str, float]]:
    """torchrun's side of the step-time comparison: DDP over gloo, SGD, shuffled in-memory batches."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    x, y = synthetic(rows_per_rank, features, classes, seed=rank)
    model = DistributedDataParallel(mlp(features, hidden, classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()
    steps = rows_per_rank // batch
    out = []
    for epoch in range(epochs):
        order = torch.randperm(rows_per_rank, generator=torch.Generator().manual_seed(epoch))
        dist.barrier()
        started = time.perf_counter()
        for step in range(steps):
            index = order[step * batch:(step + 1) * batch]
            optimizer.zero_grad()
            loss_fn(model(x[index]), y[index]).backward()
            optimizer.step()
        out.append({"seconds": time.perf_counter() - started, "steps": steps})
    return out


def horovod_steps(features: int, hidden: int, classes: int, batch: int, steps: int, warmup: int) -> dict[str, Any]:
    """The Horovod training loop both launchers run unchanged: hvd.DistributedOptimizer, SGD, one
    fixed synthetic batch per rank. Returns the slowest rank's median step seconds (rank 0 reports)."""
    import horovod.torch as hvd
    import torch

    hvd.init()  # a no-op when sparkdl's horovod communicator already initialised it
    x, y = synthetic(batch, features, classes, seed=hvd.rank())
    model = mlp(features, hidden, classes)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    loss_fn = torch.nn.CrossEntropyLoss()
    times = []
    for step in range(warmup + steps):
        started = time.perf_counter()
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
        if step >= warmup:
            times.append(time.perf_counter() - started)
    mine = statistics.median(times)
    slowest = hvd.allreduce(torch.tensor([mine]), op=hvd.Max, name="peers.step_s").item()
    return {"step_s": slowest, "rank": hvd.rank(), "size": hvd.size(), "threads": torch.get_num_threads()}


def first_step(features: int, hidden: int, classes: int, batch: int) -> float:
    """One DDP step (forward, backward, gradient allreduce); returns the wall clock when it is done."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    x, y = synthetic(batch, features, classes, seed=dist.get_rank())
    model = DistributedDataParallel(mlp(features, hidden, classes))
    torch.nn.CrossEntropyLoss()(model(x), y).backward()
    return time.time()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["noop", "first_step", "ddp", "horovod"], required=True)
    parser.add_argument("--out", required=True, help="rank 0 writes its JSON result here")
    for name, default in (("features", 64), ("hidden", 512), ("classes", 10), ("batch", 256),
                          ("rows-per-rank", 20000), ("epochs", 3), ("steps", 50), ("warmup", 5)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    result: Any = {"entered": time.time()}
    if args.mode == "first_step":
        result["first_step_done"] = first_step(args.features, args.hidden, args.classes, args.batch)
        rank = int(os.environ.get("RANK", "0"))
    elif args.mode == "ddp":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        result["epochs"] = ddp_epochs(rank, args.rows_per_rank, args.features, args.hidden, args.classes,
                                      args.batch, args.epochs)
        import torch

        result["threads"] = torch.get_num_threads()
        dist.destroy_process_group()
    elif args.mode == "horovod":
        result.update(horovod_steps(args.features, args.hidden, args.classes, args.batch, args.steps, args.warmup))
        rank = result["rank"]
    else:
        rank = int(os.environ.get("RANK", os.environ.get("HOROVOD_RANK", "0")))
    if rank == 0:
        with open(args.out, "w") as fh:
            json.dump(result, fh)


if __name__ == "__main__":
    main()
