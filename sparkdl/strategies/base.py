"""Strategy interface: how one rank's model trains and stays consistent with its peers."""
from __future__ import annotations

import abc
from typing import Any, Callable

import torch
from torch import nn

from sparkdl.comm.base import Communicator

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


class Strategy(abc.ABC):
    """`requires` names the communicator ops the strategy uses; planning checks them against the
    backend's `ops` so an impossible pairing fails before any job starts."""

    name: str = ""
    requires: frozenset[str] = frozenset()

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm

    @abc.abstractmethod
    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory, loss_fn: LossFn) -> None:
        """Place the model, make every rank start from identical weights, build the optimizer."""

    @abc.abstractmethod
    def train_step(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One optimisation step on this rank's batch; returns the local loss (a detached scalar)."""

    def learning_rate(self) -> float:
        """The current learning rate of the (first) optimizer, for metrics."""
        optimizer = getattr(self, "_optimizer", None)
        return float(optimizer.param_groups[0]["lr"]) if optimizer is not None else 0.0

    def end_epoch(self) -> None:
        """Hook for strategies that synchronise at epoch ends."""

    @abc.abstractmethod
    def module(self) -> nn.Module:
        """The full trained model as this rank sees it (complete on rank 0)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in self.module().state_dict().items()}
