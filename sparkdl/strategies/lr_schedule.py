"""Learning-rate schedules, stepped once per optimizer step (after optimizer.step()) on each worker.

Built-in schedules are an `LrCurve` inside torch's LambdaLR: the curve is a frozen dataclass of
plain values, so the scheduler's state_dict() holds only str/int/float and reloads with
torch.load(weights_only=True) from a checkpoint. Worker-side: no pyspark here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sparkdl.errors import ConfigError, ModelError

if TYPE_CHECKING:
    from sparkdl.config import TrainConfig

SCHEDULES = ("constant", "linear", "cosine", "step")
_HINT = "lr_schedule=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 100)"


@dataclass(frozen=True)
class LrCurve:
    """Multiplier of the base lr after `t` optimizer steps: picklable (it goes into LambdaLR).

    With W = warmup_steps, s = t - W, D = max(1, total_steps - W), m = min_factor:
    t < W: t / W (linear warm-up from 0, Hugging Face's convention); then constant: 1,
    linear: 1 + (m - 1) * min(s, D) / D, cosine: m + (1 - m) * (1 + cos(pi * min(s, D) / D)) / 2,
    step: max(m, step_gamma ** (s // step_every)).
    """

    schedule: str
    total_steps: int
    warmup_steps: int = 0
    min_factor: float = 0.0
    step_every: int = 1
    step_gamma: float = 0.1

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"train.lr_schedule must be one of {SCHEDULES} or a callable, got {self.schedule!r}",
                              hint=f"lr_schedule='cosine', or {_HINT}")
        if self.step_every < 1:
            raise ConfigError(f"LrCurve.step_every must be >= 1, got {self.step_every!r}",
                              hint="train.step_every=0 means once per epoch")

    def __call__(self, t: int) -> float:
        w = self.warmup_steps
        if t < w:
            return t / w
        s, d, m = t - w, max(1, self.total_steps - w), self.min_factor
        if self.schedule == "linear":
            return 1.0 + (m - 1.0) * min(s, d) / d
        if self.schedule == "cosine":
            return m + (1.0 - m) * (1.0 + math.cos(math.pi * min(s, d) / d)) / 2.0
        if self.schedule == "step":
            return max(m, self.step_gamma ** (s // self.step_every))
        return 1.0


def build_scheduler(train: TrainConfig | Any, optimizer: torch.optim.Optimizer, total_steps: int,
                    steps_per_epoch: int) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The run's lr scheduler for `optimizer`, or None when there is nothing to step ("constant"
    without warm-up). `train` is duck-typed: lr, lr_schedule, warmup_steps, min_lr, step_every,
    step_gamma. A callable lr_schedule is called with the optimizer and must return an LRScheduler
    that steps without arguments."""
    schedule = train.lr_schedule
    if callable(schedule):
        scheduler = schedule(optimizer)
        if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            raise ModelError(f"train.lr_schedule returned {type(scheduler).__name__}, not a "
                             "torch.optim.lr_scheduler.LRScheduler", hint=_HINT)
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ModelError("train.lr_schedule returned ReduceLROnPlateau, which needs a metric at every "
                             "step; sparkdl steps the schedule once per optimizer step without one", hint=_HINT)
        return scheduler
    warmup = int(train.warmup_steps)
    if schedule == "constant" and warmup == 0:
        return None
    step_every = int(train.step_every) or max(1, int(steps_per_epoch))
    curve = LrCurve(schedule=schedule, total_steps=int(total_steps), warmup_steps=warmup,
                    min_factor=float(train.min_lr) / float(train.lr), step_every=step_every,
                    step_gamma=float(train.step_gamma))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, curve)


def current_lr(optimizer: torch.optim.Optimizer) -> float:
    """The learning rate of the optimizer's first parameter group (what gets logged)."""
    return float(optimizer.param_groups[0]["lr"])
