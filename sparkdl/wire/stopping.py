"""When the built-in loop stops before train.epochs: early stopping on an epoch-record metric, or a
driver callback's "stop". One verdict per epoch, made by rank 0 and agreed by every rank through the
communicator, so no rank runs an epoch its peers skip (a collective would hang)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

# An elastic run's driver ends the job at an epoch end so that the next runs on more workers
# (driver/elastic.py): the verdict's stopped_by, and the key of the epoch record it marks.
REGROUP = "regroup"
REGROUP_KEY = "regroup"


@dataclass
class EarlyStopping:
    """Patience over `metric` ("min": lower is better, "max": higher); improvements smaller than
    `min_delta` do not count. Its state is plain values, saved in checkpoints."""

    metric: str
    mode: str = "min"
    patience: int = 3
    min_delta: float = 0.0
    restore_best: bool = True
    best: float | None = None
    best_epoch: int = -1
    bad_epochs: int = 0

    @classmethod
    def of(cls, options: Mapping[str, Any] | None) -> "EarlyStopping | None":
        return cls(**options) if options else None

    def update(self, record: Mapping[str, Any]) -> tuple[bool, str | None]:
        """(this epoch is the best so far, the reason to stop now or None)."""
        value = record.get(self.metric)
        epoch = int(record.get("epoch", 0))
        if value is None or not math.isfinite(float(value)):
            self.bad_epochs += 1
            improved = False
        else:
            value = float(value)
            improved = self.best is None or (value < self.best - self.min_delta if self.mode == "min"
                                              else value > self.best + self.min_delta)
            if improved:
                self.best, self.best_epoch, self.bad_epochs = value, epoch, 0
            else:
                self.bad_epochs += 1
        if self.bad_epochs >= self.patience:
            best = "none" if self.best is None else f"{self.best:.6g} at epoch {self.best_epoch}"
            return improved, (f"{self.metric} did not improve by more than {self.min_delta:g} for {self.patience} "
                              f"epoch(s) (best {best})")
        return improved, None

    def state(self) -> dict[str, Any]:
        return {"best": self.best, "best_epoch": self.best_epoch, "bad_epochs": self.bad_epochs}

    def load(self, state: Mapping[str, Any]) -> None:
        self.best = state.get("best")
        self.best_epoch = int(state.get("best_epoch", -1))
        self.bad_epochs = int(state.get("bad_epochs", 0))


@dataclass(frozen=True)
class Verdict:
    stop: bool = False
    stopped_by: str = ""  # "early_stopping", "callback:<name>"
    reason: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def epoch_verdict(ctx: Any, record: dict[str, Any], early_reason: str | None) -> Verdict:
    """Rank 0 combines early stopping's decision with the driver's (when the fit has callbacks, it
    waits for them: a notebook decides on the epoch it has just seen); every rank gets rank 0's."""
    verdict = Verdict()
    if ctx.rank == 0:
        if early_reason is not None:
            verdict = Verdict(True, "early_stopping", early_reason)
        if ctx.spec.driver_callbacks and ctx.reporter is not None:
            # Peers wait in the agreement below, whose collective times out after launch.timeout_s:
            # give up on the driver first (and train on) rather than break the job.
            wait = 0.8 * ctx.spec.launch.timeout_s
            reply = ctx.reporter.ask_epoch(record, wait)
            if reply is None:
                print(f"sparkdl: WARNING the driver's callbacks gave no verdict on epoch {record.get('epoch')} within "
                      f"{wait:g} s (0.8 x launch.timeout_s); training goes on", flush=True)
            reply = reply or {}
            if reply.get("stop") and not verdict.stop:
                verdict = Verdict(True, str(reply.get("stopped_by", "callback")), str(reply.get("reason", "")))
        elif ctx.reporter is not None:
            ctx.reporter.epoch(record)
    if ctx.world_size == 1:
        return verdict
    agreed = ctx.comm.allgather_object((verdict.stop, verdict.stopped_by, verdict.reason))[0]
    return Verdict(bool(agreed[0]), str(agreed[1]), str(agreed[2]))


def stop_tags(history: list[dict[str, Any]]) -> dict[str, str]:
    """MLflow tags of a fit that stopped early (none when it ran every epoch)."""
    last = history[-1] if history else {}
    if not last.get("stopped_by"):
        return {}
    tags = {"stopped_by": str(last["stopped_by"]), "stop_reason": str(last.get("stop_reason", "")),
            "stopped_after_epoch": str(last.get("epoch"))}
    if last.get("restored_best"):
        tags["restored_best_epoch"] = str(last.get("best_epoch"))
    return tags
