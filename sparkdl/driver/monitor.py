"""Driver side of progress and metrics: consumes the driver channel's messages.

Runs on the channel's single consumer thread: moves the progress bar, logs metric points to the
MLflow run, echoes rank 0's output lines, and keeps what a failure report needs (every rank's
error, the tail of rank 0's log).
"""
from __future__ import annotations

import collections
import logging
import sys
import time
from typing import Any

from sparkdl.driver.attempt_world import AttemptWorlds

log = logging.getLogger("sparkdl")
LOG_TAIL_LINES = 200
FLUSH_INTERVAL_S = 5.0  # live enough for a dashboard; each write costs the driver ~10-20 ms CPU


class RunMonitor:
    def __init__(self, tracker: Any, progress: bool, callbacks: tuple[Any, ...] = (), regroup: Any = None) -> None:
        from sparkdl.executor.pace import Sustained  # stdlib only: the rule the ranks' records follow

        self.tracker = tracker
        self.progress = progress
        self.callbacks = callbacks  # train.callbacks, resolved (driver/callbacks.py)
        self.regroup = regroup  # an elastic run's "end this job, more workers are there" (driver/elastic.py)
        self.worlds = AttemptWorlds(tracker)  # each attempt's world in the MLflow run (driver/attempt_world.py)
        self.errors: dict[int, dict[str, Any]] = {}
        self.rank_hosts: list[str] = []  # each rank's executor address, from rank 0's start message
        self.log_tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self._bar: Any = None
        self._last_step = 0
        self._points: list[tuple[dict[str, float], int]] = []
        self._last_flush = time.monotonic()
        self._epochs_seen: set[int] = set()
        self._named_slow: set[int] = set()  # ranks already named as holding the others back
        self._slow_streaks = Sustained()  # epochs in a row each slow rank cost the run (executor/pace.py)
        self._drift_said = False  # the measured speeds' drift from the start is said once
        self._replans_said: set[int] = set()  # epochs after which a re-plan switched the sync, said once each
        self._wait_fraction: float | None = None  # the last epoch's share of step time spent waiting (progress bar)
        self._rendezvous_ports: dict[str, int] = {}  # stage attempt -> rank 0's port

    def on_message(self, message: dict[str, Any]) -> None:
        kind = message.get("kind")
        handler = getattr(self, f"_on_{kind}", None)
        if handler is not None:
            handler(message)

    def _on_rendezvous(self, message: dict[str, Any]) -> None:
        """Rank 0 says where it listens; the other ranks ask (executor/rendezvous.rendezvous_through_driver)."""
        key = str(message.get("key"))
        if message.get("port"):
            self._rendezvous_ports[key] = int(message["port"])
        reply = message.get("reply")
        if reply is not None:
            reply({"port": self._rendezvous_ports.get(key, 0)})

    def _on_start(self, message: dict[str, Any]) -> None:
        self.rank_hosts = [str(h) for h in message.get("rank_hosts", [])]
        # Each attempt's world (a retry or a resize starts another): params once, then metrics and tags.
        self.worlds.started(message)
        if self.progress:
            from tqdm.auto import tqdm

            total = int(message.get("epochs", 0)) * int(message.get("steps_per_epoch", 0))
            self._bar = tqdm(total=total, unit="step", desc="sparkdl", dynamic_ncols=True, leave=True)

    def _on_step(self, message: dict[str, Any]) -> None:
        step = int(message.get("step", 0))
        metrics = message.get("metrics", {})
        if self._bar is not None:
            self._bar.update(max(step - self._last_step, 0))
            waiting = {"waiting": f"{self._wait_fraction:.0%}"} if self._wait_fraction is not None else {}
            self._bar.set_postfix(epoch=int(metrics.get("epoch", 0)) + 1, loss=f"{metrics.get('loss', 0.0):.4f}",
                                  samples_s=f"{metrics.get('samples_per_sec', 0.0):.0f}", **waiting, refresh=False)
        self._last_step = max(step, self._last_step)
        if message.get("log"):
            # One MLflow write every few seconds, not per point: each write is a transaction on the
            # tracking store and costs the driver (and on local masters the workers) real CPU.
            self._points.append(({k: v for k, v in metrics.items() if k != "epoch"}, step))
            if time.monotonic() - self._last_flush >= FLUSH_INTERVAL_S or len(self._points) >= 200:
                self.flush()

    def _on_epoch(self, message: dict[str, Any]) -> None:
        record = message.get("record", {})
        epoch = int(record.get("epoch", 0))
        self._epochs_seen.add(epoch)
        names = ("loss", "samples_per_sec", "seconds", "bytes_sent", "lr", "data_seconds")
        point = {f"epoch_{k}": record[k] for k in names if k in record}
        point.update({k: record[k] for k in ("time_to_first_step_s", "spool_seconds") if k in record})
        point.update(memory_points(record))
        point.update(pace_points(record))
        point.update(replan_points(record))
        self.worlds.threads(record)
        self._name_slow_ranks(record)
        self._say_drift(record)
        self._say_fallback(record)
        self._say_replan(record)
        if "wait_fraction" in record:
            self._wait_fraction = float(record["wait_fraction"])
        self._show_epoch(record)
        # val_loss, val_accuracy and every val_<metric>: under the history's names, and epoch_-prefixed
        # like the other epoch curves
        validation = {k: v for k, v in record.items() if k.startswith("val_") and isinstance(v, (int, float))}
        point.update({**validation, **{f"epoch_{k}": v for k, v in validation.items()}})
        self._points.append((point, epoch))
        if time.monotonic() - self._last_flush >= FLUSH_INTERVAL_S:
            self.flush()
        reply = message.get("reply")
        if reply is not None:  # rank 0 waits: the callbacks decide whether the next epoch runs
            from sparkdl.driver.callbacks import run_callbacks

            self.flush()  # a callback reading the MLflow run sees this epoch
            verdict = run_callbacks(self.callbacks, record)
            if not verdict.get("stop") and self.regroup is not None:
                verdict = self.regroup(record) or verdict
            reply(verdict)

    def _show_epoch(self, record: dict[str, Any]) -> None:
        """The bar's figures from the epoch's record once it ends: the last line left on screen
        then says the epoch's loss (the history's and the epoch table's), not its last step's."""
        if self._bar is None or "loss" not in record:
            return
        waiting = {"waiting": f"{self._wait_fraction:.0%}"} if self._wait_fraction is not None else {}
        self._bar.set_postfix(epoch=int(record.get("epoch", 0)) + 1, loss=f"{float(record['loss']):.4f}",
                              samples_s=f"{float(record.get('samples_per_sec', 0.0)):.0f}", **waiting, refresh=True)

    def _say_drift(self, record: dict[str, Any]) -> None:
        """Measured speeds far from those the run started with (planner/uneven.py's bound), once. The
        rebalancer records it only at a re-split, which executor/pace.py's rule decides."""
        drift = record.get("speed_drift")
        if not drift or self._drift_said:
            return
        self._drift_said = True
        self._say(f"sparkdl: measured speeds left the run's starting point ({drift}); the batch is re-split "
                  f"by measured speed (batch_balance='dynamic'): rows per rank now {record.get('batch_rows_per_rank')}",
                  "speed_drift.txt")

    def _say_fallback(self, record: dict[str, Any]) -> None:
        """A resume that skipped damaged checkpoints (executor/checkpoint_report.py): said, kept as a
        text artifact and tagged, so the lost steps are not mistaken for a slow run."""
        from sparkdl.executor.checkpoint_report import fallback_report

        report = fallback_report(record)
        if report is not None:
            self._say(report.line, report.artifact)
            self.tracker.set_tags(report.tags)

    def _say_replan(self, record: dict[str, Any]) -> None:
        """A re-plan on drift (executor/replan.py): said once per switch, kept as a text artifact and
        tagged with where the sync changed."""
        switch = record.get("replanned")
        if not switch or int(switch.get("after_epoch", -1)) in self._replans_said:
            return
        after = int(switch["after_epoch"])
        self._replans_said.add(after)
        self._say(str(switch.get("reason", "")), f"replan_after_epoch_{after}.txt")
        self.tracker.set_tags({"sparkdl.replanned": "true", f"sparkdl.replan.after_epoch_{after}":
                               f"{switch.get('from')} -> {switch.get('to')}"})

    def _say(self, line: str, artifact: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)
        self.tracker.log_text(line + "\n", artifact)

    def _name_slow_ranks(self, record: dict[str, Any]) -> None:
        """A rank more than 1.5x slower than the median that costs the run by executor/pace.py's rule
        in WINDOW epochs in a row, once per rank and run."""
        from sparkdl.executor.pace import entry_cost, slow_rank_message

        entries = {int(e["rank"]): e for e in record.get("slow_ranks", [])}
        costs = {rank: cost for rank, e in entries.items() if (cost := entry_cost(e)) is not None}
        for rank in self._slow_streaks.update(costs):
            if rank in self._named_slow:
                continue
            self._named_slow.add(rank)
            self._say(slow_rank_message(entries[rank], float(record.get("wait_fraction", 0.0))),
                      f"slow_rank_{rank}.txt")

    def replay(self, history: list[dict[str, Any]], output: list[str], channel: str) -> None:
        """What never arrived live (the executors could not reach `channel`, or there was none), from
        the job's result: the epoch records' metrics, and the tail of rank 0's output (echoed, and
        kept in the MLflow run as rank0_output.txt)."""
        if output:
            for line in output:
                self._on_log({"rank": 0, "line": line})
            self.tracker.log_text("\n".join(output) + "\n", "rank0_output.txt")
        missing = [r for r in history if int(r.get("epoch", 0)) not in self._epochs_seen]
        if not missing:
            return
        log.warning("sparkdl: %d of %d epoch records did not arrive live (%s); their metrics are logged from "
                    "the job's result. Live progress, step metrics and callbacks need executors that reach "
                    "this client: see launch.channel", len(missing), len(history), channel)
        for record in missing:
            self._on_epoch({"record": record})
        self.flush()

    def flush(self) -> None:
        """Write the buffered metric points in one batch."""
        points, self._points = self._points, []
        self._last_flush = time.monotonic()
        if points:
            self.tracker.log_metric_points(points)

    def _on_log(self, message: dict[str, Any]) -> None:
        line = f"[rank {message.get('rank', '?')}] {message.get('line', '')}"
        self.log_tail.append(line)
        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def _on_error(self, message: dict[str, Any]) -> None:
        self.errors[int(message.get("rank", -1))] = message

    def root_error(self) -> tuple[int, str] | None:
        """The rank whose own failure (not a broken collective) started the run's failure."""
        own = [(rank, m) for rank, m in sorted(self.errors.items()) if not m.get("peer_failure")]
        chosen = own or sorted(self.errors.items())
        if not chosen:
            return None
        rank, message = chosen[0]
        return rank, str(message.get("text", ""))

    def failure_report(self) -> str:
        parts = []
        for rank, message in sorted(self.errors.items()):
            parts.append(f"== rank {rank}{' (broken by a peer)' if message.get('peer_failure') else ''} ==\n"
                         f"{message.get('text', '')}")
        parts.append(f"== last {len(self.log_tail)} log lines of rank 0 ==")
        parts.extend(self.log_tail)
        return "\n".join(parts)

    def close(self) -> None:
        self.flush()
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def pace_points(record: dict[str, Any]) -> dict[str, float]:
    """Each rank's speed and waits, and the share of step time spent waiting, as MLflow metrics."""
    points: dict[str, float] = {}
    if "wait_fraction" in record:
        points["epoch_wait_fraction"] = float(record["wait_fraction"])
    for name in ("rows_per_compute_s", "compute_seconds", "wait_seconds"):
        for rank, value in enumerate(record.get(f"{name}_by_rank", [])):
            points[f"{name}_rank_{rank}"] = float(value)
    return points


def replan_points(record: dict[str, Any]) -> dict[str, float]:
    """Under a re-planning run: the epoch's measured and predicted step and its sync (1 = DiLoCo)."""
    if "sync" not in record:
        return {}
    points = {"epoch_sync_diloco": 1.0 if record["sync"] == "diloco" else 0.0}
    for name in ("step_measured_s", "step_predicted_s"):
        if name in record:
            points[f"epoch_{name[:-2]}_ms"] = 1e3 * float(record[name])
    return points


def memory_points(record: dict[str, Any]) -> dict[str, float]:
    """The ranks' own peak memory as MLflow metrics: the largest, and each rank's."""
    points: dict[str, float] = {}
    for name in ("peak_rss_bytes", "cuda_peak_bytes"):
        if f"max_{name}_per_rank" in record:
            points[f"max_{name}_per_rank"] = float(record[f"max_{name}_per_rank"])
        for rank, value in enumerate(record.get(f"{name}_by_rank", [])):
            points[f"{name}_rank_{rank}"] = float(value)
    return points
