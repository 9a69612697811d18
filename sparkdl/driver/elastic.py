"""Driver side of spot-safe runs (launch.min_workers / max_workers / grow_workers): how many workers
a run goes on with after losing hosts, when it grows back, the per-rank batch that keeps the global
batch, and the record of every change of membership.

The flow (driver/attempts.py): an attempt fails -> Spark's executor-lost event or the collectives'
launch.timeout_s detected it -> wait up to launch.replacement_wait_s for the slots the run had ->
fewer: the entry point re-plans and re-shards the data for that many workers (api.py), and the
ranks resume the latest checkpoint at the new size (executor/reshape.py). Growing: rank 0 asks the
driver at every epoch end; once slots are back (and grow_workers), the job checkpoints, ends, and
the next one runs on up to max_workers. The bound from a host's loss to training again is the
detection + the replacement wait + one restart (slots check, job start, resume).
"""
from __future__ import annotations

import logging
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from sparkdl.config.elastic import worker_range
from sparkdl.errors import TrainingError

from sparkdl.wire.stopping import REGROUP, REGROUP_KEY  # the verdict that ends a job for more workers
SLOT_POLL_S = 0.5
_log = logging.getLogger("sparkdl")


def say(message: str) -> None:
    """A line for the user: the driver's log and stderr (a notebook cell shows it)."""
    _log.info("%s", message)
    print(message, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class MembershipChange:
    """One change of the run's workers, as the history, MLflow and the progress output show it."""

    time: float  # unix seconds
    from_workers: int
    to_workers: int
    hosts_left: tuple[str, ...]
    hosts_joined: tuple[str, ...]
    reason: str
    per_rank_batch: int
    global_batch: int

    def record(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    def line(self) -> str:
        moved = "; ".join(part for part in (f"left: {', '.join(self.hosts_left)}" if self.hosts_left else "",
                                            f"joined: {', '.join(self.hosts_joined)}" if self.hosts_joined else "")
                          if part)
        return (f"sparkdl: workers {self.from_workers} -> {self.to_workers} ({self.reason}{'; ' + moved if moved else ''}); "
                f"{self.per_rank_batch} rows a rank and step, global batch {self.global_batch}; resuming from the "
                "latest checkpoint")


def kept_batch(global_batch: int, accumulate: int, workers: int) -> int:
    """Rows per rank and step that keep `global_batch` (rows per optimizer step over all ranks) on
    `workers` ranks accumulating `accumulate` micro-batches; the nearest below when it does not
    divide (the change record shows the global batch the run then trains with)."""
    return max(1, global_batch // (workers * accumulate))


def slots_after_loss(count_slots: Callable[[], int], wanted: int, wait_s: float) -> int:
    """The slots Spark offers once `wanted` are there or `wait_s` has passed (replacement executors
    register over seconds to minutes)."""
    deadline = time.monotonic() + wait_s
    while True:
        slots = count_slots()
        if slots >= wanted or time.monotonic() >= deadline:
            return slots
        time.sleep(SLOT_POLL_S)


def shrunk_world(launch: Any, slots: int, workers: int, hosts_left: list[str], waited_s: float) -> int:
    """The world the run goes on with after a loss: the slots there are, at most `workers`; below
    launch.min_workers a TrainingError naming the hosts lost and the slots found."""
    low, _ = worker_range(launch)
    if slots >= low:
        return min(slots, workers)
    raise below_min_workers(launch, slots, workers, hosts_left,
                            f"waiting launch.replacement_wait_s={waited_s:g} s for replacements")


def below_min_workers(launch: Any, slots: int, workers: int, hosts_left: list[str], waited: str) -> TrainingError:
    """The error of a run that lost hosts and cannot go on: fewer slots than launch.min_workers
    (num_workers when unset: a run of fixed size goes on only with all of them)."""
    low, _ = worker_range(launch)
    lost = f"lost host(s) {', '.join(hosts_left)}" if hosts_left else "lost executors"
    fixed = low >= launch.num_workers
    unset = " (unset: num_workers)" if not launch.min_workers else ""
    hint = ("bring the hosts back (or add executors) and fit again: with the same checkpoint_dir and "
            "train.resume_run the run continues from its latest checkpoint; ")
    hint += ("or set min_workers below num_workers so the run goes on with the slots there are" if fixed
             else "or lower min_workers")
    return TrainingError(f"the run {lost}: {slots} slot(s) found after {waited}, fewer than "
                         f"launch.min_workers={low}{unset} (it had {workers})",
                         hint=hint)


def hosts_lost(rank_hosts: list[str], executor_hosts: list[str]) -> list[str]:
    """The hosts the ranks ran on that no executor is on now; [] when the executors are unknown
    (Spark Connect) or every host still has one (on one machine, executors lost leave its host)."""
    return [h for h in hosts_of(rank_hosts) if executor_hosts and h not in executor_hosts]


def executor_hosts(spark: Any) -> list[str]:
    """The hosts of the application's executors now; [] when Spark does not say (Spark Connect)."""
    from sparkdl.spark.session import facts

    try:
        return hosts_of(list(facts(spark).executors()))
    except Exception:  # noqa: BLE001 - no executor list (Spark Connect): hosts unknown
        return []


def lost_below_minimum(spark: Any, launch: Any, workers: int, rank_hosts: list[str], waited: str) -> TrainingError:
    """The error of a run of fixed size (min_workers = num_workers) that lost hosts: fewer slots than
    it had after `waited`, naming the hosts lost and min_workers (final: late rank reports must not
    rename it)."""
    from sparkdl.driver.job import concurrent_slots

    error = below_min_workers(launch, concurrent_slots(spark, None, workers), workers,
                              hosts_lost(rank_hosts, executor_hosts(spark)), waited)
    error.final = True
    return error


def fixed_world_after_loss(spark: Any, launch: Any, workers: int, rank_hosts: list[str]) -> None:
    """Before a run of fixed size resubmits a failed attempt: wait up to launch.replacement_wait_s for
    the slots it had (one py4j call when they are there); fewer, the run cannot go on: the error
    naming the hosts lost and min_workers (not the slot check's, after its longer slot_wait_s)."""
    from sparkdl.driver.job import concurrent_slots

    wait = float(launch.replacement_wait_s)
    if slots_after_loss(lambda: concurrent_slots(spark, None, workers), workers, wait) < workers:
        raise lost_below_minimum(spark, launch, workers, rank_hosts,
                                 f"waiting launch.replacement_wait_s={wait:g} s for replacements")


def grown_world(launch: Any, slots: int, workers: int) -> int:
    """The world to grow to when `slots` are offered: more than `workers`, at most max_workers;
    `workers` when there is nothing to grow into."""
    _, high = worker_range(launch)
    return max(workers, min(slots, high)) if launch.grow_workers else workers


def hosts_of(executors: list[str]) -> list[str]:
    """Host names of executor host:port addresses, in order, once each."""
    return list(dict.fromkeys(e.rsplit(":", 1)[0] for e in executors))



def log_change(tracker: Any, change: MembershipChange, changes: list[MembershipChange]) -> None:
    """MLflow: the workers as a metric over the changes (step 0: the workers the run started with,
    step n: after the n-th change), every change so far as membership.json."""
    import json

    start = [({"workers": float(changes[0].from_workers)}, 0)] if len(changes) == 1 else []
    tracker.log_metric_points([*start, ({"workers": float(change.to_workers)}, len(changes))])
    tracker.log_text(json.dumps([c.record() for c in changes], indent=1), "membership.json")


class Resizing:
    """One elastic fit's changes of size, for driver/attempts.tracked_submit: `resize(workers,
    change)` (the entry point's re-plan) gives the job DataFrame and spec for another size."""

    def __init__(self, spark: Any, resize: Callable[[int, MembershipChange], tuple[Any, Any]], tracker: Any,
                 spec: Any, job_df: Any) -> None:
        self.spark, self.resize, self.tracker = spark, resize, tracker
        self.launch, self.epochs = spec.launch, spec.train.epochs
        self.job_df = job_df
        self.changes: list[MembershipChange] = []
        self.workers = spec.world_size

    def started(self, workers: int) -> None:
        self.workers = workers

    def count_slots(self) -> int:
        from sparkdl.driver.job import concurrent_slots

        return concurrent_slots(self.spark, None, self.workers)

    def executor_hosts(self) -> list[str]:
        return executor_hosts(self.spark)

    def after_loss(self, spec: Any, rank_hosts: list[str]) -> tuple[Any, Any]:
        """After a failed attempt: wait for replacements, then go on with the slots there are (raises
        below min_workers). Same size: the spec as it is (the next attempt resumes its checkpoint)."""
        wait = float(self.launch.replacement_wait_s)
        slots = slots_after_loss(self.count_slots, spec.world_size, wait)
        left = hosts_lost(rank_hosts, self.executor_hosts())
        workers = shrunk_world(self.launch, slots, spec.world_size, left, wait)
        if workers == spec.world_size:
            return self.job_df, spec
        return self._change(spec, workers, "hosts lost" if left else "executors lost", left, [])

    def regroup(self, record: dict[str, Any]) -> dict[str, Any] | None:
        """At an epoch end (rank 0 waits for this): end the job so the next one grows, when
        grow_workers and more slots are there than the run has; None to go on."""
        if not self.launch.grow_workers or int(record.get("epoch", 0)) + 1 >= self.epochs:
            return None
        workers = int(record.get("workers", self.workers))
        grown = grown_world(self.launch, self.count_slots(), workers)
        if grown <= workers:
            return None
        return {"stop": True, "stopped_by": REGROUP, "reason": f"{grown - workers} slot(s) back: {workers} -> {grown}"}

    def grow(self, spec: Any, rank_hosts: list[str]) -> tuple[Any, Any]:
        grown = grown_world(self.launch, self.count_slots(), spec.world_size)
        if grown <= spec.world_size:  # the slots went again: the same size resumes its checkpoint
            return self.job_df, spec
        there = self.executor_hosts()
        joined = [h for h in there if h not in hosts_of(rank_hosts)]
        return self._change(spec, grown, "slots returned", [], joined)

    def _change(self, spec: Any, workers: int, reason: str, left: list[str], joined: list[str]) -> tuple[Any, Any]:
        probe = MembershipChange(time.time(), spec.world_size, workers, tuple(left), tuple(joined), reason, 0, 0)
        self.job_df, resized = self.resize(workers, probe)
        data, train = resized.data, resized.train
        change = MembershipChange(probe.time, spec.world_size, workers, tuple(left), tuple(joined), reason,
                                  data.batch_size, data.batch_size * workers * train.accumulate_steps)
        self.changes.append(change)
        say(change.line())
        log_change(self.tracker, change, self.changes)
        self.workers = workers
        return self.job_df, resized

    def annotate(self, history: list[dict[str, Any]]) -> None:
        """Every change on the first epoch record trained after it, as a list (`membership`): the
        ranks mark the epoch they resumed at another size with `resized_from_workers`, and changes
        whose attempt never finished an epoch (grown, then a host lost again) go with the next."""
        pending = list(self.changes)
        for record in history:
            if "resized_from_workers" not in record or not pending:
                continue
            landed = next((i for i, c in enumerate(pending) if c.from_workers == record["resized_from_workers"]
                           and c.to_workers == record.get("workers")), len(pending) - 1)
            record["membership"] = [c.record() for c in pending[: landed + 1]]
            del pending[: landed + 1]
