"""Driver side of one fit's job attempts: submit with the driver channel open (progress, metrics,
rank 0's output, errors), retry an attempt whose ranks only lost a peer (checkpoints resume it), and
turn a failure into one error naming the rank, its host and the exception line.
"""
from __future__ import annotations

import logging
import sys
from typing import Any

from sparkdl.config import RunConfig

_log = logging.getLogger("sparkdl")


class Untracked:
    """The tracker of a job that is no MLflow run (a custom loop, the calibration probe): the driver
    channel still carries progress, output and errors; nothing is logged."""

    run_id: str | None = None
    tracking_uri: str | None = None

    def log_params(self, params: Any) -> None:
        """Nothing to log."""

    def log_metric_points(self, points: Any) -> None:
        """Nothing to log."""

    def log_text(self, text: str, artifact_file: str) -> None:
        """Nothing to log."""

    def finish(self, status: str = "FINISHED") -> None:
        """No run to end."""


def tracked_submit(spark: Any, job_df: Any, spec: Any, tracker: Any = None, callbacks: tuple[Any, ...] = ()
                   ) -> tuple[Any, list[dict[str, Any]]]:
    """Submit with the driver channel open: progress, metrics to MLflow (through `tracker`, a
    tracking.RunTracker; None for a job that is no MLflow run), rank 0's output, errors, and the
    live `callbacks` on every epoch record."""
    tracker = tracker if tracker is not None else Untracked()
    from dataclasses import replace

    from sparkdl.errors import TrainingError
    from sparkdl.launch.driver import submit
    from sparkdl.launch.monitor import RunMonitor

    config = spec.config
    monitor = RunMonitor(tracker, progress=config.tracking.progress, callbacks=callbacks)
    attempts = max_attempts(spark, config)
    from sparkdl import jvm

    jvm.drain_events(spark)  # only this job's events explain its failure
    try:
        with open_channel(spark, config.launch.channel, monitor.on_message) as channel:
            try:
                for attempt in range(1, attempts + 1):
                    try:
                        result, history, output = submit(spark, job_df, replace(spec, channel=channel.address))
                        break
                    except TrainingError as failure:
                        channel.drain()
                        monitor.flush()
                        if attempt == attempts or not retryable(monitor.errors):
                            raise
                        message = (f"sparkdl: attempt {attempt} of {attempts} failed ({str(failure).splitlines()[0]}); "
                                   f"retrying, every rank resumes from the latest checkpoint in "
                                   f"{config.train.checkpoint_dir}")
                        _log.info("%s", message)
                        print(message, file=sys.stderr, flush=True)
                        monitor.errors.clear()
            except TrainingError as exc:
                exc = explain_lost_executors(spark, exc)
                tracker.log_text(monitor.failure_report(), "failure.txt")
                tracker.finish("FAILED")
                named = name_the_failure(monitor.errors, spec.world_size, config, exc, monitor.rank_hosts)
                named.events = exc.events
                raise named from None
            except BaseException:
                tracker.finish("KILLED")  # interrupted (Ctrl-C, notebook stop): not left RUNNING
                raise
            channel.drain()
            address = channel.address
            monitor.replay(history, output, f"channel {address.host}:{address.port}" if address else
                           "launch.channel is off")
    finally:
        monitor.close()
    return result, history


class NoChannel:
    """launch.channel = "off": nothing listens; the history returned with the result is all there is."""

    address = None

    def drain(self, timeout: float = 5.0) -> None:
        """Nothing to wait for."""

    def __enter__(self) -> NoChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def open_channel(spark: Any, channel: str, on_message: Any) -> Any:
    """The driver channel of launch.channel: on the session's own address ("auto"), on a given host,
    or none ("off")."""
    if channel == "off":
        return NoChannel()
    from sparkdl.launch.channel import DriverChannel
    from sparkdl.session import facts

    return DriverChannel(facts(spark).channel_host() if channel == "auto" else channel, on_message)


def name_the_failure(errors: dict[int, dict[str, Any]], world_size: int, config: RunConfig, exc: Any,
                     rank_hosts: list[str] | None = None) -> Any:
    """The error to raise: the rank (and host) whose own exception started the failure with its
    exception line; or, when every report is a collective that timed out, the ranks that never
    reported: they stopped responding (a stalled process cannot say so itself)."""
    from sparkdl.errors import TrainingError

    own = sorted((rank, m) for rank, m in errors.items() if not m.get("peer_failure"))
    if own:
        rank, message = own[0]
    elif errors:
        texts = [str(m.get("text", "")).lower() for m in errors.values()]
        silent = [r for r in range(world_size) if r not in errors]
        if silent and all("timed out" in t or "timeout" in t for t in texts):
            waiting = sorted(errors)
            where = _on_hosts(silent, rank_hosts or [])
            return TrainingError(
                f"training failed: rank(s) {silent}{where} stopped responding; the collectives of rank(s) {waiting} "
                f"timed out after launch.timeout_s={config.launch.timeout_s:g} s",
                hint="an unreachable host (its network link or a firewall between the executors), a stalled or "
                     "swapped-out worker (see its executor's log), or a step longer than the timeout: raise "
                     "launch.timeout_s")
        rank, message = sorted(errors.items())[0]
    else:
        return exc
    text = str(message.get("text", "")).strip()
    line = text.splitlines()[0] if text else ""
    host = f" (on host {message['host']})" if message.get("host") else ""
    # A rank's own SparkdlError knows the fix better than the driver's generic hint.
    return TrainingError(f"training failed on rank {rank}: {line}{host}", hint=message.get("hint") or exc.hint)


def _on_hosts(ranks: list[int], rank_hosts: list[str]) -> str:
    """" (on host a, b)" for `ranks` whose executor address the driver heard, else ""."""
    known = [rank_hosts[r] for r in ranks if 0 <= r < len(rank_hosts)]
    return f" (on host {', '.join(dict.fromkeys(known))})" if known else ""


def explain_lost_executors(spark: Any, exc: Any) -> Any:
    """The job's BarrierWatch events on the error (`exc.events`), and executors lost during the job
    in its hint: a killed or out-of-memory executor shows in Spark's own message only as a closed
    connection."""
    from sparkdl import jvm

    jvm.wait_for_events(spark)
    events = jvm.drain_events(spark)
    lost = [e for e in events if e.get("event") == "executor_removed"]
    if lost:
        detail = "; ".join(f"executor {e.get('executor')} was lost: {e.get('reason')}" for e in lost)
        exc = type(exc)(exc.message, hint=f"{detail}. {exc.hint or ''}".strip())
    exc.events = events
    return exc


def max_attempts(spark: Any, config: RunConfig) -> int:
    """Attempts of one fit: with checkpoints, as many as Spark allows a stage
    (spark.stage.maxConsecutiveAttempts, 4 by default); without, one (a retry would start over)."""
    if not config.train.checkpoint_dir:
        return 1
    try:
        from sparkdl.session import facts

        return max(1, int(facts(spark).conf("spark.stage.maxConsecutiveAttempts", "4") or 4))
    except (TypeError, ValueError):
        return 4


def retryable(errors: dict[int, dict[str, Any]]) -> bool:
    """A failure worth another attempt: ranks only saw a peer vanish (a worker killed, an executor
    lost). Not a rank's own exception (it would fail again), nor a timeout (a stalled peer would
    stall again)."""
    texts = [str(m.get("text", "")) for m in errors.values()]
    if any(not m.get("peer_failure") for m in errors.values()):
        return False
    return not any("timeout" in t.lower() or "timed out" in t.lower() for t in texts)
