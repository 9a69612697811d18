"""Worker side of progress and metrics: rank 0 tells the driver how training goes.

Messages go through the driver channel's client, whose send() only enqueues: a slow or dead driver
never slows a training step. Step points are throttled to every `log_every` steps or one a second,
whichever comes first, so the progress bar moves without flooding the channel.
"""
from __future__ import annotations

import time
from typing import Any, Mapping

PROGRESS_INTERVAL_S = 1.0


class Reporter:
    def __init__(self, client: Any, rank: int, log_every: int) -> None:
        self.client = client if rank == 0 else None
        self.log_every = log_every
        self._last_sent = 0.0

    @property
    def active(self) -> bool:
        return self.client is not None

    def start(self, **fields: Any) -> None:
        if self.client is not None:
            self.client.send("start", **fields)

    def due(self, global_step: int, last_of_epoch: bool) -> bool:
        """Whether this step's point is sent; cheap, so the loop asks before computing metrics."""
        if self.client is None:
            return False
        return last_of_epoch or global_step % self.log_every == 0 or \
            time.monotonic() - self._last_sent >= PROGRESS_INTERVAL_S

    def step(self, global_step: int, metrics: Mapping[str, float], log: bool) -> None:
        """`log`: also an MLflow metric point (every log_every steps); otherwise progress only."""
        if self.client is not None:
            self._last_sent = time.monotonic()
            self.client.send("step", step=global_step, metrics=dict(metrics), log=log)

    def epoch(self, record: Mapping[str, Any]) -> None:
        if self.client is not None:
            self.client.send("epoch", record=dict(record))

    def ask_epoch(self, record: Mapping[str, Any], timeout: float) -> dict[str, Any] | None:
        """Send the epoch record and wait for the driver's verdict on it (its callbacks ran on it):
        {"stop": bool, "stopped_by": ..., "reason": ...}; None when the driver cannot be reached in time."""
        if self.client is None:
            return None
        return self.client.request("epoch", timeout, record=dict(record))
