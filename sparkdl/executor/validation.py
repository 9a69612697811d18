"""Per-epoch validation of the built-in loop: val_loss, val_accuracy and train.metrics, reduced
exactly over every rank's validation rows (float64 sums in one allreduce; AUC's scores gathered)."""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch

from sparkdl.errors import ConfigError
from sparkdl.executor.context import WorkerContext
from sparkdl.model.metrics import GatheredMetric, Metric, batch_partials, build_metrics, metric_values, total_size


class MetricSums:
    """What Strategy.evaluate hands every validation batch's (output, label) to: the running
    partial sums of the summable metrics, and the collected parts of the gathered ones."""

    def __init__(self, metrics: Sequence[Metric]) -> None:
        self.metrics = tuple(metrics)
        self.totals = torch.zeros(total_size(self.metrics), dtype=torch.float64)
        self.parts: dict[str, list[Any]] = {m.name: [] for m in self.metrics if isinstance(m, GatheredMetric)}
        self.error = ""  # the first failure on this rank, raised by every rank in values()

    def add(self, output: torch.Tensor, label: torch.Tensor) -> None:
        """Never raises: a rank failing here alone (a pipeline's last stage, one odd batch) would
        leave its peers waiting in the next collective; values() fails on every rank instead."""
        if self.error:
            return
        try:
            if self.totals.numel():
                self.totals += batch_partials(self.metrics, output, label)
            for metric in self.metrics:
                if isinstance(metric, GatheredMetric):
                    self.parts[metric.name].append(metric.collect(output, label))
        except Exception as exc:  # noqa: BLE001 - a callable metric can raise anything
            self.error = f"{type(exc).__name__}: {exc}"

    def values(self, comm: Any) -> dict[str, float]:
        """The metrics over every rank's rows (collectives: every rank calls it)."""
        errors = [e for e in comm.allgather_object(self.error) if e]
        if errors:
            raise ConfigError(f"train.metrics cannot be computed on this model's outputs: {errors[0]}",
                              hint="accuracy/top_k_accuracy/perplexity need class logits; mae/rmse values of the "
                                   "label's shape; auc scores for binary or class labels")
        if self.totals.numel():
            comm.allreduce(self.totals, op="sum")
        gathered: dict[str, list[Any]] = {}
        if self.parts:
            everyone = comm.allgather_object(self.parts)
            gathered = {name: [part for rank_parts in everyone for part in rank_parts[name]] for name in self.parts}
        return metric_values(self.metrics, self.totals, gathered)


def run_metrics(ctx: WorkerContext) -> tuple[Metric, ...]:
    return build_metrics(ctx.spec.train.metrics)


def validate(ctx: WorkerContext, strategy: Any, loss_fn: Any, metrics: Sequence[Metric],
             triples: Iterable[Any]) -> dict[str, float]:
    """val_loss (and val_accuracy for class labels, val_<name> for train.metrics) over every rank's
    validation rows."""
    if not ctx.has_validation:  # the same on every rank: the run has validation data or not
        return {}
    classification = ctx.spec.layout is not None and ctx.spec.layout.label_dtype == "int64"
    collector = MetricSums(metrics) if metrics else None
    # (loss sum, correct, loss denominator, labels counted): see Strategy.evaluate
    sums = strategy.evaluate(triples, loss_fn, classification, collector)
    ctx.comm.allreduce(sums, op="sum")
    extra = collector.values(ctx.comm) if collector is not None else {}
    if sums[2] == 0:
        return {}
    result = {"val_loss": float(sums[0] / sums[2])}
    if classification and sums[3] > 0:
        result["val_accuracy"] = float(sums[1] / sums[3])
    result.update(extra)
    return result
