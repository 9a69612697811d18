"""Threads of a training rank: torch's intra-op threads as Spark allots the task's CPUs.

One rule, one home. executor/worker.py sets every rank's threads with `threads_for_rank`, the
calibration probe's ranks included (driver/probe.py runs through the same worker and reports what
its ranks got), so the planner profiles compute with the threads training will use.

- launch.threads_per_worker set: that count, as given (the user knows their hosts).
- "auto" (unset): the CPUs Spark gave the task, `TaskContext.cpus()`: spark.task.cpus, or the task
  CPUs of the stage's ResourceProfile. `resources()` does not hold CPUs (only custom resources such
  as "gpu"), so cpus() is the one source. Where the driver knows the executors' cores (local[N]: N;
  local-cluster[n,c,m]: c; spark.executor.cores), a rank gets its share of its executor's cores when
  that is more: the barrier job's ranks are the executor's only work, and a 4-core executor holding
  one rank should not leave 3 cores idle because spark.task.cpus is 1. Deriving threads from the
  host's core count instead oversubscribes whenever the executors' cores differ from cores / ranks.
- Never more than the process may run on: its cgroup's CPU quota (v2 cpu.max, v1
  cpu.cfs_quota_us; an executor's container) shared by the job's ranks in the same executor, and its
  affinity mask (the host's CPUs) shared by the job's ranks on the host. An executor that declares 1
  core in a container capped at 0.2 cores runs 1 thread, not 2; two executors of 2 cores on a 2-core
  machine run 1 thread each.
- Outside a Spark task (no cpus() figure): the usable CPUs shared by the ranks on the host.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkdl.config.threads import threads_option

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
DEFAULT_PERIOD_US = 100_000.0  # cgroup v2's cpu.max period when the file omits it


@dataclass(frozen=True)
class CpuFacts:
    """What the rule reads about one rank's CPUs."""

    task_cpus: int | None  # Spark's allotment to this task (TaskContext.cpus()); None: not known
    usable_cpus: float | None  # cores this process may run on: min(affinity, cgroup quota); None: not known
    ranks_on_executor: int = 1  # ranks of this job in this rank's executor: they share its cgroup
    ranks_on_host: int = 1  # ranks of this job on this rank's host
    executor_cores: int | None = None  # each executor's cores as the driver's conf says; None: not known
    host_cpus: float | None = None  # the host's CPUs this process may run on (affinity); None: not known


def rank_threads(option: Any, facts: CpuFacts) -> int:
    """torch intra-op threads of one rank (the module docstring has the rule). A bad `option` is a
    ConfigError naming launch.threads_per_worker."""
    configured = threads_option(option)
    if configured is not None:
        return configured
    if facts.task_cpus is None or facts.task_cpus < 1:  # no Spark figure: the old even share of the host
        return _share(facts.usable_cpus, facts.ranks_on_host) or 1
    allotted = facts.task_cpus
    if facts.executor_cores:
        allotted = max(allotted, facts.executor_cores // max(facts.ranks_on_executor, 1))
    caps = [cap for cap in (_share(facts.usable_cpus, facts.ranks_on_executor),
                            _share(facts.host_cpus, facts.ranks_on_host)) if cap is not None]
    return max(1, min([allotted, *caps]))


def _share(cpus: float | None, ranks: int) -> int | None:
    """Whole cores each of `ranks` ranks gets of `cpus`, at least 1 (a 0.2-core host still runs one
    thread); None when `cpus` is unknown."""
    if cpus is None or cpus <= 0:
        return None
    return max(1, int(cpus / max(ranks, 1)))


def threads_for_rank(option: Any, context: Any, executors: tuple[str, ...], rank: int, ranks_on_host: int,
                     executor_cores: int | None = None) -> int:
    """The rule applied to this task: `context` is its (Barrier)TaskContext, `executors` every rank's
    executor address (WorldInfo.executors; empty when not known), `executor_cores` the driver's
    figure (TrainSpec.executor_cores)."""
    same_executor = executors.count(executors[rank]) if rank < len(executors) else ranks_on_host
    facts = CpuFacts(task_cpus=task_cpus(context), usable_cpus=usable_cpus(),
                     ranks_on_executor=max(same_executor, 1), ranks_on_host=max(ranks_on_host, 1),
                     executor_cores=executor_cores, host_cpus=_affinity())
    return rank_threads(option, facts)


def task_cpus(context: Any = None) -> int | None:
    """CPUs Spark allotted the task (`TaskContext.cpus()`, rounded up when fractional); None outside a
    task or where the context does not say (PySpark < 3.3, a test's stand-in)."""
    if context is None:
        try:
            from pyspark.taskcontext import TaskContext
        except ImportError:
            return None
        context = TaskContext.get()
    cpus = getattr(context, "cpus", None)
    if not callable(cpus):
        return None
    try:
        value = cpus()
    except Exception:  # noqa: BLE001 - a context without the figure: the rule falls back
        return None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def usable_cpus() -> float | None:
    """Cores this process may run on: its affinity mask and its cgroup's CPU quota, the smaller."""
    known = [figure for figure in (_affinity(), cgroup_cpu_limit()) if figure]
    return min(known) if known else None


def _affinity() -> int | None:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or None
    return os.cpu_count()


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, membership: str | None = None) -> float | None:
    """Cores this process's cgroup lets it use (the tightest quota on its cgroup and the cgroups
    above it), cgroup v2 or v1; None when no quota is set. `membership`: /proc/self/cgroup's text."""
    if membership is None:
        membership = _read(PROC_CGROUP) or ""
    limits: list[float | None] = []
    for line in membership.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2: one unified hierarchy
            limits += [cpu_max_cores(_read(d / "cpu.max")) for d in _cgroup_dirs(root, path)]
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own hierarchy
            mount = next((root / name for name in (controllers, "cpu,cpuacct", "cpu") if (root / name).is_dir()), None)
            if mount is not None:
                limits += [cfs_cores(_read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us"))
                           for d in _cgroup_dirs(mount, path)]
    found = [limit for limit in limits if limit is not None]
    return min(found) if found else None


def _cgroup_dirs(mount: Path, path: str) -> list[Path]:
    """The cgroup's directory and every parent up to the mount: a quota on any of them applies. In
    a container the mount is often the container's own cgroup and the path (the host's view) is not
    under it: the mount's own files still count."""
    parts = [part for part in path.strip("/").split("/") if part and part != ".."]
    dirs = [mount.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]
    return [d for d in dirs if d.is_dir()]


def cpu_max_cores(text: str | None) -> float | None:
    """cgroup v2 cpu.max, "<quota> <period>" in microseconds, as cores; "max ..." (no limit): None."""
    fields = (text or "").split()
    if not fields or fields[0] == "max":
        return None
    try:
        quota = float(fields[0])
        period = float(fields[1]) if len(fields) > 1 else DEFAULT_PERIOD_US
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def cfs_cores(quota: str | None, period: str | None) -> float | None:
    """cgroup v1 cpu.cfs_quota_us / cpu.cfs_period_us as cores; a quota of -1 (no limit): None."""
    try:
        quota_us, period_us = float((quota or "").strip()), float((period or "").strip())
    except ValueError:
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError):
        return None
