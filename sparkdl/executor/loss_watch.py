"""A loss that turns NaN or infinite, caught on the rank where it happened (train.nonfinite_loss).

Without it a fit whose loss diverged "succeeded": it logged and served a model of NaN weights.
"raise" (default) stops the run with a TrainingError naming the step, the rank and the last finite
loss; "skip" leaves such steps out as AMP's GradScaler does (strategies/stepping.py skips the
optimizer step when any averaged gradient is not finite, the same decision on every rank) and keeps
them out of the epoch's loss.

The checks stay on the device: a flag per step costs no host sync. On CPU the flag is read every
step; on a GPU every CHECK_EVERY_GPU steps and at the epoch's end, naming the first bad step all the
same (it is recorded on the device as it happens).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from sparkdl.errors import TrainingError

RAISE, SKIP = "raise", "skip"
CHECK_EVERY_GPU = 16  # host reads of the flag: one sync per this many steps on a GPU


class LossWatch:
    def __init__(self, mode: str, rank: int, host: str, device: Any) -> None:
        self.mode, self.rank, self.host = mode, rank, host
        device = torch.device(device) if device is not None else torch.device("cpu")
        self._every = 1 if device.type == "cpu" else CHECK_EVERY_GPU
        self._first_bad = torch.full((), -1, dtype=torch.int64, device=device)  # global step, -1: none yet
        self._bad_loss = torch.zeros((), dtype=torch.float64, device=device)
        self._last_finite = torch.full((), math.nan, dtype=torch.float64, device=device)
        self._last_finite_step = torch.full((), -1, dtype=torch.int64, device=device)
        self._skipped_steps = torch.zeros((), dtype=torch.int64, device=device)
        self._skipped_rows = torch.zeros((), dtype=torch.int64, device=device)
        self._epoch_start = 0

    def start_epoch(self, global_step: int) -> None:
        self._epoch_start = global_step
        self._skipped_steps.zero_()
        self._skipped_rows.zero_()

    def observe(self, loss: torch.Tensor, rows: int, global_step: int, epoch: int) -> torch.Tensor:
        """Record step `global_step`'s (1-based) loss; returns what the epoch's loss sum takes of it
        (the loss as a float64 0-d tensor; 0 for a skipped step). Raises once a bad step is seen."""
        value = loss.detach().double().reshape(())
        finite = torch.isfinite(value)
        clean = self._first_bad < 0
        self._last_finite = torch.where(finite & clean, value, self._last_finite)
        self._last_finite_step = torch.where(finite & clean, global_step, self._last_finite_step)
        self._bad_loss = torch.where(~finite & clean, value, self._bad_loss)
        self._first_bad = torch.where(~finite & clean, global_step, self._first_bad)
        if self.mode == SKIP:
            self._skipped_steps += (~finite).long()
            self._skipped_rows += (~finite).long() * rows
            return torch.where(finite, value, torch.zeros_like(value))
        if global_step % self._every == 0:
            self.check(epoch)
        return value

    def check(self, epoch: int) -> None:
        """Raise (mode "raise") when a step so far had a non-finite loss on this rank (one host read)."""
        if self.mode != RAISE:
            return
        bad = int(self._first_bad)
        if bad < 0:
            return
        last_step = int(self._last_finite_step)
        last = (f"the last finite loss was {float(self._last_finite):.6g} at step {last_step}" if last_step >= 0
                else "no step before it had a finite loss")
        raise TrainingError(
            f"the training loss became {float(self._bad_loss)} at step {bad} (epoch {epoch}) on rank {self.rank} "
            f"(host {self.host}); {last}",
            hint="lower train.lr, set train.grad_clip (e.g. 1.0), check the data for NaN/infinite values, or "
                 "set train.nonfinite_loss='skip' to leave such steps out (as AMP's GradScaler does)")

    def end_epoch(self, epoch: int, steps: int) -> dict[str, int]:
        """The epoch's skipped steps and rows (mode "skip"); raises when every step of it was skipped
        (nothing trained: skipping would only hide a broken run)."""
        self.check(epoch)
        if self.mode != SKIP:
            return {"skipped_steps": 0, "skipped_rows": 0}
        skipped = int(self._skipped_steps)
        if steps > 0 and skipped >= steps:
            raise TrainingError(
                f"every one of epoch {epoch}'s {steps} steps had a non-finite loss on rank {self.rank} (host "
                f"{self.host}) with train.nonfinite_loss='skip': nothing was trained",
                hint="check the data for NaN/infinite values, lower train.lr or set train.grad_clip")
        return {"skipped_steps": skipped, "skipped_rows": int(self._skipped_rows)}
