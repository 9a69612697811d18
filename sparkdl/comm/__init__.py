"""Communicators: one small interface (base.py), one file per backend, chosen by name."""
from __future__ import annotations

from sparkdl.comm.base import Communicator, WorldInfo

BACKENDS: dict[str, str] = {"torch": "sparkdl.comm.torch_dist:TorchDistCommunicator"}


def create(backend: str, world: WorldInfo, timeout_s: float) -> Communicator:
    """Import the backend lazily so `import sparkdl` never needs Horovod."""
    import importlib

    from sparkdl.errors import ConfigError

    if backend not in BACKENDS:
        raise ConfigError(f"unknown launch.backend {backend!r}", hint=f"choose one of {sorted(BACKENDS)}")
    module_name, _, class_name = BACKENDS[backend].partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(world, timeout_s)


__all__ = ["Communicator", "WorldInfo", "create", "BACKENDS"]
