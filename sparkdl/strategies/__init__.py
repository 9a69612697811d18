"""strategies: how ranks train together, behind one interface (base.py: Strategy, `requires`),
one file per strategy, chosen by name (STRATEGIES): data_parallel.py (+ diloco.py, islands.py,
low_precision.py, quantize.py), hybrid.py (+ micro_batches.py, schedules.py), ist.py, sharded.py
(+ layer_shards.py), embedding_tables.py (sparse_cols: tables sharded, dense layers data parallel); inputs.py, stepping.py and lr_schedule.py around each optimizer step.
Runs on the executors. May import: errors, config, comm (only comm.base, never a backend), data,
model (docs/architecture.md, "Layering").
"""
from __future__ import annotations

from sparkdl.strategies.base import Strategy

STRATEGIES: dict[str, str] = {"data_parallel": "sparkdl.strategies.data_parallel:DataParallel",
                              "hybrid": "sparkdl.strategies.hybrid:Hybrid",
                              "ist": "sparkdl.strategies.ist:Ist",
                              "sharded": "sparkdl.strategies.sharded:Sharded",
                              "embeddings": "sparkdl.strategies.embedding_tables:ShardedEmbeddings"}


def strategy_class(name: str) -> type[Strategy]:
    import importlib

    from sparkdl.errors import ConfigError

    if name not in STRATEGIES:
        raise ConfigError(f"unknown train.strategy {name!r}", hint=f"choose one of {sorted(STRATEGIES)}")
    module_name, _, class_name = STRATEGIES[name].partition(":")
    return getattr(importlib.import_module(module_name), class_name)


__all__ = ["Strategy", "STRATEGIES", "strategy_class"]
