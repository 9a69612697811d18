"""What every strategy does around its optimizer: mixed precision, gradient accumulation and the
learning-rate schedule, in one object each strategy holds (`Strategy.steps`).

Mixed precision keeps fp32 master weights and optimizer state: only the forward runs under
torch.autocast, the loss is taken in fp32 and gradients (of fp32 parameters) are averaged in fp32.
"16" adds a GradScaler (CUDA only); its state is checkpointed with the scheduler's. Accumulation
divides each micro-batch's objective by its window's length, so k micro-batches of b rows give the
update of one batch of k x b rows.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Iterable

import torch

from sparkdl.data.epochs import Accumulation
from sparkdl.errors import ConfigError

SINGLE = Accumulation(0, 1)
ScheduleFactory = Callable[[torch.optim.Optimizer], Any]  # optimizer -> LRScheduler | None
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "16": torch.float16}


def float_output(output: Any) -> Any:
    """A low-precision model output in fp32, so that losses and metrics are taken in fp32."""
    if isinstance(output, torch.Tensor) and output.dtype in (torch.bfloat16, torch.float16):
        return output.float()
    return output


class OptimizerSteps:
    def __init__(self, train: Any, device: Any, schedule: ScheduleFactory | None = None) -> None:
        self.precision = str(getattr(train, "precision", "32"))
        self.grad_clip = float(getattr(train, "grad_clip", 0.0))
        # train.nonfinite_loss="skip": no update from a non-finite averaged gradient (the scaler's own rule
        # under precision "16"); the same decision on every rank holding the same averaged gradient
        self.skip_nonfinite = getattr(train, "nonfinite_loss", "raise") == "skip"
        self.device_type = torch.device(device).type if device is not None else "cpu"
        if self.precision == "16" and self.device_type != "cuda":
            raise ConfigError(f"train.precision='16' needs CUDA GPUs, but this rank trains on {self.device_type}",
                              hint="use precision='bf16' (autocast on CPU and GPU), or give each worker a GPU "
                                   "(launch.gpus_per_worker=1)")
        self.autocast_dtype = AUTOCAST_DTYPES.get(self.precision)
        self.scaler = torch.amp.GradScaler("cuda") if self.precision == "16" else None
        self._schedule = schedule
        self.scheduler: Any = None
        self.taken = 0  # optimizer steps so far

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Schedule this optimizer's lr. A strategy that replaces its optimizer (IST, every round)
        attaches the new one: the schedule continues where it was."""
        previous = self.scheduler.state_dict() if self.scheduler is not None else None
        self.scheduler = self._schedule(optimizer) if self._schedule is not None else None
        if self.scheduler is not None and previous is not None:
            self.scheduler.load_state_dict(previous)
            for group, lr in zip(optimizer.param_groups, self.scheduler.get_last_lr()):
                group["lr"] = lr

    def autocast(self) -> ContextManager[Any]:
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype)

    def backward(self, objective: torch.Tensor, micro: Accumulation = SINGLE,
                 gradient: torch.Tensor | None = None) -> None:
        """Backward of one micro-batch's objective (or of an output with the `gradient` a later
        pipeline stage sent back, already scaled there)."""
        if gradient is not None:
            objective.backward(gradient.to(objective.dtype))
            return
        if micro.count > 1:
            objective = objective / micro.count
        if self.scaler is not None:
            objective = self.scaler.scale(objective)
        objective.backward()

    def step(self, optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor],
             sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None,
             agree: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Unscale, clip to grad_clip, step (skipped by the scaler on inf/NaN gradients), then the lr.
        `sum_over_ranks`: the gradients are shards of one model (sharded data parallel): the norm
        clipped is the whole model's, from the shards' squared norms summed over the ranks. `agree`
        (a sum over ranks holding other parts of the model, a pipeline's stages): skipping a
        non-finite step is decided alike on all of them. In skip mode the check reads one flag on
        the host per step (a sync on a GPU)."""
        params = list(params)
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        elif self.skip_nonfinite and not finite_gradients(params, sum_over_ranks or agree):
            return  # as the scaler does: no step, no lr step; the next step's zero_grad clears them
        if self.grad_clip > 0 and sum_over_ranks is not None:
            clip_sharded(params, self.grad_clip, sum_over_ranks)
        elif self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, self.grad_clip)
        stepped = True
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            self.scaler.step(optimizer)
            self.scaler.update()
            stepped = self.scaler.get_scale() >= scale  # a lower scale: inf/NaN gradients, the step was skipped
        else:
            optimizer.step()
        if self.scheduler is not None and stepped:
            self.scheduler.step()  # the schedule counts the optimizer steps taken
        self.taken += int(stepped)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"taken": self.taken}
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.taken = int(state.get("taken", 0))
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
            optimizer = self.scheduler.optimizer
            for group, lr in zip(optimizer.param_groups, self.scheduler.get_last_lr()):
                group["lr"] = lr
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


def finite_gradients(params: list[torch.Tensor],
                     sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None) -> bool:
    """Every gradient finite (elementwise: a norm of large finite values could overflow); with
    `sum_over_ranks` (shards of one model's gradient) the answer is agreed over the ranks."""
    grads = [p.grad for p in params if p.grad is not None]
    flags = [torch.isfinite(g).all() for g in grads]
    finite = torch.stack(flags).all() if flags else torch.tensor(True)
    if sum_over_ranks is None:
        return bool(finite)
    bad = (~finite).float().reshape(1).to(grads[0].device if grads else "cpu")
    return float(sum_over_ranks(bad)[0]) == 0.0


def clip_sharded(shards: list[torch.Tensor], max_norm: float, sum_over_ranks: Callable[[torch.Tensor], torch.Tensor]
                 ) -> None:
    """clip_grad_norm_'s rule (scale by max_norm / (norm + 1e-6) when above) over gradients spread
    across ranks: every rank computes the same global norm."""
    grads = [p.grad for p in shards if p.grad is not None]
    squares = torch.zeros(1, dtype=torch.float32, device=grads[0].device if grads else None)
    for grad in grads:
        squares += grad.detach().float().pow(2).sum()
    norm = float(sum_over_ranks(squares)[0]) ** 0.5
    factor = max_norm / (norm + 1e-6)
    if factor < 1.0:
        for grad in grads:
            grad.mul_(factor)
