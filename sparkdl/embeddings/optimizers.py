"""Sparse optimizers run by a table's owner on the rows a step touched, never on the whole table.

Each works on one shard: `weight` [rows held, dim], its own `state` (tensors shaped by the shard, so a
checkpoint writes them shard by shard), and the step's coalesced gradients of distinct local `rows`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sparkdl.errors import ConfigError


def _check_positive(owner: str, **values: float) -> None:
    for option, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{owner}: {option}={value!r} is not a positive finite number",
                              hint=f"set {option} > 0")


@dataclass(frozen=True)
class RowwiseAdagrad:
    """FBGEMM/TorchRec's row-wise Adagrad: one accumulator per row, state += mean over the dim of g^2,
    w -= lr * g / (sqrt(state) + eps). A quarter of Adagrad's memory at dim 4, 1/dim in general."""

    lr: float = 0.01
    eps: float = 1e-8

    def __post_init__(self) -> None:
        _check_positive("RowwiseAdagrad", lr=self.lr, eps=self.eps)

    def init_state(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"sum": torch.zeros(weight.shape[0], dtype=weight.dtype)}

    def update(self, weight: torch.Tensor, state: dict[str, torch.Tensor], rows: torch.Tensor,
               grads: torch.Tensor) -> None:
        accumulator = state["sum"]
        accumulator[rows] += grads.pow(2).mean(dim=1)
        weight[rows] -= self.lr * grads / (accumulator[rows].sqrt() + self.eps).unsqueeze(1)


@dataclass(frozen=True)
class SparseAdam:
    """Adam with torch.optim.SparseAdam's lazy semantics: only touched rows' moments decay and move;
    bias correction uses the table's step count (every applied step counts, touched rows or not)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self) -> None:
        _check_positive("SparseAdam", lr=self.lr, eps=self.eps)
        if len(self.betas) != 2 or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"SparseAdam: betas={self.betas!r} must be two numbers in [0, 1)",
                              hint="the default is (0.9, 0.999)")

    def init_state(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"exp_avg": torch.zeros_like(weight), "exp_avg_sq": torch.zeros_like(weight),
                "step": torch.zeros((), dtype=torch.int64)}

    def update(self, weight: torch.Tensor, state: dict[str, torch.Tensor], rows: torch.Tensor,
               grads: torch.Tensor) -> None:
        state["step"] += 1
        if rows.numel() == 0:
            return
        beta1, beta2 = self.betas
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        # The same operations in the same order as torch's sparse_adam, so results agree to the bit.
        old_avg, old_sq = exp_avg[rows], exp_avg_sq[rows]
        avg_update = grads.sub(old_avg).mul_(1 - beta1)
        sq_update = grads.pow(2).sub_(old_sq).mul_(1 - beta2)
        exp_avg[rows] += avg_update
        exp_avg_sq[rows] += sq_update
        numer = avg_update.add_(old_avg)
        denom = sq_update.add_(old_sq).sqrt_().add_(self.eps)
        step = int(state["step"])
        step_size = self.lr * math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)
        weight[rows] += -step_size * numer.div_(denom)


SparseOptimizer = RowwiseAdagrad | SparseAdam
