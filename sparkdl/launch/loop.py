"""The built-in training loop every rank runs when no custom train_fn is given."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from sparkdl.launch.objectives import build_model, build_optimizer, loss_function
from sparkdl.strategies import strategy_class

if TYPE_CHECKING:
    from sparkdl.launch.worker import WorkerContext


def train(ctx: "WorkerContext") -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    config = ctx.spec.config
    torch.manual_seed(config.train.seed)
    model = build_model(ctx.spec.model, config.train.seed)
    strategy = strategy_class(config.train.strategy)(ctx.comm)
    strategy.setup(model, lambda params: build_optimizer(config.train, params), loss_function(config.train))
    device = ctx.comm.device
    history: list[dict[str, Any]] = []
    for epoch in range(config.train.epochs):
        bytes_before = ctx.comm.bytes_sent
        started = time.perf_counter()
        loss_sum = torch.zeros((), dtype=torch.float64)
        samples = 0
        steps = 0
        for features, labels in ctx.batches(epoch):
            features = features.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            loss = strategy.train_step(features, labels)
            loss_sum += loss.double().cpu() * features.shape[0]
            samples += features.shape[0]
            steps += 1
        strategy.end_epoch()
        totals = torch.tensor([float(loss_sum), float(samples)], dtype=torch.float64)
        ctx.comm.allreduce(totals, op="sum")
        seconds = time.perf_counter() - started
        history.append({
            "epoch": epoch,
            "loss": float(totals[0] / max(totals[1], 1.0)),
            "samples": int(totals[1]),
            "steps": steps,
            "seconds": seconds,
            "samples_per_sec": float(totals[1]) / seconds if seconds > 0 else 0.0,
            "bytes_sent": ctx.comm.bytes_sent - bytes_before,
        })
    return strategy.state_dict(), history
