"""Validation metrics (train.metrics), computed on each rank's validation batches and reduced exactly.

A metric that is a ratio of sums gives per-batch partial sums (a float64 vector of `size`); the
partials are summed over batches and over ranks (one allreduce of the concatenation) before `value`
turns the totals into a number, so the result equals the metric on the whole validation set, however
the rows are split. AUC is not a sum: a GatheredMetric collects (scores, labels) per batch, every
rank's parts are gathered and `value_of` ranks them all at once.

Output conventions follow sparkdl.model.losses: class logits (B, C) with int labels (B,), or per position
(B, T, C) with (B, T), class dim last, labels equal to IGNORE_INDEX not counted; a single logit per row
(B,) or (B, 1), or per element (B, C) with float labels, is binary. Worker side: never imports pyspark.
"""
from __future__ import annotations

import abc
import math
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from sparkdl.config.training import check_metrics, parse_metric_name
from sparkdl.model.losses import IGNORE_INDEX

Parts = list[tuple[np.ndarray, np.ndarray]]


def _prepared(output: torch.Tensor) -> torch.Tensor:
    """Detached output in at least float32: bf16/fp16 outputs of mixed precision would round the sums."""
    output = output.detach()
    if not output.is_floating_point() or output.element_size() < 4:
        return output.float()
    return output


def _is_class_index(output: torch.Tensor, label: torch.Tensor) -> bool:
    """Class logits with integer class labels: a last dim of 1 is a single binary logit, not one class."""
    integer = not (label.is_floating_point() or label.is_complex() or label.dtype == torch.bool)
    return integer and output.dim() >= 1 and output.shape[-1] > 1 and tuple(output.shape[:-1]) == tuple(label.shape)


def _like_label(output: torch.Tensor, label: torch.Tensor, metric: str) -> torch.Tensor:
    """Output reshaped to the label's shape ((B, 1) against (B,)), or ValueError when they cannot match."""
    if output.numel() != label.numel():
        raise ValueError(f"metric {metric!r} compares output and label element by element, but the output has "
                         f"shape {tuple(output.shape)} and the label {tuple(label.shape)}")
    return output.reshape(label.shape)


