"""Strategy interface: how one rank's model trains and stays consistent with its peers."""
from __future__ import annotations

import abc
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Iterable, Sequence

import torch
from torch import nn

from sparkdl.comm.base import Communicator
from sparkdl.config import TrainConfig
from sparkdl.model.layouts import StrategyLayout
from sparkdl.model.trained_state import load_trained_state, trained_state
from sparkdl.model.calling import loss_input, primary_output, scored_labels
from sparkdl.strategies.inputs import Inputs, call_model, to_device, weighted_terms
from sparkdl.strategies.stepping import SINGLE, Accumulation, OptimizerSteps, ScheduleFactory, float_output

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


class Strategy(abc.ABC):
    """`requires` names the communicator ops the strategy uses; planning checks them against the
    backend's `ops` so an impossible pairing fails before any job starts."""

    name: str = ""
    requires: frozenset[str] = frozenset()
    # executor/pace.py names a rank much slower than the median of the ranks doing its work.
    def peer_groups(self) -> list[list[int]]:
        """Groups of ranks doing the same work per row, whose speeds are compared with each other:
        every rank (pipelines: each stage's replicas)."""
        return [list(range(self.comm.size))]

    def __init__(self, comm: Communicator, layout: StrategyLayout = None, train: TrainConfig | None = None, *,
                 loss_weight: float = 1.0, compute_speed: float = 1.0, schedule: ScheduleFactory | None = None
                 ) -> None:
        """`layout`: the strategy's own frozen parameters worked out on the driver (stage cuts, IST
        layers; None for data parallel); `train`: the run's training options (sync mode, gradient
        clipping, precision, ...); `loss_weight`: factor on this rank's loss when batches are shared
        by speed (executor/balance.py); `compute_speed`: launch.emulate_speed, < 1 stretches this
        rank's compute; `schedule`: optimizer -> lr scheduler (strategies/lr_schedule.py), stepped
        once per optimizer step."""
        self.comm = comm
        self.layout = layout
        self.train = train or TrainConfig()
        self.loss_weight = float(loss_weight)
        self.compute_speed = float(compute_speed)
        self.steps = OptimizerSteps(self.train, comm.device, schedule)

    def place(self, executors: Sequence[str]) -> str | None:
        """Fit the layout to the executors this job's ranks got (rank r on executors[r]) before
        setup; returns a line to tell the user when that changed anything, else None."""
        return None

    def epoch_record(self) -> dict[str, Any]:
        """Facts about the layout worth keeping in every epoch's history record."""
        return {}

    def layers_to_build(self) -> Sequence[int] | None:
        """The top-level layers this rank trains, when the model is built layer by layer
        (model/layer_factories.py): the others are never built here. None: all of them."""
        return None

    # True: given layer factories, setup receives a LazyLayers and makes each layer real itself.
    builds_layer_by_layer = False

    def model_building(self) -> ContextManager[Any]:
        """Entered while this rank builds the model (embeddings: its tables stay meta tensors)."""
        return nullcontext()

    def slow_down(self, since: float) -> None:
        """Emulate a slower rank: stretch the compute done since `since` (perf_counter) to 1/speed."""
        if self.compute_speed < 1.0:
            import time

            time.sleep((time.perf_counter() - since) * (1.0 / self.compute_speed - 1.0))

    def finish(self) -> None:
        """Called once after the last step (before the last validation): strategies that synchronise
        every few steps write their last partial round back, so the result holds every step."""

    @abc.abstractmethod
    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory, loss_fn: LossFn) -> None:
        """Place the model, make every rank start from identical weights, build the optimizer."""

    @abc.abstractmethod
    def train_step(self, inputs: Inputs, labels: torch.Tensor, weights: torch.Tensor | None = None,
                   micro: Accumulation = SINGLE) -> torch.Tensor:
        """One micro-batch on this rank's batch; returns the local loss (a detached scalar).
        `inputs`: one tensor, a tuple or a dict of tensors (strategies/inputs.py); `weights`: per-row
        weights (weight_col) or None; `micro`: its place in the accumulation window: gradients are
        zeroed on the first, communicated and stepped on the last."""

    def learning_rate(self) -> float:
        """The current learning rate of the (first) optimizer, for metrics."""
        optimizer = getattr(self, "_optimizer", None)
        return float(optimizer.param_groups[0]["lr"]) if optimizer is not None else 0.0

    def end_epoch(self) -> None:
        """Hook for strategies that synchronise at epoch ends."""

    def loss_rows(self, rows: int) -> int:
        """Rows the loss returned by train_step averages over, for a batch of `rows` rows here
        (0 on ranks that compute no loss), so epoch losses weight every rank correctly."""
        return rows

    def epoch_metrics(self) -> dict[str, float]:
        """Per-rank figures the loop reports as their maximum over ranks (`max_<name>_per_rank`)."""
        return {"param_bytes": float(sum(p.numel() * p.element_size() for p in self.module().parameters()))}

    def evaluate(self, batches: Iterable[tuple[Inputs, torch.Tensor, torch.Tensor | None]], loss_fn: LossFn,
                 classification: bool, metrics: Any = None) -> torch.Tensor:
        """(loss sum, correct predictions, loss denominator, labels counted) over this rank's
        validation batches of (inputs, labels, weights), float64: the denominator is rows (or the
        weight sum); labels counted are rows (or positions not ignored, for per-position labels).
        `metrics` (executor/validation.py's MetricSums) also sees every batch's outputs. Every rank
        calls it (strategies may run collectives inside); the loop sums over ranks."""
        device = self.comm.device
        module = self.module()
        sums = torch.zeros(4, dtype=torch.float64)
        was_training = module.training
        module.eval()
        with torch.no_grad():
            for inputs, labels, weights in map(as_triple, batches):
                labels = labels.to(device)
                with self.steps.autocast():
                    output = call_model(module, to_device(inputs, device))
                sums += evaluation_sums(output, labels, None if weights is None else weights.to(device), loss_fn,
                                        classification)
                if metrics is not None:
                    metrics.add(float_output(primary_output(output)), scored_labels(loss_fn, labels))
        module.train(was_training)
        return sums

    @abc.abstractmethod
    def module(self) -> nn.Module:
        """The model this rank trains (the whole model, or this rank's part of it)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The trained state (model/trained_state.py): frozen parameters are never checkpointed or returned."""
        return trained_state(self.module())

    # Every rank holds the same training state (data parallel with allreduce): only rank 0's is saved.
    replicated_state = False

    def checkpoint_state(self) -> dict[str, Any]:
        """Everything this rank needs to continue training exactly: tensors and plain values only
        (checkpoints are read with torch.load(weights_only=True))."""
        state: dict[str, Any] = {"module": self.state_dict(), "steps": self.steps.state_dict()}
        optimizer = getattr(self, "_optimizer", None)
        if optimizer is not None:
            state["optimizer"] = optimizer.state_dict()
        return state

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        load_trained_state(self.module(), state["module"])
        if "optimizer" in state:
            self._optimizer.load_state_dict(state["optimizer"])  # type: ignore[attr-defined]
        self.steps.load_state_dict(state.get("steps", {}))

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of the weights validation measures (early stopping's best epoch)."""
        return {k: v.clone() for k, v in self.state_dict().items()}

    def restore(self, snapshot: dict[str, torch.Tensor]) -> None:
        """Put a snapshot back (after the last step: the result becomes the best epoch's model)."""
        load_trained_state(self.module(), snapshot)

    def result_state(self) -> dict[str, torch.Tensor] | None:
        """What this rank contributes to the trained model the driver assembles (None: nothing).
        State dicts of several ranks are merged by key."""
        return self.state_dict() if self.comm.rank == 0 else None


def as_triple(batch: tuple) -> tuple[Any, torch.Tensor, torch.Tensor | None]:
    """(inputs, labels, weights) from a batch of either shape: feature_cols' pairs carry no weights."""
    return batch if len(batch) == 3 else (batch[0], batch[1], None)


def evaluation_sums(output: Any, labels: torch.Tensor, weights: torch.Tensor | None, loss_fn: LossFn,
                    classification: bool) -> torch.Tensor:
    """One validation batch's (loss sum, correct, denominator, counted) as Strategy.evaluate sums them."""
    from sparkdl.model.losses import IGNORE_INDEX

    sums = torch.zeros(4, dtype=torch.float64)
    rows = labels.shape[0]
    if weights is None:
        sums[0], sums[2] = float(loss_fn(loss_input(loss_fn, output), labels)) * rows, rows
    else:
        numerator, denominator = weighted_terms(loss_fn, output, labels, weights)
        sums[0], sums[2] = float(numerator), float(denominator)
    output, labels = float_output(primary_output(output)), scored_labels(loss_fn, labels)
    if not classification or output.dim() < 2:
        return sums
    if output.dim() == labels.dim() + 1 and output.shape[:-1] == labels.shape and output.dim() > 2:
        counted = labels != IGNORE_INDEX  # per-position classes, class dim last
        sums[1] = float(((output.argmax(dim=-1) == labels) & counted).sum())
        sums[3] = float(counted.sum())
    elif output.dim() == 2 and output.shape[1] > 1:
        sums[1], sums[3] = float((output.argmax(dim=1) == labels).sum()), rows
    return sums
