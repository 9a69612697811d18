"""The rule every MLflow call of a run follows when it fails (tracking/mlflow_run.py): training
never stops for tracking, and one failed call never turns tracking off for the rest of the run.

- A call that fails is tried once more after a short pause, while the run's calls were succeeding
  (a blip: a restarting server, a dropped connection). Once calls fail, each later call is tried
  once: a server that is down costs every call one try (MLflow's own HTTP retries included), not two.
- A refusal (HTTP 4xx but 429: a bad value, a param MLflow will not change) is never tried again:
  the same request would be refused the same way.
- The first failure is said once (a warning on the log and a Python warning a notebook shows);
  later ones go to the debug log and are counted (`failures`, the run's tag sparkdl.tracking_failures).
- Every later call is still made: a server that comes back gets the rest of the run. Only the
  frequent, deferrable ones (metric points, every few seconds) wait `resting()` after a failure:
  they are kept and go with the first call after it, so a dead server does not hold the driver's
  channel thread for seconds at every flush.

Standard library only: the unit tests drive it with a fake failing client.
"""
from __future__ import annotations

import logging
import time
import warnings
from typing import Any, Callable, Literal

log = logging.getLogger("sparkdl")

Outcome = Literal["ok", "refused", "failed"]
RETRY_PAUSE_S = 1.0
REST_S = 30.0  # how long deferrable calls wait after a failure before trying again


def refused(exc: BaseException) -> bool:
    """A request the server answered with a refusal (4xx but 429, "too many requests"): retrying
    the same request cannot help. MLflow's exceptions map their error code to an HTTP status."""
    status = getattr(exc, "get_http_status_code", None)
    try:
        code = int(status()) if callable(status) else 0
    except Exception:  # noqa: BLE001 - a status we cannot read is no refusal
        return False
    return 400 <= code < 500 and code != 429


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


class CallGuard:
    """Runs one tracker's MLflow calls under the rule above; `failures` counts the calls that failed."""

    def __init__(self, pause_s: float = RETRY_PAUSE_S, sleep: Callable[[float], None] = time.sleep,
                 redact: Callable[[str], str] = lambda text: text, rest_s: float = REST_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pause_s, self.rest_s = pause_s, rest_s
        self.sleep, self.clock = sleep, clock
        self.failed_at = float("-inf")  # when the last call failed (clock)
        self.redact = redact  # error texts echo URIs (tracking/redaction.py)
        self.failures = 0
        self.healthy = True  # the last call succeeded (or none was made): a failure gets one more try
        self.said = False

    def call(self, what: str, action: Callable[[], Any], retry: bool = True) -> Outcome:
        """`action()` under the rule; `retry=False` for a call that must not run twice (it would
        log a second copy when the first one landed but its answer was lost)."""
        tries = 2 if retry and self.healthy else 1
        for attempt in range(tries):
            try:
                action()
            except Exception as exc:  # noqa: BLE001 - tracking must never stop training
                if refused(exc):
                    self._failed(what, exc, "refused")
                    return "refused"
                if attempt + 1 < tries:
                    log.debug("sparkdl: MLflow call failed (%s: %s); trying once more", what, first_line(exc))
                    self.sleep(self.pause_s)
                    continue
                self._failed(what, exc, "failed")
                return "failed"
            else:
                self.healthy = True
                return "ok"
        return "failed"  # pragma: no cover - the loop returns on its last try

    def resting(self) -> bool:
        """A deferrable call should wait: calls are failing and the last failed under rest_s ago."""
        return not self.healthy and self.clock() - self.failed_at < self.rest_s

    def _failed(self, what: str, exc: BaseException, outcome: Outcome) -> None:
        self.failures += 1
        if outcome == "failed":
            self.healthy = False
            self.failed_at = self.clock()
        text = self.redact(f"{type(exc).__name__}: {first_line(exc)}")
        if self.said:
            log.debug("sparkdl: MLflow call failed again (could not %s: %s)", what, text)
            return
        self.said = True
        message = (f"sparkdl: MLflow tracking failed (could not {what}: {text}); training goes on, the metrics "
                   "stay in model.history, and the run's later MLflow calls are still made (this is said once; "
                   "the run's tag sparkdl.tracking_failures counts the failed calls)")
        log.warning(message)
        # MLflow reconfigures logging on import; a Python warning reaches notebooks and terminals.
        warnings.warn(message, RuntimeWarning, stacklevel=4)