def _class_rows(output: torch.Tensor, label: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits (n, C), int64 labels (n,)) of the counted positions (cross_entropy wants int64 targets)."""
    logits, labels = output.reshape(-1, output.shape[-1]), label.reshape(-1).long()
    keep = labels != IGNORE_INDEX
    return logits[keep], labels[keep]


def _vector(*values: Any) -> torch.Tensor:
    """A float64 CPU vector; float() of a float64 or int64 sum is exact."""
    return torch.tensor([float(v) for v in values], dtype=torch.float64)


def _wide(values: torch.Tensor) -> torch.Tensor:
    """Float64 (on the CPU where the device has none, as MPS), so that sums over any split add up exactly."""
    return (values.cpu() if values.device.type == "mps" else values).to(torch.float64)


class Metric(abc.ABC):
    """One validation metric: `partial` per batch, `value` of the partials summed over batches and ranks."""

    name: str
    size: int = 2
    gathered: bool = False

    def __init__(self, name: str) -> None:
        self.name = name

    def partial(self, output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        """Float64 CPU vector of `size` partial sums of this batch (no autograd graph is kept)."""
        with torch.no_grad():
            return self._partial(_prepared(output), label.detach())

    @abc.abstractmethod
    def _partial(self, output: torch.Tensor, label: torch.Tensor) -> torch.Tensor: ...

    @abc.abstractmethod
    def value(self, totals: torch.Tensor) -> float | None:
        """The metric from the summed partials; None when nothing was counted."""


class _Ratio(Metric):
    """partial = [sum, count]; value = finish(sum / count), None for count 0."""

    def _partial(self, output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return _vector(*self._sum_count(output, label))

    @abc.abstractmethod
    def _sum_count(self, output: torch.Tensor, label: torch.Tensor) -> tuple[Any, Any]: ...

    def _finish(self, mean: float) -> float:
        return mean

    def value(self, totals: torch.Tensor) -> float | None:
        total, count = (float(v) for v in totals.tolist())
        return None if count == 0 else self._finish(total / count)


class Accuracy(_Ratio):
    """Argmax == label over counted class positions; (output > 0) == (label > 0.5) for binary outputs."""

    def _sum_count(self, output: torch.Tensor, label: torch.Tensor) -> tuple[Any, Any]:
        if _is_class_index(output, label):
            keep = label != IGNORE_INDEX
            return ((output.argmax(dim=-1) == label) & keep).sum(), keep.sum()
        output = _like_label(output, label, self.name)
        return ((output > 0) == (label > 0.5)).sum(), label.numel()


def _need_classes(metric: str, output: torch.Tensor, label: torch.Tensor) -> None:
    if not _is_class_index(output, label):
        raise ValueError(f"metric {metric!r} needs class logits (B, C) or (B, T, C) with integer class labels "
                         f"(B,) or (B, T); got output {tuple(output.shape)} and label {tuple(label.shape)} "
                         f"({label.dtype})")


class TopKAccuracy(_Ratio):
    """The label among the top min(k, C) logits, over counted class positions."""

    def __init__(self, name: str, k: int) -> None:
        super().__init__(name)
        self.k = k

    def _sum_count(self, output: torch.Tensor, label: torch.Tensor) -> tuple[Any, Any]:
        _need_classes(self.name, output, label)
        top = output.topk(min(self.k, output.shape[-1]), dim=-1).indices
        keep = label != IGNORE_INDEX
        return ((top == label.unsqueeze(-1)).any(dim=-1) & keep).sum(), keep.sum()


class Perplexity(_Ratio):
    """exp(mean cross-entropy) over counted positions: the partial sums per-position losses in float64."""

    def _sum_count(self, output: torch.Tensor, label: torch.Tensor) -> tuple[Any, Any]:
        _need_classes(self.name, output, label)
        logits, labels = _class_rows(output, label)
        return _wide(F.cross_entropy(logits, labels, reduction="none")).sum(), labels.numel()

    def _finish(self, mean: float) -> float:
        return math.exp(mean) if mean < 709.0 else math.inf  # exp overflows a float past ~709.78


class MeanAbsoluteError(_Ratio):
    def _sum_count(self, output: torch.Tensor, label: torch.Tensor) -> tuple[Any, Any]:
        output = _like_label(output, label, self.name)
        return (_wide(output) - _wide(label)).abs().sum(), label.numel()


class RootMeanSquaredError(_Ratio):
    def _sum_count(self, output: torch.Tensor, label: torch.Tensor) -> tuple[Any, Any]:
        output = _like_label(output, label, self.name)
        return torch.square(_wide(output) - _wide(label)).sum(), label.numel()

    def _finish(self, mean: float) -> float:
        return math.sqrt(mean)


class CallableMetric(_Ratio):
    """A user's fn(output, label) -> (sum, count), numbers or 0-d tensors; value = sum / count."""

    def __init__(self, name: str, fn: Callable[[torch.Tensor, torch.Tensor], Any]) -> None:
        super().__init__(name)
        self.fn = fn

    def _sum_count(self, output: torch.Tensor, label: torch.Tensor) -> tuple[Any, Any]:
        result = self.fn(output, label)
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            raise ValueError(f"metric {self.name!r} must return (sum, count), got {type(result).__name__}")
        return tuple(v.item() if isinstance(v, torch.Tensor) else v for v in result)


