"""Driver side of one fit's job attempts: submit with the driver channel open (progress, metrics,
rank 0's output, errors), retry an attempt whose ranks only lost a peer or whose silent ranks' hosts
the network cut off (checkpoints resume it), and turn a failure into one error naming the rank, its
host and the exception line.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Iterator

from sparkdl.driver.elastic import REGROUP_KEY, Resizing, fixed_world_after_loss, lost_below_minimum, say as _say


_log = logging.getLogger("sparkdl")
HOST_DIAL_S = 3.0  # a host that answers at all does so in milliseconds
HOST_RETURN_POLL_S = 1.0


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

    def set_tags(self, tags: Any) -> None:
        """Nothing to tag."""

    def finish(self, status: str = "FINISHED") -> None:
        """No run to end."""

    @contextlib.contextmanager
    def ends_failed(self) -> Iterator[Untracked]:
        """No run to mark failed."""
        yield self


def tracked_submit(spark: Any, job_df: Any, spec: Any, tracker: Any = None, callbacks: tuple[Any, ...] = (),
                   resize: Any = None) -> tuple[Any, list[dict[str, Any]]]:
    """Submit with the driver channel open: progress, metrics to MLflow (through `tracker`, a
    tracking.RunTracker; None for a job that is no MLflow run), rank 0's output, errors, and the
    live `callbacks` on every epoch record. `resize(workers, change)` -> (job_df, spec) re-plans an
    elastic run for another number of workers (driver/elastic.py); None: a run of fixed size."""
    tracker = tracker if tracker is not None else Untracked()
    from dataclasses import replace

    from sparkdl.errors import ResourceError, TrainingError
    from sparkdl.driver.job import submit
    from sparkdl.driver.monitor import RunMonitor

    resizing = Resizing(spark, resize, tracker, spec, job_df) if resize is not None else None
    monitor = RunMonitor(tracker, progress=spec.tracking.progress, callbacks=callbacks,
                         regroup=resizing.regroup if resizing is not None else None)
    attempts = max_attempts(spark, spec.train.checkpoint_dir)
    from sparkdl.spark import jvm

    jvm.drain_events(spark)  # only this job's events explain its failure
    cut_off: dict[int, str] = {}  # of the last failed attempt
    try:
        # Any exception ends the MLflow run FAILED (Ctrl-C and a notebook's stop too): never left RUNNING.
        with open_channel(spark, spec.launch.channel, monitor.on_message, spec.world_size) as channel, \
                tracker.ends_failed():
            try:
                attempt = 0
                while True:
                    attempt += 1
                    try:
                        if resizing is not None:
                            resizing.started(spec.world_size)
                        result, history, output = submit(spark, job_df, replace(spec, channel=channel.address))
                    except (TrainingError, ResourceError) as failure:
                        channel.drain()
                        monitor.flush()
                        cut_off = failed_attempt_cut_off(spark, failure, monitor, spec, resizing, attempt)
                        if attempt >= attempts or not (isinstance(failure, ResourceError)
                                                       or retryable(monitor.errors) or cut_off):
                            raise TrainingError(failure.message, hint=failure.hint) \
                                if isinstance(failure, ResourceError) else failure
                        job_df, spec = retry_after(spark, failure, (attempt, attempts), monitor, spec, job_df, resizing,
                                                   cut_off)
                        continue
                    if resizing is not None and history and history[-1].get(REGROUP_KEY):
                        job_df, spec = resizing.grow(spec, monitor.rank_hosts)
                        attempt = 0  # growing is no failure
                        continue
                    break
            except TrainingError as exc:
                raise failed_run(spark, exc, tracker, monitor, spec, cut_off) from None
            channel.drain()
            address = channel.address
            monitor.replay(history, output, f"channel {address.host}:{address.port}" if address else
                           "launch.channel is off")
    finally:
        monitor.close()
    if resizing is not None:
        resizing.annotate(history)
    return result, history


def failed_run(spark: Any, exc: Any, tracker: Any, monitor: Any, spec: Any, cut_off: dict[int, str]) -> Exception:
    """The run's error, its MLflow run marked FAILED with failure.txt: named from every rank's report
    unless it is final (an elastic re-plan's own words)."""
    final = getattr(exc, "final", False)
    exc = explain_lost_executors(spark, exc)
    tracker.log_text(monitor.failure_report(), "failure.txt")
    tracker.finish("FAILED")
    named = exc if final else name_the_failure(
        monitor.errors, spec.world_size, spec.launch.timeout_s, exc, monitor.rank_hosts, cut_off)
    named.events = exc.events
    return named


def failed_attempt_cut_off(spark: Any, failure: Exception, monitor: Any, spec: Any, resizing: Any,
                           attempt: int = 1) -> dict[int, str]:
    """The ranks the network cut off in a failed attempt ({} for lost slots). Lost slots of a run of
    fixed size are its error: on a retry (executors were lost since the run started) a TrainingError
    naming the hosts lost and min_workers, on the first attempt the slot check's own error."""
    from sparkdl.errors import ResourceError

    if isinstance(failure, ResourceError):
        if resizing is None:
            raise lost_below_minimum(spark, spec.launch, spec.world_size, monitor.rank_hosts,
                                     "the resubmitted job's slot check (launch.slot_wait_s)") \
                if attempt > 1 else failure
        return {}
    return cut_off_ranks(spark, monitor.errors, spec.world_size, monitor.rank_hosts)


def retry_after(spark: Any, failure: Exception, counts: tuple[int, int], monitor: Any, spec: Any, job_df: Any,
                resizing: Any, cut_off: dict[int, str]) -> tuple[Any, Any]:
    """Say the failed attempt (`counts`: this attempt and how many there may be), then ready the
    next: re-plan an elastic run for the workers left, wait for cut-off hosts to answer again, or
    for a run of fixed size the replacements of lost executors. Returns the (job_df, spec) to submit."""
    attempt, attempts = counts
    from sparkdl.errors import ResourceError, TrainingError

    named = failure if isinstance(failure, ResourceError) else name_the_failure(
        monitor.errors, spec.world_size, spec.launch.timeout_s, failure, monitor.rank_hosts, cut_off)
    _say(f"sparkdl: attempt {attempt} of {attempts} failed ({str(named).splitlines()[0]}); "
         f"retrying, every rank resumes from the latest checkpoint in {spec.train.checkpoint_dir}")
    monitor.errors.clear()  # reported above; an error of the resize is its own
    if resizing is not None:
        try:
            return resizing.after_loss(spec, monitor.rank_hosts)
        except TrainingError as below:
            below.final = True  # its own words: late rank reports must not rename it
            raise
    if cut_off:
        wait_for_hosts(cut_off, spec.launch.timeout_s)
    else:  # executors lost: their replacements, or the error naming the hosts lost and min_workers
        fixed_world_after_loss(spark, spec.launch, spec.world_size, monitor.rank_hosts)
    return job_df, spec


class NoChannel:
    """launch.channel = "off": nothing listens; the history returned with the result is all there is."""

    address = None

    def drain(self, timeout: float = 5.0) -> None:
        """Nothing to wait for."""

    def __enter__(self) -> NoChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def open_channel(spark: Any, channel: str, on_message: Any, ranks: int = 0) -> Any:
    """The driver channel of launch.channel: on the session's own address ("auto"), on a given host,
    or none ("off"); room for `ranks` hellos at once (wire/admission.py)."""
    if channel == "off":
        return NoChannel()
    from sparkdl.driver.channel import DriverChannel
    from sparkdl.spark.session import facts
    from sparkdl.wire.admission import AdmissionLimits

    return DriverChannel(facts(spark).channel_host() if channel == "auto" else channel, on_message,
                         limits=AdmissionLimits().for_ranks(ranks))


def silent_ranks(errors: dict[int, dict[str, Any]], world_size: int) -> list[int]:
    """The ranks that reported nothing while every report is a collective that timed out: they
    stopped responding (a stalled or cut-off process cannot say so itself); [] otherwise."""
    if not errors or any(not m.get("peer_failure") for m in errors.values()):
        return []
    texts = [str(m.get("text", "")).lower() for m in errors.values()]
    if not all("timed out" in t or "timeout" in t for t in texts):
        return []
    return [r for r in range(world_size) if r not in errors]


def cut_off_ranks(spark: Any, errors: dict[int, dict[str, Any]], world_size: int,
                  rank_hosts: list[str]) -> dict[int, str]:
    """Silent ranks whose host the driver cannot reach either ({rank: the endpoint it dialled}): no
    executor there answers a TCP connection within HOST_DIAL_S. The network cut them off (a link
    down, a firewall), where a stalled rank's host would still answer."""
    from sparkdl.comm.reachability import host_answers
    from sparkdl.spark.session import facts

    silent = [r for r in silent_ranks(errors, world_size) if r < len(rank_hosts)]
    if not silent:
        return {}
    try:
        endpoints = facts(spark).executors()
    except Exception:  # noqa: BLE001 - no list of executors (Connect): nothing to dial
        return {}
    answered: dict[str, bool] = {}
    cut_off = {}
    for rank in silent:
        host = rank_hosts[rank]
        there = [e for e in endpoints if e.rsplit(":", 1)[0] == host]
        if there and host not in answered:
            answered[host] = any(host_answers(e, HOST_DIAL_S) for e in there)
        if there and not answered[host]:
            cut_off[rank] = there[0]
    return cut_off


def wait_for_hosts(cut_off: dict[int, str], timeout_s: float) -> None:
    """Before resubmitting: until every cut-off host answers again, for at most `timeout_s` (then
    Spark places the ranks on the executors it can reach)."""
    from sparkdl.comm.reachability import host_answers

    pending = set(cut_off.values())
    _say(f"sparkdl: waiting up to {timeout_s:g} s for {', '.join(sorted(pending))} to be reachable again")
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        pending = {e for e in pending if not host_answers(e, min(HOST_DIAL_S, max(deadline - time.monotonic(), 0.1)))}
        if pending:
            time.sleep(HOST_RETURN_POLL_S)
    if not pending:
        _say("sparkdl: reachable again; resubmitting")


def name_the_failure(errors: dict[int, dict[str, Any]], world_size: int, timeout_s: float, exc: Any,
                     rank_hosts: list[str] | None = None, cut_off: dict[int, str] | None = None) -> Any:
    """The error to raise: the rank (and host) whose own exception started the failure with its
    exception line; or, when every report is a collective that timed out, the ranks that never
    reported: cut off from the network (`cut_off`, the endpoints the driver dialled in vain) or
    stopped responding (a stalled process cannot say so itself)."""
    from sparkdl.errors import TrainingError

    own = sorted((rank, m) for rank, m in errors.items() if not m.get("peer_failure"))
    silent = silent_ranks(errors, world_size)
    if own:
        rank, message = own[0]
    elif silent and cut_off and set(silent) <= set(cut_off):
        where = _on_hosts(silent, rank_hosts or [])
        dialled = ", ".join(sorted(set(cut_off.values())))
        return TrainingError(
            f"training failed: rank(s) {silent}{where} cannot be reached: the driver dialled {dialled} and "
            f"nothing answered within {HOST_DIAL_S:g} s; the collectives of rank(s) {sorted(errors)} timed out "
            f"after launch.timeout_s={timeout_s:g} s",
            hint="the host's network link is down or a firewall drops its traffic: restore it and fit again; "
                 "with train.checkpoint_dir on storage every host shares, sparkdl retries by itself and the "
                 "ranks resume from the latest checkpoint once the host is back")
    elif errors:
        if silent:
            waiting = sorted(errors)
            where = _on_hosts(silent, rank_hosts or [])
            return TrainingError(
                f"training failed: rank(s) {silent}{where} stopped responding; the collectives of rank(s) {waiting} "
                f"timed out after launch.timeout_s={timeout_s:g} s",
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
    named = TrainingError(f"training failed on rank {rank}: {line}{host}", hint=message.get("hint") or exc.hint)
    named.rank, named.rank_text = rank, text  # the exception line and the rank's traceback (sparkdl.compat)
    return named


def _on_hosts(ranks: list[int], rank_hosts: list[str]) -> str:
    """" (on host a, b)" for `ranks` whose executor address the driver heard, else ""."""
    known = [rank_hosts[r] for r in ranks if 0 <= r < len(rank_hosts)]
    return f" (on host {', '.join(dict.fromkeys(known))})" if known else ""


def explain_lost_executors(spark: Any, exc: Any) -> Any:
    """The job's BarrierWatch events on the error (`exc.events`), and executors lost during the job
    in its hint: a killed or out-of-memory executor shows in Spark's own message only as a closed
    connection."""
    from sparkdl.spark import jvm

    jvm.wait_for_events(spark)
    events = jvm.drain_events(spark)
    lost = [e for e in events if e.get("event") == "executor_removed"]
    if lost:
        detail = "; ".join(f"executor {e.get('executor')} was lost: {e.get('reason')}" for e in lost)
        exc = type(exc)(exc.message, hint=f"{detail}. {exc.hint or ''}".strip())
    exc.events = events
    return exc


def max_attempts(spark: Any, checkpoint_dir: str | None) -> int:
    """Attempts of one fit: with checkpoints, as many as Spark allows a stage
    (spark.stage.maxConsecutiveAttempts, 4 by default); without, one (a retry would start over)."""
    if not checkpoint_dir:
        return 1
    try:
        from sparkdl.spark.session import facts

        return max(1, int(facts(spark).conf("spark.stage.maxConsecutiveAttempts", "4") or 4))
    except (TypeError, ValueError):
        return 4


def retryable(errors: dict[int, dict[str, Any]]) -> bool:
    """A failure worth another attempt: ranks only saw a peer vanish (a worker killed, an executor
    lost), or an error the rank reported retryable (storage that did not answer a checkpoint read).
    Not a rank's own exception (it would fail again), nor a timeout (a stalled peer would stall again)."""
    texts = [str(m.get("text", "")) for m in errors.values() if not m.get("retryable")]
    if any(not (m.get("peer_failure") or m.get("retryable")) for m in errors.values()):
        return False
    return not any("timeout" in t.lower() or "timed out" in t.lower() for t in texts)
