"""TrainSpec: the one picklable object that crosses from the driver to every executor task.

Everything a worker needs travels here as explicit values (never through env vars or closures
over driver state), so what a task ran with can be read off one object.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence, Union

from sparkdl.config import DataConfig, LaunchConfig, TrackingConfig, TrainConfig
from sparkdl.data.layout import FeedLayout
from sparkdl.data.parquet_shards import ParquetShards
from sparkdl.model.layouts import StrategyLayout
from sparkdl.wire.child import ChildCall
from sparkdl.wire.frames import ChannelAddress
from sparkdl.wire.model_transfer import ModelSink
from sparkdl.wire.replan import ReplanFigures

if TYPE_CHECKING:
    import torch

    from sparkdl.executor.context import WorkerContext

# What a user passes as the model: a module (copied), a zero-argument factory, or one factory per
# top-level layer (model/layer_factories.py); torch types are named as strings: this module imports no torch.
ModelSpec = Union["torch.nn.Module", Callable[[], "torch.nn.Module"], Sequence[Callable[[], "torch.nn.Module"]], None]


@dataclass(frozen=True)
class TrainSpec:
    run_id: str
    # The config sections a rank reads (never the whole RunConfig: input/output/model stay on the driver).
    data: DataConfig
    train: TrainConfig  # final: the resolved plan's strategy options merged in; callbacks stay on the driver
    launch: LaunchConfig
    tracking: TrackingConfig
    layout: FeedLayout | None  # how the prepared Arrow batches are laid out; None without a DataFrame
    model: ModelSpec = None  # the built-in loop's model; None with a custom train_fn
    train_fn: Callable[["WorkerContext"], Any] | None = None  # custom loop of sparkdl.run; None => built-in strategy
    channel: ChannelAddress | None = None  # the driver channel, or None (no progress, no tracking)
    strategy_layout: StrategyLayout = None  # HybridLayout / IstLayout from the resolved plan; None: data parallel
    driver_callbacks: bool = False  # train.callbacks run on the driver: rank 0 waits for their verdict every epoch
    rows: int = 0  # training + validation rows over all ranks, as the driver counted them (0: not counted)
    # Every rank's training rows, counted by the driver (data/shards.py): the built-in loop then trains
    # epoch 1 while its partition streams in. Empty: each rank spools its partition first and counts it.
    row_counts: tuple[int, ...] = ()
    # Direct Parquet delivery: the pieces every rank reads itself (the job's own input is one placeholder row).
    source: ParquetShards | None = None
    packed_rows: bool = False  # the job's rows are blocks of rows packed on the JVM (data/packed_delivery.py)
    # Where each rank sends its part of the trained model (wire/model_transfer.ModelSink); set per attempt.
    model_sink: ModelSink | None = None
    # sparkdl.compat: every rank runs this function or script in child processes (executor/child_rank.py)
    # instead of train_fn(ctx) or the built-in loop.
    child: ChildCall | None = None
    # strategy="auto" chose data parallel: the predictions a rank compares its measured steps with, and
    # the DiLoCo alternative it may switch to at an epoch boundary (executor/replan.py). None: no re-plan.
    replan: ReplanFigures | None = None
    # Each executor's cores as the driver's conf says (spark/session.executor_cores; set at submission):
    # a rank's share of them is its torch threads when more than spark.task.cpus (executor/threads.py).
    executor_cores: int | None = None

    @property
    def world_size(self) -> int:
        return self.launch.num_workers
