"""CPU capacity per emulated host of the multi-host bed (tests/support/multihost.py): a cgroup per
host under one parent unique to the bed, its capacity a number of cores (0.25: a quarter of one
core, 2: two cores), enforced by the CFS bandwidth controller. A process moved into a host's group
takes every process it starts later with it (a Spark Worker's executors and their Python workers).

Where a cgroup v2 hierarchy offers the `cpu` controller, `cpu.max`; else cgroup v1's `cpu`
hierarchy, `cpu.cfs_quota_us` / `cpu.cfs_period_us`; else `why_not()` says why neither can be used
(and the tests that need it skip with that).

`NoisyNeighbour`: a thread that changes one host's capacity at random times (exponential gaps of a
given mean, capacities uniform in [low, high], both from `random.Random(seed)`: one seed, one
schedule), recording when it applied what, so that a run can report it.

Standard library only; needs root (or a delegated cgroup subtree).
"""
from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

# CFS bandwidth period: 10 ms, not the kernel's 100 ms default. Under a quota a group runs at full
# speed until its quota is spent, then stalls to the end of the period: with 100 ms periods a
# training step of ~30 ms runs at full speed and its stall lands wherever the quota ran out (the
# allreduce after it, say), so that the rank looks fast and waiting; with 10 ms the stalls spread
# over its compute, as on a slower CPU.
PERIOD_US = 10_000
MIN_QUOTA_US = 1_000  # the kernel refuses quotas under 1 ms
MAX_PERIOD_US = 1_000_000  # and periods over 1 s
# The parent group's weight against the machine's other processes, in nice-0 processes: the CFS
# weighs a group as one process however many it holds, so on a loaded machine a host would get a
# fraction of its capacity. The quotas bound what the hosts take.
PARENT_WEIGHT = 64


@dataclass(frozen=True)
class Hierarchy:
    version: int  # 2: cpu.max; 1: cpu.cfs_quota_us
    root: Path  # where this process's own cgroup of that hierarchy is mounted (groups go below it)


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fs type, super options) of every cgroup mount (from /proc/self/mountinfo)."""
    found = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            found.append((fields[4], tail[0], set(tail[2].split(","))))
    return found


def _own_path(version: int, controller: str = "cpu") -> str:
    """This process's cgroup path in the v2 hierarchy, or in the v1 hierarchy holding `controller`."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return "/"
    for line in lines:
        number, controllers, path = line.split(":", 2)
        if version == 2 and number == "0" and controllers == "":
            return path
        if version == 1 and controller in controllers.split(","):
            return path
    return "/"


def find() -> tuple[Hierarchy | None, str]:
    """The hierarchy to use and, when none, why not."""
    reasons = []
    for point, kind, _ in _mounts():
        if kind != "cgroup2":
            continue
        controllers = (Path(point) / "cgroup.controllers")
        offered = controllers.read_text().split() if controllers.exists() else []
        if "cpu" in offered:
            return Hierarchy(2, Path(point)), ""
        reasons.append(f"the cgroup v2 hierarchy at {point} offers no cpu controller ({' '.join(offered) or 'none'})")
    for point, kind, options in _mounts():
        if kind == "cgroup" and "cpu" in options:
            own = Path(point) / _own_path(1).lstrip("/")
            base = own if (own / "cpu.cfs_quota_us").exists() else Path(point)
            if (base / "cpu.cfs_quota_us").exists():
                return Hierarchy(1, base), ""
            reasons.append(f"the cgroup v1 cpu hierarchy at {point} has no cpu.cfs_quota_us (no CFS bandwidth control)")
    if not reasons:
        reasons.append("no cgroup hierarchy with the cpu controller is mounted")
    return None, "; ".join(reasons)


def why_not() -> str | None:
    """None when host CPU capacities can be set here, else why not."""
    hierarchy, reason = find()
    if hierarchy is None:
        return f"cannot limit an emulated host's CPU: {reason}"
    probe = CpuGroups(f"sdlcpuprobe{os.getpid()}")
    try:
        probe.set("probe", 0.5)
    except OSError as exc:
        return f"cannot limit an emulated host's CPU: cgroup v{hierarchy.version} at {hierarchy.root}: {exc}"
    finally:
        probe.remove()
    return None


