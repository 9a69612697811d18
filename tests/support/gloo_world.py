"""Run a function on W real gloo ranks (spawned processes on 127.0.0.1), without Spark.

`fn(comm, *args)` must be a module-level function (pickled by reference); its return value
(picklable, no torch tensors: they would be shared through file descriptors that die with the
process) comes back in rank order.
"""
from __future__ import annotations

import multiprocessing
import time
import traceback
from typing import Any, Callable

PORT_WAIT_S = 60.0


def _rank_main(rank: int, world: int, port: Any, fn: Callable[..., Any], args: tuple, queue: Any,
               executors: tuple[str, ...] = ()) -> None:
    import torch

    from sparkdl.comm.base import WorldInfo
    from sparkdl.comm.torch_dist import TorchDistCommunicator

    torch.set_num_threads(1)
    # Rank 0 listens on a port the OS assigns and shares it (as under Spark): a port picked free
    # beforehand could be taken by another process before gloo binds it (EADDRINUSE under load).
    listening = None
    if rank == 0:
        port.value, listening = TorchDistCommunicator.listen(60)
    deadline = time.monotonic() + PORT_WAIT_S
    while port.value == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    info = WorldInfo(rank=rank, size=world, local_rank=rank, local_size=world, hosts=("localhost",) * world,
                     master_addr="127.0.0.1", master_port=int(port.value), executors=executors)
    comm = TorchDistCommunicator(info, 60, listening=listening)
    try:
        queue.put((rank, fn(comm, *args), None))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, None, traceback.format_exc()))
    finally:
        comm.close()


# The ranks fork from a server process that imported torch and sparkdl's communicator once per test
# session, instead of each being a fresh interpreter importing torch (about 2 s of CPU a rank; the unit
# suite starts hundreds of ranks). As isolated as spawn: the server holds no state of any test; but
# ranks see the environment of the session's first world (pass settings as arguments, not os.environ).
PRELOAD = ["torch", "sparkdl.comm.torch_dist", "gloo_world"]


def rank_context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (the first world of the session)
    return ctx


def run_world(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0,
              executors: tuple[str, ...] = ()) -> list[Any]:
    """`executors`: each rank's executor address in its WorldInfo (what islands are declared by)."""
    ctx = rank_context()
    port = ctx.Value("i", 0)  # rank 0's store port, once it listens
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, fn, args, queue, executors)) for r in range(world)]
    for proc in procs:
        proc.start()
    try:
        results = sorted((queue.get(timeout=timeout) for _ in procs), key=lambda r: r[0])
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    errors = [f"rank {rank}:\n{error}" for rank, _, error in results if error]
    if errors:
        raise AssertionError("\n".join(errors))
    return [value for _, value, _ in results]
