"""Training strategies behind one interface (base.py); users choose by name."""
from __future__ import annotations

from sparkdl.strategies.base import Strategy

STRATEGIES: dict[str, str] = {"data_parallel": "sparkdl.strategies.data_parallel:DataParallel",
                              "hybrid": "sparkdl.strategies.hybrid:Hybrid",
                              "ist": "sparkdl.strategies.ist:Ist",
                              "sharded": "sparkdl.strategies.sharded:Sharded"}


def strategy_class(name: str) -> type[Strategy]:
    import importlib

    from sparkdl.errors import ConfigError

    if name not in STRATEGIES:
        raise ConfigError(f"unknown train.strategy {name!r}", hint=f"choose one of {sorted(STRATEGIES)}")
    module_name, _, class_name = STRATEGIES[name].partition(":")
    return getattr(importlib.import_module(module_name), class_name)


__all__ = ["Strategy", "STRATEGIES", "strategy_class"]
