"""Rendezvous inside a barrier stage: every rank learns the world through one allGather.

Rank 0 picks a free port on its own host; hosts come from the barrier task infos, so ranks on the
same executor host get distinct local ranks. Never imports pyspark.sql (worker-side module).
"""
from __future__ import annotations

import json
import socket
from typing import Any, Protocol, Sequence

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
    rank = context.partitionId()
    executors = tuple(info.address for info in context.getTaskInfos())
    hosts = tuple(address.rsplit(":", 1)[0] for address in executors)
    port = (listening_port or free_port()) if rank == 0 else 0
    messages = [json.loads(m) for m in context.allGather(json.dumps({"rank": rank, "port": port}))]
    master_port = next(m["port"] for m in messages if m["rank"] == 0)
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
