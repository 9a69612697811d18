"""torch.distributed backend: gloo on CPU, NCCL when the task owns GPUs; finite timeouts always."""
from __future__ import annotations

import datetime
import os
import socket
from typing import Any, Sequence

import torch
import torch.distributed as dist

from sparkdl.comm.base import (ALL_TO_ALL, ALLGATHER, ALLREDUCE, BARRIER, BROADCAST, SEND_RECV, SUBGROUP,
                               Communicator, PendingReduce, Work, WorldInfo)
from sparkdl.comm.interfaces import (GLOO_INTERFACE_ENV, check_not_loopback_across_hosts, gloo_interface_env,
                                     interface_of, resolved, restore_environment, set_environment, spans_hosts)
from sparkdl.comm.reachability import PROBE_DEADLINE_S, PeerProbe, dial_one, dial_peers
from sparkdl.errors import ConfigError

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def cuda_index(address: str) -> int:
    """Spark's GPU address is a physical index; when the cluster manager already narrowed
    CUDA_VISIBLE_DEVICES, torch numbers the visible devices from 0."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if address in visible:
        return visible.index(address)
    return int(address)


def _start_allreduce(tensor: torch.Tensor, op: str, size: int, group: Any = None) -> PendingReduce:
    """dist.all_reduce(async_op=True): gloo runs it on its own threads, NCCL on its stream."""
    if op not in _REDUCE_OPS and op != "avg":
        raise ConfigError(f"allreduce op {op!r} is not supported", hint="use sum, avg, max or min")
    work = dist.all_reduce(tensor, op=_REDUCE_OPS.get(op, dist.ReduceOp.SUM), group=group, async_op=True)
    return PendingReduce(tensor, work, (lambda done: done.div_(size)) if op == "avg" else None)


def store_bind_address(own_address: str) -> str:
    """Where rank 0's TCPStore listens: the executor's own address when an interface here holds it
    (the address its peers dial: nothing else on the host need hear it), else every interface (""
    : an address behind a NAT or proxy, or none given)."""
    return resolved(own_address) if own_address and interface_of(own_address) is not None else ""


def store_server(bind: str, port: int, timeout: datetime.timedelta) -> Any:
    """A TCPStore server on a socket sparkdl bound: TCPStore's own server listens on every interface
    whatever host name it is given; handed a listening descriptor it serves that one. It gets a
    duplicate it owns; ours is closed here whatever happens (no double close of a reused number)."""
    if bind:
        listener = socket.create_server((bind, port), backlog=1024)
    elif socket.has_dualstack_ipv6():  # every interface, IPv6 clusters included (as TCPStore's own)
        listener = socket.create_server(("", port), family=socket.AF_INET6, backlog=1024, dualstack_ipv6=True)
    else:
        listener = socket.create_server(("", port), backlog=1024)
    with listener:
        return dist.TCPStore(bind or "localhost", int(listener.getsockname()[1]), None, True, timeout=timeout,
                             wait_for_workers=False, master_listen_fd=os.dup(listener.fileno()), use_libuv=True)


def _store_gather(store: Any, world: WorldInfo, key: str, value: str, timeout: datetime.timedelta) -> list[str]:
    """Every rank's `value`, in rank order, through the group's store."""
    store.set(f"{key}/{world.rank}", value)
    keys = [f"{key}/{rank}" for rank in range(world.size)]
    store.wait(keys, timeout)
    return [store.get(k).decode() for k in keys]


class TorchDistCommunicator(Communicator):
    ops = frozenset({ALLREDUCE, BROADCAST, ALLGATHER, BARRIER, SEND_RECV, SUBGROUP, ALL_TO_ALL})
    listens = True

    @classmethod
    def listen(cls, timeout_s: float, own_address: str = "") -> tuple[int, Any]:
        """A TCPStore server on a port the OS picks, opened before the rendezvous: a rank that
        connected before rank 0 listened waited for the store client's 1 s retry (one second of
        every fit's start on this machine), and the free port picked beforehand could be taken."""
        store = store_server(store_bind_address(own_address), 0, datetime.timedelta(seconds=timeout_s))
        return int(store.port), store

    def __init__(self, world: WorldInfo, timeout_s: float, listening: Any = None) -> None:
        super().__init__(world)
        self._timeout_s = timeout_s
        self._use_gpu = bool(world.gpus) and torch.cuda.is_available()
        # With GPUs, small CPU tensors (row counts, objects) still need a CPU backend beside NCCL.
        backend = "cpu:gloo,cuda:nccl" if self._use_gpu else "gloo"
        if self._use_gpu:
            torch.cuda.set_device(self.device)
        if dist.is_initialized():
            # A reused Python worker may still hold the group of a task that died mid-run.
            dist.destroy_process_group()
        timeout = datetime.timedelta(seconds=timeout_s)
        own = world.hosts[world.rank] if world.hosts else "127.0.0.1"
        # gloo binds the interface of the executor's own address, not what the host name resolves to.
        self._saved_env = set_environment(gloo_interface_env(own))
        self._probe: PeerProbe | None = None
        try:
            check_not_loopback_across_hosts(own, world.hosts, world.rank, GLOO_INTERFACE_ENV)
            if world.rank != 0:
                # Rank 0's store may not listen yet (it listens before the rendezvous under Spark, not
                # in every caller): refused is retried until the deadline, unreachable is named then.
                dial_one(world.rank, own, 0, f"{world.master_addr}:{world.master_port}",
                         min(timeout_s, PROBE_DEADLINE_S), wait_for_listener=True)
            # Rank 0 serves the store it opened in listen(); the others connect to it. Kept alive with
            # the group (the store must outlive it).
            if world.rank == 0:
                self._store = listening if listening is not None else \
                    store_server(store_bind_address(own), world.master_port, timeout)
            else:
                self._store = dist.TCPStore(world.master_addr, world.master_port, world.size, False, timeout=timeout)
            if spans_hosts(world.hosts):
                self._probe = PeerProbe(own)
                endpoints = _store_gather(self._store, world, "sparkdl/probe", self._probe.address, timeout)
                dial_peers(world.rank, own, endpoints, min(timeout_s, PROBE_DEADLINE_S))
            dist.init_process_group(backend=backend, store=self._store, rank=world.rank, world_size=world.size,
                                    timeout=timeout)
        except BaseException:
            self._release_network()
            raise

    @property
    def device(self) -> torch.device:
        if self._use_gpu:
            return torch.device("cuda", cuda_index(self.world.gpus[0]))
        return torch.device("cpu")

    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self._count_allreduce(tensor.numel() * tensor.element_size())
        if op == "avg":
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            tensor.div_(self.size)
            return tensor
        if op not in _REDUCE_OPS:
            raise ConfigError(f"allreduce op {op!r} is not supported", hint="use sum, avg, max or min")
        dist.all_reduce(tensor, op=_REDUCE_OPS[op])
        return tensor

    overlaps_allreduce = True

    def allreduce_async(self, tensor: torch.Tensor, op: str = "sum") -> PendingReduce:
        self._count_allreduce(tensor.numel() * tensor.element_size())
        return _start_allreduce(tensor, op, self.size)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        self._count_broadcast(tensor.numel() * tensor.element_size(), src)
        dist.broadcast(tensor, src=src)
        return tensor

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self._count_allgather(tensor.numel() * tensor.element_size())
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(out, tensor.contiguous())
        return out

    def barrier(self) -> None:
        dist.barrier()

    def reduce_scatter(self, tensor: torch.Tensor, op: str = "avg") -> torch.Tensor:
        if not self._use_gpu:
            # gloo's reduce-scatter keeps 7-12x the buffer resident (measured on 4 MB buffers, 4 ranks),
            # which is what sharding is there to save: an allreduce in place (twice the bytes) holds none.
            return super().reduce_scatter(tensor, op)
        self._charge((self.size - 1) * tensor.numel() * tensor.element_size() // self.size)
        out = torch.empty(tensor.numel() // self.size, dtype=tensor.dtype, device=tensor.device)
        collective = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)  # the torch 2.13 name first
        collective(out, tensor.contiguous(), op=dist.ReduceOp.SUM)
        if op == "avg":
            out.div_(self.size)
        elif op != "sum":
            raise ConfigError(f"reduce_scatter op {op!r} is not supported", hint="use sum or avg")
        return out

    def allgather_into(self, shard: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        self._count_allgather(shard.numel() * shard.element_size())
        if out is None:
            out = torch.empty(shard.numel() * self.size, dtype=shard.dtype, device=shard.device)
        if self._use_gpu:
            getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, shard.contiguous())
            return out
        # gloo: one broadcast per rank straight into `out` (the same bytes); its all-gather left a rank
        # 20-40 MB more resident in a sharded step of 4 MB layers.
        count = shard.numel()
        for src in range(self.size):
            block = out[src * count: (src + 1) * count]
            if src == self.rank:
                block.copy_(shard)
            dist.broadcast(block, src=src)
        return out

    def all_to_all(self, tensor: torch.Tensor, send_rows: Sequence[int], recv_rows: Sequence[int]) -> torch.Tensor:
        # gloo (torch 2.13) runs all_to_all_single with uneven splits on CPU tensors; NCCL on GPUs.
        row_bytes = tensor.shape[1:].numel() * tensor.element_size()
        self._charge(row_bytes * (sum(send_rows) - send_rows[self.rank]))
        out = torch.empty((sum(recv_rows), *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        dist.all_to_all_single(out, tensor.contiguous(), output_split_sizes=list(recv_rows),
                               input_split_sizes=list(send_rows))
        return out

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        self._count_send(tensor.numel() * tensor.element_size())
        return dist.isend(tensor.contiguous(), dst=dst, tag=tag)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        return dist.irecv(tensor, src=src, tag=tag)

    def split(self, groups: Sequence[Sequence[int]]) -> "TorchGroupCommunicator | None":
        mine = None
        for ranks in groups:
            ranks = sorted(int(r) for r in ranks)
            # torch requires every rank to create every group, in the same order.
            handle = dist.new_group(ranks=ranks, timeout=datetime.timedelta(seconds=self._timeout_s))
            if self.rank in ranks:
                mine = TorchGroupCommunicator(self, handle, ranks)
        return mine

    def close(self) -> None:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        finally:
            self._release_network()

    def _release_network(self) -> None:
        """Undo this rank's network settings (Spark reuses the Python worker for later tasks)."""
        if getattr(self, "_probe", None) is not None:
            self._probe.close()
            self._probe = None
        restore_environment(getattr(self, "_saved_env", {}))
        self._saved_env = {}

    def alive(self) -> bool:
        return dist.is_initialized()


class TorchGroupCommunicator(Communicator):
    """Collectives over a subset of the ranks (one torch process group). Ranks given to and taken
    from its methods are group-local; the bytes it sends are charged to the parent as well."""

    ops = frozenset({ALLREDUCE, BROADCAST, ALLGATHER, BARRIER, SEND_RECV})

    def __init__(self, parent: TorchDistCommunicator, handle: Any, ranks: Sequence[int]) -> None:
        super().__init__(parent.world)
        self._parent = parent
        self._group = handle
        self.ranks = tuple(ranks)  # global rank of each group-local rank

    @property
    def rank(self) -> int:
        return self.ranks.index(self._parent.rank)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def device(self) -> torch.device:
        return self._parent.device

    def _charge(self, nbytes: int) -> None:
        super()._charge(nbytes)
        self._parent._charge(nbytes)  # noqa: SLF001 - same module family

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        self._count_send(tensor.numel() * tensor.element_size())
        return dist.isend(tensor.contiguous(), dst=self.ranks[dst], group=self._group, tag=tag)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        return dist.irecv(tensor, src=self.ranks[src], group=self._group, tag=tag)

    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.size == 1:
            return tensor
        self._count_allreduce(tensor.numel() * tensor.element_size())
        if op == "avg":
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self._group)
            tensor.div_(self.size)
            return tensor
        if op not in _REDUCE_OPS:
            raise ConfigError(f"allreduce op {op!r} is not supported", hint="use sum, avg, max or min")
        dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=self._group)
        return tensor

    overlaps_allreduce = True

    def allreduce_async(self, tensor: torch.Tensor, op: str = "sum") -> PendingReduce:
        if self.size == 1:
            return PendingReduce(tensor)
        self._count_allreduce(tensor.numel() * tensor.element_size())
        return _start_allreduce(tensor, op, self.size, self._group)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.size == 1:
            return tensor
        self._count_broadcast(tensor.numel() * tensor.element_size(), src)
        dist.broadcast(tensor, src=self.ranks[src], group=self._group)
        return tensor

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        if self.size == 1:
            return [tensor.clone()]
        self._count_allgather(tensor.numel() * tensor.element_size())
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(out, tensor.contiguous(), group=self._group)
        return out

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self._group)

    def close(self) -> None:
        """The parent's destroy_process_group releases every group."""