class GatheredMetric(Metric):
    """A metric that is not a sum: every rank's collected (scores, labels) are gathered, not summed."""

    size = 0
    gathered = True

    def _partial(self, output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return torch.zeros(0, dtype=torch.float64)

    def value(self, totals: torch.Tensor) -> float | None:
        """No value from sums: see value_of."""
        return None

    def collect(self, output: torch.Tensor, label: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """(scores, labels) of this batch as float64 arrays."""
        with torch.no_grad():
            return self._collect(_prepared(output), label.detach())

    @abc.abstractmethod
    def _collect(self, output: torch.Tensor, label: torch.Tensor) -> tuple[np.ndarray, np.ndarray]: ...

    @abc.abstractmethod
    def value_of(self, parts: Parts) -> float | None:
        """The metric over every rank's collected parts; None when it is undefined."""


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.cpu().to(torch.float64).numpy()


def binary_auc(scores: np.ndarray, positive: np.ndarray) -> float | None:
    """Exact ROC AUC by Mann-Whitney U with average ranks for ties; None without both classes."""
    n_pos = int(positive.sum())
    n_neg = positive.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    order = np.argsort(scores, kind="mergesort")
    ordered = scores[order]
    first = np.concatenate(([True], ordered[1:] != ordered[:-1]))
    starts = np.flatnonzero(first)
    ends = np.append(starts[1:], scores.size)
    ranks = np.empty(scores.size, dtype=np.float64)
    ranks[order] = ((starts + 1 + ends) / 2.0)[np.cumsum(first) - 1]
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


class AUC(GatheredMetric):
    """ROC AUC: binary, macro one-vs-rest over classes, or macro over multi-label columns."""

    def _collect(self, output: torch.Tensor, label: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        if _is_class_index(output, label):
            logits, labels = _class_rows(output, label)
            if logits.shape[-1] == 2:  # the log-odds of class 1: same ranking as its probability
                return _numpy(logits[:, 1] - logits[:, 0]), _numpy(labels)
            return _numpy(torch.softmax(_wide(logits), dim=-1)), _numpy(labels)
        output = _like_label(output, label, self.name)
        positive = (label > 0.5).to(torch.float64)
        if label.dim() <= 1:
            return _numpy(output.reshape(-1)), _numpy(positive.reshape(-1))
        return _numpy(output.reshape(-1, label.shape[-1])), _numpy(positive.reshape(-1, label.shape[-1]))

    def value_of(self, parts: Parts) -> float | None:
        if not parts:
            return None
        scores = np.concatenate([s for s, _ in parts])
        labels = np.concatenate([y for _, y in parts])
        if scores.ndim == 1:
            return binary_auc(scores, labels > 0.5)
        columns = [labels == c for c in range(scores.shape[1])] if labels.ndim == 1 else \
            [labels[:, c] > 0.5 for c in range(scores.shape[1])]
        aucs = [binary_auc(scores[:, c], positive) for c, positive in enumerate(columns)]
        defined = [a for a in aucs if a is not None]
        return float(np.mean(defined)) if defined else None


def _builtin(name: str) -> Metric:
    kind, k = parse_metric_name(name)
    if kind == "top_k_accuracy":
        return TopKAccuracy(name, k)
    classes: dict[str, type[Metric]] = {"accuracy": Accuracy, "perplexity": Perplexity, "mae": MeanAbsoluteError,
                                        "rmse": RootMeanSquaredError, "auc": AUC}
    return classes[kind](name)


def build_metrics(specs: Sequence[str | Callable[..., Any]]) -> tuple[Metric, ...]:
    """The metrics of train.metrics, in order; ConfigError for an unknown, unnamed or repeated entry."""
    items = specs if isinstance(specs, str) else list(specs)
    names = check_metrics(items)  # the driver's own check: also rejects a bare string and repeats
    return tuple(CallableMetric(name, spec) if callable(spec) else _builtin(spec) for name, spec in zip(names, items))


def total_size(metrics: Sequence[Metric]) -> int:
    """Length of the concatenated partials: the allreduce's vector."""
    return sum(m.size for m in metrics if not m.gathered)


def batch_partials(metrics: Sequence[Metric], output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """Concatenated partials of the summed (non-gathered) metrics for one batch: float64, total_size long."""
    parts = [m.partial(output, label) for m in metrics if not m.gathered]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def metric_values(metrics: Sequence[Metric], totals: torch.Tensor, gathered: dict[str, Parts]) -> dict[str, float]:
    """{"val_<name>": value} from the totals summed over batches and ranks and the gathered parts;
    metrics without a value (nothing counted, one class only) are left out."""
    if totals.numel() != total_size(metrics):
        raise ValueError(f"metric totals have {totals.numel()} values, the metrics {total_size(metrics)}")
    totals = totals.detach().cpu().to(torch.float64)
    values: dict[str, float] = {}
    offset = 0
    for metric in metrics:
        if isinstance(metric, GatheredMetric):
            value = metric.value_of(gathered.get(metric.name, []))
        else:
            value = metric.value(totals[offset: offset + metric.size])
            offset += metric.size
        if value is not None:
            values[f"val_{metric.name}"] = value
    return values
