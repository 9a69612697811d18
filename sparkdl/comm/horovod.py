"""Horovod backend: ring allreduce with horovod.torch inside Spark barrier tasks, no horovodrun.

Rank 0 starts Horovod's own gloo RendezvousServer with a slot plan built from the ranks' hosts (so
Horovod's rank equals sparkdl's rank, and local/cross ranks are right when ranks share a host);
the port reaches the other ranks through the barrier's allGather. HOROVOD_* variables are set only
in this worker process, for the third-party contract. Horovod is imported lazily: `import sparkdl`
never needs it.
"""
from __future__ import annotations

import json
import os
import socket
from typing import Any, Callable

import torch

from sparkdl.comm.base import ALLGATHER, ALLREDUCE, BARRIER, BROADCAST, Communicator, WorldInfo
from sparkdl.comm.horovod_env import horovod_variables, start_rendezvous
from sparkdl.comm.interfaces import is_loopback, resolved, spans_hosts
from sparkdl.errors import ConfigError

INSTALL_HINT = "make horovod   (builds horovod 0.28.1 for this torch; see scripts/build_horovod.sh)"


def import_horovod() -> Any:
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        raise ConfigError(f"launch.backend='horovod' needs Horovod, which cannot be imported here ({exc})",
                          hint=f"install it with: {INSTALL_HINT}") from None
    return hvd


def check_horovod_can_bind(own_address: str, hosts: "tuple[str, ...]", rank: int) -> None:
    """Horovod 0.28 builds each process set's gloo device (the global set included) from the host
    name alone: HOROVOD_GLOO_IFACE reaches only its first context. Where the host name resolves to
    loopback and the ranks span hosts, that connection cannot work; say so before training."""
    if not spans_hosts(hosts):
        return
    name = socket.gethostname()
    if is_loopback(name):
        raise ConfigError(f"rank {rank} on host {name!r}: the host name resolves to {resolved(name)}, and Horovod's "
                          f"process-set connection binds to whatever the host name resolves to (HOROVOD_GLOO_IFACE "
                          f"does not reach it), so ranks on other hosts would dial their own loopback",
                          hint=f"make {name!r} resolve to this host's address {own_address} on every worker host "
                               f"(an /etc/hosts line '{own_address} {name}'), or use backend='torch', which binds the "
                               "executor's own interface")


class HorovodCommunicator(Communicator):
    ops = frozenset({ALLREDUCE, BROADCAST, ALLGATHER, BARRIER})  # no send/recv: hybrid needs torch

    def __init__(self, world: WorldInfo, timeout_s: float,
                 exchange: Callable[[str], list[str]] | None = None, env: dict[str, str] | None = None) -> None:
        """`env`: launch.horovod_env, HOROVOD_* tuning settings (fusion threshold, cycle time, ...)
        applied before hvd.init(): a train_fn setting os.environ would be too late."""
        super().__init__(world)
        if exchange is None:
            raise ConfigError("the horovod backend needs the barrier allGather to bootstrap",
                              hint="create it through sparkdl.comm.create inside a barrier task")
        user_env = env
        self.hvd = import_horovod()
        check_horovod_can_bind(world.hosts[world.rank], world.hosts, world.rank)
        self._server: Any = None
        port = 0
        if world.rank == 0:
            self._server, port = start_rendezvous(world.hosts)
        ports = [json.loads(m) for m in exchange(json.dumps({"rank": world.rank, "port": port}))]
        port = next(m["port"] for m in ports if m["rank"] == 0)
        env = horovod_variables(world.hosts, world.rank, world.master_addr, port, timeout_s, user_env)
        self._use_gpu = bool(world.gpus) and torch.cuda.is_available()
        if self._use_gpu:
            from sparkdl.comm.torch_dist import cuda_index

            torch.cuda.set_device(cuda_index(world.gpus[0]))
        # Python workers are reused by later tasks: the HOROVOD_* contract is undone in close().
        self._saved_env = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        self.hvd.init()

    @property
    def device(self) -> torch.device:
        if self._use_gpu:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        ops = {"sum": self.hvd.Sum, "avg": self.hvd.Average, "max": self.hvd.Max, "min": self.hvd.Min}
        if op not in ops:
            raise ConfigError(f"allreduce op {op!r} is not supported", hint="use sum, avg, max or min")
        self._count_allreduce(tensor.numel() * tensor.element_size())
        return self.hvd.allreduce_(tensor, op=ops[op])

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        self._count_broadcast(tensor.numel() * tensor.element_size(), src)
        return self.hvd.broadcast_(tensor, root_rank=src)

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self._count_allgather(tensor.numel() * tensor.element_size())
        # Horovod concatenates along dim 0: a leading axis of 1 keeps the ranks apart.
        gathered = self.hvd.allgather(tensor.contiguous().unsqueeze(0))
        return list(gathered.unbind(0))

    def barrier(self) -> None:
        self.hvd.barrier()

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> torch.optim.Optimizer:
        """Horovod's own DistributedOptimizer (gradient averaging overlapped with backward)."""
        self.hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        return self.hvd.DistributedOptimizer(optimizer, named_parameters=module.named_parameters(),
                                             op=self.hvd.Average)

    def alive(self) -> bool:
        return bool(self.hvd.is_initialized())

    def close(self) -> None:
        try:
            self.hvd.shutdown()
        finally:
            if self._server is not None:
                self._server.stop()
                self._server = None
            for key, value in getattr(self, "_saved_env", {}).items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            self._saved_env = {}