def period_us(cores: float) -> int:
    """The CFS period for `cores`: PERIOD_US, longer where its quota would fall under the minimum."""
    if cores <= 0:
        raise ValueError(f"a host's CPU capacity must be above 0 cores, not {cores}")
    return min(MAX_PERIOD_US, max(PERIOD_US, -(-MIN_QUOTA_US * 1000 // round(cores * 1000))))


def quota_us(cores: float) -> int:
    """CFS quota (µs a period of period_us(cores)) for `cores` cores."""
    return max(MIN_QUOTA_US, round(cores * period_us(cores)))


class CpuGroups:
    """`CpuGroups(tag)`: one cgroup per name under `<hierarchy>/<tag>`; `set(name, cores)` creates it
    (the first time) and sets its capacity (None: unlimited); `add(name, pid)` moves a process (all
    its threads; what it starts later follows); `remove()` moves whatever is left to the hierarchy's
    group this process started in, and removes the groups."""

    def __init__(self, tag: str, hierarchy: Hierarchy | None = None) -> None:
        found, reason = (hierarchy, "") if hierarchy is not None else find()
        if found is None:
            raise RuntimeError(f"cannot limit CPU capacity: {reason}")
        self.hierarchy = found
        self.parent = found.root / tag
        self.capacity: dict[str, float | None] = {}
        self._lock = threading.Lock()

    @property
    def version(self) -> int:
        return self.hierarchy.version

    def path(self, name: str) -> Path:
        return self.parent / name

    def _ensure(self, name: str) -> Path:
        if not self.parent.exists():
            if self.version == 2:  # the hierarchy's root hands the cpu controller down (no-op if it does)
                enabled = (self.hierarchy.root / "cgroup.subtree_control").read_text().split()
                if "cpu" not in enabled:
                    (self.hierarchy.root / "cgroup.subtree_control").write_text("+cpu")
            self.parent.mkdir()
            if self.version == 2:  # children of the parent get cpu.max
                (self.parent / "cgroup.subtree_control").write_text("+cpu")
                (self.parent / "cpu.weight").write_text(str(100 * PARENT_WEIGHT))  # 100: a nice-0 process
            else:
                (self.parent / "cpu.shares").write_text(str(1024 * PARENT_WEIGHT))  # 1024: a nice-0 process
        group = self.path(name)
        if not group.exists():
            group.mkdir()
        return group

    def set(self, name: str, cores: float | None) -> None:
        """`name`'s capacity: `cores` cores (a fraction of one, or several), or None for no limit."""
        with self._lock:
            group = self._ensure(name)
            period = PERIOD_US if cores is None else period_us(cores)
            if self.version == 2:
                value = "max" if cores is None else str(quota_us(cores))
                (group / "cpu.max").write_text(f"{value} {period}")
            else:  # v1 checks the quota against the period as each is written: lift the quota first
                (group / "cpu.cfs_quota_us").write_text("-1")
                (group / "cpu.cfs_period_us").write_text(str(period))
                if cores is not None:
                    (group / "cpu.cfs_quota_us").write_text(str(quota_us(cores)))
            self.capacity[name] = cores

    def get(self, name: str) -> float | None:
        """The capacity the kernel holds for `name` (cores; None: unlimited)."""
        group = self.path(name)
        if self.version == 2:
            quota, period = (group / "cpu.max").read_text().split()
        else:
            quota, period = (group / "cpu.cfs_quota_us").read_text().strip(), (group / "cpu.cfs_period_us").read_text()
        return None if quota in ("max", "-1") else int(quota) / int(period)

    def add(self, name: str, pids: Iterable[int]) -> list[int]:
        """Move `pids` (each with all its threads) into `name`'s group; those that are gone are
        skipped. Returns the PIDs moved."""
        moved = []
        procs = self._ensure(name) / "cgroup.procs"
        for pid in pids:
            try:
                procs.write_text(str(pid))
                moved.append(pid)
            except ProcessLookupError:
                pass
            except OSError as exc:
                if exc.errno != 3:  # ESRCH: the process ended meanwhile
                    raise
        return moved

    def pids(self, name: str) -> list[int]:
        try:
            return [int(p) for p in (self.path(name) / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return []

    def throttled(self, name: str) -> dict[str, float]:
        """How often the kernel held `name`'s processes back: {"periods", "throttled_periods",
        "throttled_s"} since the group was made (cpu.stat)."""
        stat = dict(line.split() for line in (self.path(name) / "cpu.stat").read_text().splitlines() if line.strip())
        if self.version == 2:
            seconds = int(stat.get("throttled_usec", 0)) / 1e6
        else:
            seconds = int(stat.get("throttled_time", 0)) / 1e9
        return {"periods": int(stat.get("nr_periods", 0)), "throttled_periods": int(stat.get("nr_throttled", 0)),
                "throttled_s": seconds}

    def usage_s(self, name: str) -> float:
        """CPU seconds the group's processes have used since it was made."""
        if self.version == 2:
            for line in (self.path(name) / "cpu.stat").read_text().splitlines():
                key, value = line.split()
                if key == "usage_usec":
                    return int(value) / 1e6
            return 0.0
        accounting = _v1_cpuacct(self.path(name))
        if accounting is not None:
            return accounting
        raise RuntimeError("cgroup v1 without a cpuacct group for it: no usage figure")

    def remove(self) -> None:
        """Every group removed; processes still in one go to the group this process started in."""
        if not self.parent.exists():
            return
        home = self.hierarchy.root / "cgroup.procs"
        for group in sorted((p for p in self.parent.iterdir() if p.is_dir()), reverse=True):
            for _ in range(20):
                left = self.pids(group.name)
                for pid in left:
                    try:
                        home.write_text(str(pid))
                    except OSError:
                        pass  # ended meanwhile
                try:
                    group.rmdir()
                    break
                except OSError:  # a process forked into it meanwhile, or an exiting one not yet reaped
                    time.sleep(0.05)
        try:
            self.parent.rmdir()
        except OSError:
            pass
        self.capacity.clear()


def _v1_cpuacct(group: Path) -> float | None:
    """v1: cpu and cpuacct mounted together (cpu,cpuacct) give cpuacct.usage in the same group."""
    usage = group / "cpuacct.usage"
    return int(usage.read_text()) / 1e9 if usage.exists() else None


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) process `pid` and its reaped children used (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = sum(int(v) for v in fields[11:15])  # utime, stime, cutime, cstime
    return ticks / os.sysconf("SC_CLK_TCK")


# -- a noisy neighbour -------------------------------------------------------------------------------
def planned_changes(seed: int, low: float, high: float, mean_interval_s: float, duration_s: float
                    ) -> list[tuple[float, float]]:
    """(seconds from the start, cores) of each change within `duration_s`: gaps exponential with mean
    `mean_interval_s`, capacities uniform in [low, high] (rounded to 0.01 core), all drawn from
    random.Random(seed) (the first change at 0 s: the neighbour is there from the start)."""
    if not 0 < low <= high:
        raise ValueError(f"a noisy neighbour needs 0 < low <= high, not low={low}, high={high}")
    rng = random.Random(seed)
    changes, at = [], 0.0
    while at < duration_s:
        changes.append((round(at, 3), round(rng.uniform(low, high), 2)))
        at += rng.expovariate(1.0 / mean_interval_s)
    return changes


@dataclass
class NoisyNeighbour:
    """Changes `name`'s capacity at the seeded times of `planned_changes` while it runs (up to
    `duration_s`, default an hour). `schedule`: [(seconds since start, host, cores)] as applied;
    `stop()` ends it and puts back the capacity the host had before."""
    groups: CpuGroups
    name: str
    seed: int
    low: float
    high: float
    mean_interval_s: float
    duration_s: float = 3600.0
    schedule: list[tuple[float, str, float]] = field(default_factory=list)
    started_at: float = 0.0  # time.time() when it started (for comparing with other processes' clocks)

    def __post_init__(self) -> None:
        self.plan = planned_changes(self.seed, self.low, self.high, self.mean_interval_s, self.duration_s)
        self._stop = threading.Event()
        self._before = self.groups.capacity.get(self.name)
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"noisy-neighbour-{self.name}")

    def start(self) -> "NoisyNeighbour":
        self.started_at = time.time()
        self._thread.start()
        return self

    def _run(self) -> None:
        started = time.monotonic()
        for at, cores in self.plan:
            if self._stop.wait(max(0.0, started + at - time.monotonic())):
                return
            self.groups.set(self.name, cores)
            self.schedule.append((round(time.monotonic() - started, 3), self.name, cores))

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        if self.groups.parent.exists() and self.groups.path(self.name).exists():
            self.groups.set(self.name, self._before)

    def mean_capacity(self, until_s: float | None = None, since_s: float = 0.0) -> float:
        """The time-weighted mean capacity (cores) of the applied schedule between `since_s` and
        `until_s` seconds from its start (default: its last change)."""
        return mean_cores([(t, c) for t, _, c in self.schedule], since_s, until_s)


def mean_cores(changes: list[tuple[float, float]], since_s: float = 0.0, until_s: float | None = None) -> float:
    """The time-weighted mean of a step function of (seconds, cores) changes over [since_s, until_s]."""
    if not changes:
        return float("nan")
    end = until_s if until_s is not None else changes[-1][0]
    if end <= since_s:  # an empty window: the capacity in force at its start
        return next((c for t, c in reversed(changes) if t <= since_s), changes[0][1])
    total = 0.0
    for (t, c), nxt in zip(changes, [p[0] for p in changes[1:]] + [max(end, changes[-1][0])]):
        total += c * max(0.0, min(nxt, end) - max(t, since_s))
    return total / (end - max(since_s, changes[0][0])) if end > max(since_s, changes[0][0]) else changes[0][1]
