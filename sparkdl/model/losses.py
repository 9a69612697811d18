"""The built-in losses, each usable as mean (`loss(output, label)`) and per element
(`loss.per_element`), so that per-row weights sum exactly across ranks (strategies/inputs.py).

cross_entropy takes logits (B, C) with labels (B,), and (B, T, C) with (B, T) (class dim last, as
language models emit), ignoring label positions equal to IGNORE_INDEX; mse and bce compare equal shapes.
causal_lm is a causal language model's loss as Hugging Face's models compute it from `labels`: the
logits at position t predict the label at t + 1 (labels are the input ids, shifted here), positions
labelled IGNORE_INDEX (padding) count for nothing; per element it is shaped like the label, the
first position never counted.
Torch only: workers and the driver use it.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def _class_last(output: torch.Tensor, label: torch.Tensor) -> bool:
    return output.dim() > 2 and label.dim() == output.dim() - 1 and output.shape[:-1] == label.shape


def _cross_entropy(output: torch.Tensor, label: torch.Tensor, reduction: str) -> torch.Tensor:
    if _class_last(output, label):
        loss = F.cross_entropy(output.reshape(-1, output.shape[-1]), label.reshape(-1), ignore_index=IGNORE_INDEX,
                               reduction=reduction)
        return loss.view(label.shape) if reduction == "none" else loss
    return F.cross_entropy(output, label, ignore_index=IGNORE_INDEX, reduction=reduction)


def _causal_lm(output: torch.Tensor, label: torch.Tensor, reduction: str) -> torch.Tensor:
    shifted = shifted_labels(label)
    loss = F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), shifted.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction=reduction)
    return loss.view(label.shape) if reduction == "none" else loss


def shifted_labels(label: torch.Tensor) -> torch.Tensor:
    """Labels (B, T) moved one position left, the last position ignored: what the logits at each
    position predict."""
    return torch.cat([label[:, 1:], torch.full_like(label[:, :1], IGNORE_INDEX)], dim=1)


def _like_label(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return output.reshape(label.shape) if output.numel() == label.numel() else output


def _mse(output: torch.Tensor, label: torch.Tensor, reduction: str) -> torch.Tensor:
    return F.mse_loss(_like_label(output, label), label, reduction=reduction)


def _bce(output: torch.Tensor, label: torch.Tensor, reduction: str) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(_like_label(output, label), label, reduction=reduction)


class BuiltinLoss:
    """A built-in loss by name: picklable, mean by default, per element for weighted sums."""

    def __init__(self, name: str) -> None:
        if name not in _IMPLEMENTATIONS:
            raise ValueError(f"no built-in loss {name!r}")
        self.name = name

    def __call__(self, output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return _IMPLEMENTATIONS[self.name](output, label, "mean")

    def per_element(self, output: torch.Tensor, label: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(losses, counted): per-element losses shaped like the label, and 1/0 for positions that
        count (cross_entropy's ignored positions count 0)."""
        losses = _IMPLEMENTATIONS[self.name](output, label, "none")
        return losses, self.counted(label, losses.dtype)

    def counted(self, label: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """1 for each label position that counts, 0 for cross_entropy's ignored ones; shaped like the label."""
        if self.name == "cross_entropy":
            return (label != IGNORE_INDEX).to(dtype)
        if self.name == "causal_lm":
            return (shifted_labels(label) != IGNORE_INDEX).to(dtype)
        return torch.ones(label.shape, dtype=dtype, device=label.device)

    def predicted(self, label: torch.Tensor) -> torch.Tensor:
        """The labels each output position is scored against (accuracy, metrics): causal_lm's shifted."""
        return shifted_labels(label) if self.name == "causal_lm" else label

    def __repr__(self) -> str:
        return f"BuiltinLoss({self.name!r})"


_IMPLEMENTATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor]] = {
    "cross_entropy": _cross_entropy, "mse": _mse, "bce_with_logits": _bce, "causal_lm": _causal_lm}
