"""TrainSpec: the one picklable object that crosses from the driver to every executor task.

Everything a worker needs travels here as explicit values (never through env vars or closures
over driver state), so what a task ran with can be read off one object.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from sparkdl.config import RunConfig
from sparkdl.data.layout import FeedLayout

RESULT_SCHEMA = "rank int, kind string, seq int, payload binary"
RESULT_CHUNK_BYTES = 32 << 20  # keeps every Arrow cell far below Spark's 2 GiB limit


@dataclass(frozen=True)
class TrainSpec:
    run_id: str
    config: RunConfig
    layout: FeedLayout | None
    model: Any = None  # an nn.Module or a zero-argument callable returning one
    train_fn: Callable[[Any], Any] | None = None  # custom loop of sparkdl.run; None => built-in strategy
    channel: Any = None  # ChannelAddress of the driver channel, or None (no progress, no tracking)
    plan: Any = None  # the strategy's driver-side parameters (e.g. HybridLayout), None for data parallel

    @property
    def world_size(self) -> int:
        return self.config.launch.num_workers
