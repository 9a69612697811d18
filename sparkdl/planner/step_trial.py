"""A training step of the run's own model, timed where it will run: the planner's compute anchor.

The driver's profile (planner/profile.py) times each layer on the driver and converts it to FLOPs
at the driver's matrix-product rate; a rank's time is then those FLOPs at the rank's rate. On a
shared machine that conversion swung the same model's predicted step from 12 ms to 51 ms between
two fits (the driver busy with JVMs starting beside it) while the ranks measured 26-34 ms both
times: the driver's load and small kernels running below the matrix-product rate do not carry
over. So when the model is small enough to ship, the calibration probe (driver/probe.py) also runs
a few real training steps of it (forward, loss, backward, optimizer update, on the run's own sample
rows at the run's batch) on every rank with the rank's training threads, and the planner scales
every layer's cost so that data parallel's compute equals that measured step (planner/candidates.py
`_workload`). The profile still decides how the cost splits among layers (pipeline cuts); the trial
decides how much it is.

`step_timer` is also the driver profile's full-step rule (`full_step_s`, planner/candidates.py's profile):
one definition of "a training step" for both.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from sparkdl.config import DataConfig, LaunchConfig, TrainConfig
from sparkdl.planner.profile import ModelInput, tensors_of

# A model is timed on the executors only when shipping it and its batch is cheap beside the probe
# itself, and a step is short enough to repeat a few times within the probe's budget.
MAX_TRIAL_BYTES = 64 << 20  # parameters + one batch of inputs and labels
STEP_BUDGET_S = 1.0  # extra timed steps per rank stop after this long
MAX_STEP_REPEATS = 15
SCALE_LIMITS = (1 / 8, 8.0)  # a trial further off the profile than this is distrusted (fallback: the profile)


@dataclass(frozen=True)
class StepTrial:
    """What the ranks time: the model, one batch of the run's rows and labels, the run's train
    section (loss, optimizer), and a key naming what was measured (cached with the calibration)."""

    model: nn.Module
    inputs: Any
    target: Any
    train: TrainConfig
    key: str
    # IST's layout for this run's ranks when IST may train it: the ranks then also time one IST round
    # (driver/probe_ist.py), whose sync a model step cannot show
    ist_layout: Any = None


def trial_key(model: nn.Module, train: TrainConfig, rows: int, inputs: Any, ist_world: int = 0) -> str:
    """The model's parameter shapes and trainability, the batch's shapes, loss, optimizer and
    precision (and the ranks of an IST round, `ist_world`): two trials with one key time the same work."""
    params = [(name, tuple(p.shape), str(p.dtype), p.requires_grad) for name, p in model.named_parameters()]
    shapes = [(tuple(t.shape), str(t.dtype)) for t in tensors_of(inputs)]
    text = repr((type(model).__qualname__, params, shapes, rows, str(train.loss), str(train.optimizer),
                 train.precision) + ((("ist", ist_world),) if ist_world else ()))
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def trial_for(model: nn.Module, train: TrainConfig, launch: LaunchConfig, batch: Any, target: Any,
              ist_layout: Any = None) -> StepTrial | None:
    """The trial of this run, or None where the driver's profile stands alone: GPU ranks (the probe
    times CPU threads), emulated rank speeds (declared, not measured), a model or batch too large to
    ship cheaply, or a custom optimizer or loss (a callable may hold what does not travel). A step
    too long to repeat is timed once (driver/probe.py stops at its budget)."""
    if launch.gpus_per_worker or launch.emulate_speed or callable(train.optimizer) or callable(train.loss):
        return None
    size = sum(p.numel() * p.element_size() for p in model.parameters()) + _bytes(batch) + _bytes(target)
    if size > MAX_TRIAL_BYTES:
        return None
    rows = int(tensors_of(batch)[0].shape[0]) if tensors_of(batch) else 0
    ist_world = ist_layout.world if ist_layout is not None else 0
    return StepTrial(model, batch, target, train, trial_key(model, train, rows, batch, ist_world), ist_layout)


def step_timer(model: nn.Module, train: TrainConfig, inputs: Any, target: Any) -> Callable[[], float]:
    """A function timing one training step of `model` (zero_grad, forward, loss, backward,
    optimizer update) on `inputs` against `target`: the model's weights move, so give it a copy.
    The first call warms allocators and kernels up; time the calls after it."""
    from sparkdl.model.calling import call_model, loss_input
    from sparkdl.model.objectives import build_optimizer, loss_function

    from contextlib import nullcontext

    optimizer = build_optimizer(train, [p for p in model.parameters() if p.requires_grad])
    loss_fn = loss_function(train)
    model.train()
    # as the ranks train (and the driver's layer profile times) a bf16 run
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if train.precision == "bf16" else nullcontext

    def one() -> float:
        started = time.perf_counter()
        optimizer.zero_grad()
        with autocast():
            loss = loss_fn(loss_input(loss_fn, call_model(model, inputs)), target)
        loss.backward()
        optimizer.step()
        return time.perf_counter() - started

    return one


def step_trial(model: nn.Module, data: DataConfig, train: TrainConfig, launch: LaunchConfig,
               num_features: "ModelInput | int", ist_layout: Any = None) -> StepTrial | None:
    """The run's model step for the calibration probe to time on the ranks, or None where it does
    not apply or its batch cannot be built (the profile then stands alone). `ist_layout`: IST's
    layout when IST is a candidate of the run (one IST round is then timed too)."""
    try:
        inputs, target = step_batch(model, train, num_features, data.batch_size)
    except Exception:  # noqa: BLE001 - a model the planner cannot feed is priced by its profile alone
        return None
    return trial_for(model, train, launch, inputs, target, ist_layout)


def step_batch(model: nn.Module, train: TrainConfig, num_features: "ModelInput | int", rows: int) -> tuple[Any, Any]:
    """One batch of `rows` rows as a step sees it, with its target: the run's sample rows and labels
    tiled (input_cols runs), else random feature rows; a target of the loss's shape where the
    sample has no labels."""
    from sparkdl.model.calling import output_of

    model_input = ModelInput.of(num_features)
    x = model_input.rows(rows)
    target = model_input.labels(rows)
    if target is None:
        with torch.no_grad():
            out_shape = output_of(model, x).shape[1:]
        target = torch.zeros(rows, dtype=torch.long) if train.loss in ("cross_entropy", "causal_lm") else \
            torch.zeros(rows, *out_shape)
    return x, target


def full_step_s(model: nn.Module, train: TrainConfig, num_features: "ModelInput | int", rows: int,
                 repeats: int = 3) -> float:
    """One local training step on a copy (`step_timer`, the trial's rule) on the driver: the median
    of `repeats` after a warm-up (the profile's per-step cost beyond its layers)."""
    import copy
    import statistics

    x, target = step_batch(model, train, num_features, rows)
    one = step_timer(copy.deepcopy(model), train, x, target)
    one()  # warm-up
    return statistics.median(one() for _ in range(repeats))


def lock_step_s(per_rank: tuple[float, ...], equal: bool = False) -> float:
    """The step of a lock-step run from each rank's measured step: the slowest rank's, or with
    `equal` (the calibration's optimistic end counting the ranks as equal) the fastest's. 0 when
    not measured."""
    measured = [s for s in per_rank if s > 0]
    if not measured or len(measured) != len(per_rank):
        return 0.0
    return min(measured) if equal else max(measured)


def scale_to_trial(predicted_s: float, measured_s: float) -> float:
    """The factor every layer's cost is multiplied by so that the predicted step equals the measured
    one; 1 when there is no trial or the two are too far apart to trust (SCALE_LIMITS)."""
    if predicted_s <= 0 or measured_s <= 0:
        return 1.0
    factor = measured_s / predicted_s
    low, high = SCALE_LIMITS
    return factor if low <= factor <= high else 1.0


def _bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(value))
