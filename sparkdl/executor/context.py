"""WorkerContext: what every rank's loop (the built-in one or a custom `train_fn`) receives.

It is built complete by executor/worker.py, after the rendezvous, the row counts and (for batches
shared by speed) the shares have been agreed by every rank, and never changes afterwards: its step
arithmetic is `epoch_plan` over those agreed values (data/epochs.py, the rule's one home), so every
rank derives the same steps from the same inputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Iterator

from sparkdl.comm.base import Communicator, WorldInfo
from sparkdl.data.epochs import BatchOptions, EpochPlan, check_shards, epoch_plan
from sparkdl.wire.spec import TrainSpec

if TYPE_CHECKING:
    from sparkdl.data.batches import Spool
    from sparkdl.tracking.phases import Clock
    from sparkdl.executor.reporter import Reporter

__all__ = ["WorkerContext", "EpochPlan", "epoch_plan", "check_shards"]


@dataclass(frozen=True)
class WorkerContext:
    """`ctx` of `sparkdl.run(train_fn)`: rank, world, communicator, this rank's batches."""

    world: WorldInfo
    comm: Communicator
    spec: TrainSpec
    row_counts: tuple[int, ...] = ()  # every rank's shard, in rank order (the same on every rank)
    spool: "Spool | None" = None  # this rank's training rows, None without a DataFrame
    validation: "Spool | None" = None  # this rank's validation rows, None without validation data
    reporter: "Reporter | None" = None  # metrics and progress to the driver (rank 0)
    batch_shares: tuple[int, ...] | None = None  # rows per rank and step when shared by speed (executor.balance)
    # Receiving this rank's partition and spooling it before the loop started (0 when epoch 1 streams).
    spooled_first_seconds: float = 0.0
    task_started: float = 0.0  # time.perf_counter() when this rank's task began (for time_to_first_step_s)
    clock: "Clock | None" = None  # this task's phases so far (task_phases)

    @property
    def partition_seconds(self) -> float:
        """Receiving this rank's partition (and spooling it), from the task's start. When epoch 1
        streams while the partition arrives, this waits until the last row is in: read it after the
        first pass, or the rest of that pass comes from the spool instead of the stream."""
        seconds = getattr(self.spool, "seconds", None)
        return float(seconds) if seconds is not None else self.spooled_first_seconds

    @property
    def spool_seconds(self) -> float:
        """partition_seconds, under the name the first custom loops used."""
        return self.partition_seconds

    @property
    def task_phases(self) -> dict[str, float]:
        """Seconds of this task's phases so far (phases.Clock): imports, memory_reset, delivery (waiting
        for Spark's next Arrow batch), conversion, spool_write, space_check, rendezvous, communicator,
        agreement... Delivery, conversion and the spool writes run on the reader thread while epoch 1
        streams, so the phases need not add up to the task's wall time."""
        return self.clock.snapshot() if self.clock is not None else {}

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def world_size(self) -> int:
        return self.world.size

    @property
    def local_rank(self) -> int:
        return self.world.local_rank

    @property
    def device(self) -> Any:
        return self.comm.device

    @property
    def config(self) -> TrainSpec:
        """The run's options as a rank sees them: `ctx.config.data`, `.train`, `.launch`, `.tracking`
        (the sections a rank needs; input/output/model stay on the driver)."""
        return self.spec

    @property
    def num_rows(self) -> int:
        """Rows of this rank's shard."""
        return self.row_counts[self.rank] if self.row_counts else 0

    @cached_property
    def epoch(self) -> EpochPlan:
        """Steps and batch sizes of every epoch, the same on every rank."""
        return epoch_plan(self.row_counts, self.spec.data, self.batch_shares)

    @property
    def steps_per_epoch(self) -> int:
        return self.epoch.steps if self.row_counts else 0

    @property
    def has_validation(self) -> bool:
        return self.validation is not None

    @cached_property
    def assemble(self) -> Any:
        """Spool rows -> batches: transform_fn and the input_dtypes applied (data/assemble.py);
        `assemble.transform_seconds` sums the time spent in transform_fn on this rank."""
        from sparkdl.data.assemble import assembler

        data = self.spec.data
        return assembler(self.spec.layout, data.transform_fn, frozenset(data.input_dtypes or {}))

    def batches(self, epoch: int = 0, start: int = 0) -> Iterator[tuple[Any, ...]]:
        """This rank's shard as torch batches, the same step count on every rank: (features, labels)
        for feature_cols ((features, labels, weights) with weight_col), (inputs, label, weight) for
        input_cols (inputs a tuple, or a dict when input_cols is one). With transform_fn, batches
        are made data.prefetch_batches ahead on a background thread, so decoding overlaps the step.
        `start`: begin at that batch of the epoch (a resumed epoch; the earlier ones are not made)."""
        if self.spool is None:
            from sparkdl.errors import ConfigError

            raise ConfigError("ctx.batches() needs data, but this run has no DataFrame",
                              hint="pass df= to sparkdl.run")
        from sparkdl.data.assemble import prefetched

        data = self.spec.data
        batches = self.spool.epoch_batches(epoch, self.epoch, rank=self.rank, shuffle=data.shuffle,
                                           seed=self.spec.train.seed, assemble=self.assemble, start=start)
        return prefetched(batches, data.prefetch_batches) if data.transform_fn is not None else batches

    def validation_batches(self, batch_size: int = 1024) -> Iterator[tuple[Any, ...]]:
        """This rank's validation rows, in order, once (empty without validation data), shaped as
        `batches` shapes them. Ranks hold different numbers of rows: combine per-rank sums with one
        collective afterwards."""
        spool = self.validation
        if spool is None or spool.num_rows == 0:
            return iter(())
        # One in-order pass over this rank's rows alone: a plan of one shard, read as rank 0 of it.
        return spool.epoch_batches(0, epoch_plan([spool.num_rows], BatchOptions(batch_size)), rank=0, shuffle=False,
                                   seed=0, assemble=self.assemble)

    @property
    def transform_seconds(self) -> float:
        return float(getattr(self.assemble, "transform_seconds", 0.0))

