"""comm: the communicators that ranks exchange tensors through, on the executors.

Owns: base.py (the Communicator interface: allreduce, reduce_scatter, allgather_into, p2p, and the `ops`
each backend offers), torch_dist.py (torch.distributed gloo/NCCL), horovod.py, emulated.py (the
in-process network emulator), interfaces.py and reachability.py (which address peers dial).
Backends are chosen by name here (BACKENDS). May import: errors only; horovod loads lazily.
"""
from __future__ import annotations

from typing import Any, Callable

from sparkdl.comm.base import Communicator, WorldInfo

BACKENDS: dict[str, str] = {"torch": "sparkdl.comm.torch_dist:TorchDistCommunicator",
                            "horovod": "sparkdl.comm.horovod:HorovodCommunicator"}
BOOTSTRAPS_THROUGH_SPARK = {"horovod"}  # backends that exchange a port over the barrier's allGather


def backend_class(backend: str) -> type[Communicator]:
    """The backend's class; its module imports Horovod lazily, so reading `ops` needs no install."""
    import importlib

    from sparkdl.errors import ConfigError

    if backend not in BACKENDS:
        raise ConfigError(f"unknown launch.backend {backend!r}", hint=f"choose one of {sorted(BACKENDS)}")
    module_name, _, class_name = BACKENDS[backend].partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def create(backend: str, world: WorldInfo, timeout_s: float,
           exchange: Callable[[str], list[str]] | None = None, env: dict[str, str] | None = None,
           listening: Any = None) -> Communicator:
    """Import the backend lazily so `import sparkdl` never needs Horovod. `env`: the backend's own
    settings (launch.horovod_env); `listening`: rank 0's handle from the backend's listen()."""
    cls = backend_class(backend)
    if backend in BOOTSTRAPS_THROUGH_SPARK:
        return cls(world, timeout_s, exchange=exchange, env=env)
    if listening is not None:
        return cls(world, timeout_s, listening=listening)  # type: ignore[call-arg]
    return cls(world, timeout_s)


__all__ = ["Communicator", "WorldInfo", "create", "backend_class", "BACKENDS"]
