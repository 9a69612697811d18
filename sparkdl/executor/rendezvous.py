"""Rendezvous inside a barrier stage: every rank learns the world through one allGather (or, for a
backend that listens first, rank 0's port from the driver channel while the allGather runs).

Rank 0 picks a free port on its own host; hosts come from the barrier task infos, so ranks on the
same executor host get distinct local ranks. Never imports pyspark.sql (worker-side module).
"""
from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Protocol, Sequence

from sparkdl.comm.base import WorldInfo


class BarrierContext(Protocol):
    def partitionId(self) -> int: ...
    def allGather(self, message: str = "") -> list[str]: ...
    def getTaskInfos(self) -> list[Any]: ...
    def resources(self) -> dict[str, Any]: ...


def free_port(host: str = "") -> int:
    """A port the OS says is free now; the tiny race until gloo binds it is accepted."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def local_ranks(hosts: Sequence[str], rank: int) -> tuple[int, int]:
    """(local_rank, local_size): position of `rank` among the ranks sharing its host."""
    same_host = [r for r, h in enumerate(hosts) if h == hosts[rank]]
    return same_host.index(rank), len(same_host)


def task_gpus(context: BarrierContext) -> tuple[str, ...]:
    resources = context.resources() or {}
    gpu = resources.get("gpu")
    return tuple(gpu.addresses) if gpu is not None else ()


def rendezvous(context: BarrierContext, listening_port: int = 0) -> WorldInfo:
    """`listening_port`: rank 0's port when its backend already listens there (Communicator.listen);
    0: rank 0 announces a free port, which its backend binds after the rendezvous."""
    port = (listening_port or free_port()) if context.partitionId() == 0 else 0
    return _world(context, _gathered_port(context.allGather(_message(context, port))))


def rendezvous_through_driver(context: BarrierContext, listening_port: int, client: Any,
                              poll_s: float = 0.005) -> tuple[WorldInfo, threading.Thread]:
    """The rendezvous without waiting for Spark's barrier: rank 0 (already listening) tells the
    driver channel its port, the others ask the driver for it. Spark's allGather still runs, on a
    thread, on every rank: a rank whose channel is down takes the port from it, and the barrier
    completes for everyone, so no rank can hang in it. Join the returned thread before the task
    makes any other Spark barrier call (two at once on one task break Spark's barrier epochs);
    it need not be joined before the task ends (the barrier is complete once every rank called it).

    Why: Spark's BarrierTaskContext waits for a barrier with Thread.sleep(1000) between checks, so
    a rank waiting in allGather returns up to a second after the last rank arrived (every fit's start)."""
    rank, key = context.partitionId(), _barrier_key(context)
    gathered: list[int] = []
    port = listening_port if rank == 0 else 0
    thread = threading.Thread(target=lambda: gathered.append(_gathered_port(context.allGather(_message(context, port)))),
                              name="sparkdl-rendezvous", daemon=True)
    thread.start()
    if rank == 0:
        if client is not None:
            client.send("rendezvous", key=key, port=port)
        return _world(context, port), thread
    while thread.is_alive() and client is not None and not client.failed:
        reply = client.request("rendezvous", timeout=1.0, key=key)
        if reply and reply.get("port"):
            return _world(context, int(reply["port"])), thread
        time.sleep(poll_s)
    thread.join()
    return _world(context, gathered[0]), thread


@contextmanager
def spark_barriers_after(context: Any, gathering: threading.Thread | None) -> Iterator[None]:
    """While a custom loop runs: its own calls of Spark's barrier() or allGather() (say, to exchange
    an address, or through a library that bootstraps over them) first wait for the rendezvous's
    allGather, which may still be returning on its thread (rendezvous_through_driver); two barrier
    calls at once on one task break Spark's barrier epochs. The loop gets the same context object
    from BarrierTaskContext.get(), so the wait is set on that object, and removed afterwards."""
    if gathering is None:
        yield
        return
    wrapped = []
    for name in ("barrier", "allGather"):
        original = getattr(context, name, None)
        if original is None:
            continue

        def after_rendezvous(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            gathering.join()
            return _original(*args, **kwargs)

        try:
            setattr(context, name, after_rendezvous)
        except AttributeError:  # a context that takes no attributes: join now instead
            gathering.join()
            break
        wrapped.append(name)
    try:
        yield
    finally:
        for name in wrapped:
            delattr(context, name)


def _barrier_key(context: BarrierContext) -> str:
    """This stage attempt (a resubmitted job or a retried stage is a new one): ports never leak across."""
    stage = getattr(context, "stageId", lambda: 0)()
    attempt = getattr(context, "stageAttemptNumber", lambda: 0)()
    return f"{stage}.{attempt}"


def _message(context: BarrierContext, port: int) -> str:
    return json.dumps({"rank": context.partitionId(), "port": port})


def _gathered_port(messages: list[str]) -> int:
    return int(next(m["port"] for m in map(json.loads, messages) if m["rank"] == 0))


def _world(context: BarrierContext, master_port: int) -> WorldInfo:
    rank = context.partitionId()
    executors = tuple(info.address for info in context.getTaskInfos())
    hosts = tuple(address.rsplit(":", 1)[0] for address in executors)
    local_rank, local_size = local_ranks(hosts, rank)
    return WorldInfo(
        rank=rank,
        size=len(hosts),
        local_rank=local_rank,
        local_size=local_size,
        hosts=hosts,
        master_addr=hosts[0],
        master_port=int(master_port),
        gpus=task_gpus(context),
        executors=executors,
    )
