"""ClusterInfo: what the planner knows about the cluster, as data: Spark's facts (executors, slots,
executor memory, GPU amounts; `ClusterFacts`, gathered on the driver by sparkdl.driver.planning) and the
calibration probe's measurements (sparkdl/driver/probe.py: per-rank FLOP/s and torch threads,
latency and bandwidth between every pair of ranks, the backend's allreduce), each at two ends: the
median and the best of its repeats.

Measurements are cached per cluster (master, executors, worker count) for CACHE_TTL_S in
~/.cache/sparkdl/calibration.json (SPARKDL_CACHE_DIR moves it), so only the first plan of a session
pays for a probe. Nothing here touches Spark or launches a job: the planner never does.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Sequence

CACHE_TTL_S = 3600.0
Matrix = tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class ClusterFacts:
    """What Spark says about the cluster a run of `workers` ranks would use (no measurement)."""

    master: str
    workers: int
    executors: tuple[str, ...]  # executor host:port ids, driver excluded
    slots: int = 0  # tasks Spark can run at once
    executor_memory: str = ""  # spark.executor.memory
    gpus_per_executor: float = 0.0  # spark.executor.resource.gpu.amount
    gpus_per_task: float = 0.0  # spark.task.resource.gpu.amount
    pyspark_memory: str = ""  # spark.executor.pyspark.memory: the Python workers' limit per executor, if set
    task_cpus: int = 1  # spark.task.cpus: the ranks' threads follow it (executor/threads.py), so does FLOP/s

    @property
    def cache_key(self) -> str:
        cpus = f"|cpus={self.task_cpus}" if self.task_cpus != 1 else ""  # unchanged keys for the default
        return f"{self.master}|{self.workers}|{','.join(self.executors)}{cpus}"


@dataclass(frozen=True)
class ClusterInfo:
    master: str
    workers: int
    executors: tuple[str, ...]  # executor host:port ids, driver excluded
    flops_per_s: tuple[float, ...]  # per rank (median of its repeats)
    latency_s: Matrix  # [i][j] between ranks i and j (median)
    bandwidth_Bps: Matrix
    measured_at: float
    probe_s: float  # the calibration job's wall time on the driver (its start included)
    rank_executors: tuple[str, ...] = ()  # executor address of each calibration rank (links are between these)
    # Effective per-hop latency and bandwidth of the backend's ring allreduce (0: not measured).
    collective_latency_s: float = 0.0
    collective_bandwidth_Bps: float = 0.0
    slots: int = 0  # tasks Spark can run at once
    executor_memory: str = ""  # spark.executor.memory
    gpus_per_executor: float = 0.0  # spark.executor.resource.gpu.amount
    gpus_per_task: float = 0.0  # spark.task.resource.gpu.amount
    pyspark_memory: str = ""  # spark.executor.pyspark.memory (per executor), if set
    threads_per_rank: tuple[int, ...] = ()  # torch threads each calibration rank ran (and trains) with
    threads_option: int = 0  # launch.threads_per_worker the probe ran under (0: sparkdl's own rule)
    # The optimistic end: the best of each measurement's repeats (fastest FLOP/s, shortest times).
    # Load on a shared host only slows a measurement down, so this end is a legitimate view of the
    # cluster; the planner switches to an approximate strategy only when both ends agree.
    best_flops_per_s: tuple[float, ...] = ()
    best_latency_s: Matrix = ()
    best_bandwidth_Bps: Matrix = ()
    best_collective_latency_s: float = 0.0
    best_collective_bandwidth_Bps: float = 0.0
    probes: int = 1  # calibrations merged into this one (a re-measurement makes 2)
    # How well the repeats pinned the medians down (driver/probe.py repeats until SETTLED_RSE or its
    # budget): the worst rank's relative standard error of its FLOP/s median and the worst pair's of
    # its bandwidth round trips, with the most repeats any needed. 0: not measured (an older cache).
    flops_rse: float = 0.0
    bandwidth_rse: float = 0.0
    flops_repeats: int = 0
    bandwidth_rounds: int = 0
    # The run's model step timed on each rank (planner/step_trial.py): median and best seconds per
    # rank, for the model named by step_key (the last one planned here); () when none was timed.
    step_key: str = ""
    step_s: tuple[float, ...] = ()
    best_step_s: tuple[float, ...] = ()
    step_rse: float = 0.0
    step_repeats: int = 0
    # One IST round of that model timed on the ranks (driver/probe_ist.py), slowest rank's: the step
    # between syncs and what the syncing step took beyond it, seconds; 0 when none was timed.
    ist_step_s: float = 0.0
    ist_sync_s: float = 0.0
    ist_every: int = 0  # the round's steps (its sync_every)
    probe_task_s: float = 0.0  # of probe_s, the measuring on the ranks (the rest: the job's start and end)

    @property
    def slowest_flops(self) -> float:
        return min(self.flops_per_s)

    @property
    def has_spread(self) -> bool:
        """Whether the optimistic end was measured (a hand-built ClusterInfo may have one end only)."""
        return len(self.best_flops_per_s) == self.workers and len(self.best_latency_s) == self.workers

    def optimistic(self) -> ClusterInfo:
        """This calibration at its optimistic end (itself when that end was not measured)."""
        if not self.has_spread:
            return self
        return replace(self, flops_per_s=self.best_flops_per_s, latency_s=self.best_latency_s,
                       bandwidth_Bps=self.best_bandwidth_Bps, collective_latency_s=self.best_collective_latency_s,
                       collective_bandwidth_Bps=self.best_collective_bandwidth_Bps,
                       step_s=self.best_step_s if len(self.best_step_s) == len(self.step_s) else self.step_s)

    def worst_link(self) -> tuple[float, float]:
        """(largest latency, smallest bandwidth) over all pairs: a ring runs at its slowest link."""
        pairs = [(i, j) for i in range(self.workers) for j in range(self.workers) if i != j]
        if not pairs:
            return 0.0, float("inf")
        return max(self.latency_s[i][j] for i, j in pairs), min(self.bandwidth_Bps[i][j] for i, j in pairs)

    def executor_links(self) -> tuple[tuple[str, str, float, float], ...]:
        """(executor a, executor b, latency, bandwidth) for every measured pair, keyed by executor
        address: Spark places a job's ranks on executors anew, so rank indices do not carry over.
        Latency is each pair's best repeat where it was measured: the hybrid grid's boundaries carry
        a microbatch's activations (often a few KB), so placement turns on latencies, and load on a
        shared host adds noise to a pair's median larger than a slow link's transfer time, while it
        never shortens a repeat. Bandwidth stays the typical (median) one."""
        if len(self.rank_executors) != self.workers:
            return ()
        latencies = self.best_latency_s if self.has_spread else self.latency_s
        best: dict[tuple[str, str], tuple[float, float]] = {}
        for i in range(self.workers):
            for j in range(self.workers):
                if i == j:
                    continue
                a, b = sorted((self.rank_executors[i], self.rank_executors[j]))
                latency, bandwidth = latencies[i][j], self.bandwidth_Bps[i][j]
                old = best.get((a, b))
                best[(a, b)] = (max(latency, old[0]), min(bandwidth, old[1])) if old else (latency, bandwidth)
        return tuple((a, b, lat, bw) for (a, b), (lat, bw) in sorted(best.items()))


def cluster_from_probe(facts: ClusterFacts, probe: dict[str, Any], probe_s: float,
                       threads_option: int | None = None, measured_at: float | None = None) -> ClusterInfo:
    """A ClusterInfo from Spark's facts and driver.probe's result dict (rank 0's)."""
    return ClusterInfo(
        master=facts.master, workers=facts.workers, executors=facts.executors,
        flops_per_s=tuple(float(f) for f in probe["flops"]), latency_s=_matrix(probe["latency"]),
        bandwidth_Bps=_matrix(probe["bandwidth"]), rank_executors=tuple(probe.get("executors", ())),
        collective_latency_s=float(probe.get("collective_latency", 0.0)),
        collective_bandwidth_Bps=float(probe.get("collective_bandwidth", 0.0)),
        measured_at=time.time() if measured_at is None else measured_at, probe_s=probe_s, slots=facts.slots,
        executor_memory=facts.executor_memory, gpus_per_executor=facts.gpus_per_executor,
        gpus_per_task=facts.gpus_per_task, pyspark_memory=facts.pyspark_memory,
        threads_per_rank=tuple(int(t) for t in probe.get("threads", ())),
        threads_option=threads_option or 0,
        best_flops_per_s=tuple(float(f) for f in probe.get("flops_best", ())),
        best_latency_s=_matrix(probe.get("latency_best", ())),
        best_bandwidth_Bps=_matrix(probe.get("bandwidth_best", ())),
        best_collective_latency_s=float(probe.get("collective_latency_best", 0.0)),
        best_collective_bandwidth_Bps=float(probe.get("collective_bandwidth_best", 0.0)),
        flops_rse=max((float(v) for v in probe.get("flops_rse", ())), default=0.0),
        bandwidth_rse=float(probe.get("bandwidth_rse", 0.0)),
        flops_repeats=max((int(v) for v in probe.get("flops_repeats", ())), default=0),
        bandwidth_rounds=int(probe.get("bandwidth_rounds", 0)), probe_task_s=float(probe.get("task_s", 0.0)),
        **_step_fields(probe))


def _step_fields(probe: dict[str, Any]) -> dict[str, Any]:
    """ClusterInfo's model-step fields from a probe's result (none: the probe timed no model)."""
    if not probe.get("step_key"):
        return {}
    return {"step_key": str(probe["step_key"]), "step_s": tuple(float(v) for v in probe.get("step", ())),
            "best_step_s": tuple(float(v) for v in probe.get("step_best", ())),
            "step_rse": float(probe.get("step_rse", 0.0)), "step_repeats": int(probe.get("step_repeats", 0)),
            "ist_step_s": float(probe.get("ist_step", 0.0)), "ist_sync_s": float(probe.get("ist_sync", 0.0)),
            "ist_every": int(probe.get("ist_every", 0))}


def for_model(info: ClusterInfo, key: str) -> ClusterInfo:
    """`info` with its model step only when it timed the model of `key` (another model's step, or
    none, leaves the planner on the driver's profile)."""
    if key and info.step_key == key:
        return info
    return replace(info, step_key="", step_s=(), best_step_s=(), step_rse=0.0, step_repeats=0, ist_step_s=0.0,
                   ist_sync_s=0.0, ist_every=0)


def with_step(info: ClusterInfo, probe: dict[str, Any]) -> ClusterInfo:
    """`info` with the model step a model-only probe timed (driver/probe.py `cluster=False`), its
    ranks matched to `info`'s by executor address; the step left out when they cannot be matched."""
    fields_ = _step_fields(probe)
    order = _rank_order(info.rank_executors, tuple(probe.get("executors", ())))
    if not fields_ or order is None:
        return info
    return replace(info, **{**fields_, "step_s": tuple(fields_["step_s"][r] for r in order),
                            "best_step_s": tuple(fields_["best_step_s"][r] for r in order)})


def merge(first: ClusterInfo, second: ClusterInfo) -> ClusterInfo:
    """Best of two calibrations of one cluster, measurement by measurement and at each end: noise
    only slows a measurement down, so the better figure of two is the nearer to the truth. Ranks
    are matched by executor address (a job's rank r need not be on the other job's rank-r
    executor); when they cannot be matched, the newer calibration is kept as it is."""
    order = _rank_order(first.rank_executors, second.rank_executors)
    if order is None or first.workers != second.workers:
        return replace(second, probes=first.probes + second.probes)
    again = _reordered(second, order)

    def fast(a: Sequence[float], b: Sequence[float]) -> tuple[float, ...]:
        return tuple(max(x, y) for x, y in zip(a, b)) if len(a) == len(b) else tuple(b)

    def table(a: Matrix, b: Matrix, pick: Any) -> Matrix:
        return tuple(tuple(pick(x, y) for x, y in zip(r, s)) for r, s in zip(a, b)) if len(a) == len(b) else b

    def ring(a: float, b: float, pick: Any) -> float:
        measured = [v for v in (a, b) if v > 0]  # 0: not measured
        return pick(measured) if measured else 0.0

    return replace(
        again, flops_per_s=fast(first.flops_per_s, again.flops_per_s),
        latency_s=table(first.latency_s, again.latency_s, min),
        bandwidth_Bps=table(first.bandwidth_Bps, again.bandwidth_Bps, max),
        collective_latency_s=ring(first.collective_latency_s, again.collective_latency_s, min),
        collective_bandwidth_Bps=ring(first.collective_bandwidth_Bps, again.collective_bandwidth_Bps, max),
        best_flops_per_s=fast(first.best_flops_per_s, again.best_flops_per_s),
        best_latency_s=table(first.best_latency_s, again.best_latency_s, min),
        best_bandwidth_Bps=table(first.best_bandwidth_Bps, again.best_bandwidth_Bps, max),
        best_collective_latency_s=ring(first.best_collective_latency_s, again.best_collective_latency_s, min),
        best_collective_bandwidth_Bps=ring(first.best_collective_bandwidth_Bps, again.best_collective_bandwidth_Bps,
                                           max),
        probe_s=first.probe_s + second.probe_s, probes=first.probes + second.probes,
        **_merged_steps(first, again))


def _merged_steps(first: ClusterInfo, second: ClusterInfo) -> dict[str, Any]:
    """The faster of two timings of one model's step, rank by rank (and of its IST round); the newer
    model's otherwise."""
    if first.step_key != second.step_key or len(first.step_s) != len(second.step_s) or not second.step_s:
        return {}

    def faster(a: float, b: float) -> float:
        return min(a, b) if a > 0 and b > 0 else max(a, b)

    rounds = [(r.ist_step_s * r.ist_every + r.ist_sync_s, r.ist_step_s, r.ist_sync_s, r.ist_every)
              for r in (first, second) if r.ist_step_s > 0]
    _, ist_step, ist_sync, every = min(rounds) if rounds else (0.0, 0.0, 0.0, 0)
    return {"step_s": tuple(faster(a, b) for a, b in zip(first.step_s, second.step_s)),
            "best_step_s": tuple(faster(a, b) for a, b in zip(first.best_step_s, second.best_step_s)),
            "ist_step_s": ist_step, "ist_sync_s": ist_sync, "ist_every": every}


def _rank_order(first: Sequence[str], second: Sequence[str]) -> list[int] | None:
    """order[i]: the rank of the second calibration on the executor of the first's rank i."""
    if not first or sorted(first) != sorted(second):
        return None
    free: dict[str, list[int]] = {}
    for rank, executor in enumerate(second):
        free.setdefault(executor, []).append(rank)
    return [free[executor].pop(0) for executor in first]


def _reordered(info: ClusterInfo, order: list[int]) -> ClusterInfo:
    """`info` with its ranks renumbered: new rank i is old rank order[i]."""
    def ranks(values: Sequence[Any]) -> tuple[Any, ...]:
        return tuple(values[r] for r in order) if len(values) == len(order) else tuple(values)

    def pairs(values: Matrix) -> Matrix:
        return tuple(tuple(values[r][c] for c in order) for r in order) if len(values) == len(order) else values

    return replace(info, flops_per_s=ranks(info.flops_per_s), best_flops_per_s=ranks(info.best_flops_per_s),
                   threads_per_rank=ranks(info.threads_per_rank), rank_executors=ranks(info.rank_executors),
                   step_s=ranks(info.step_s), best_step_s=ranks(info.best_step_s),
                   latency_s=pairs(info.latency_s), bandwidth_Bps=pairs(info.bandwidth_Bps),
                   best_latency_s=pairs(info.best_latency_s), best_bandwidth_Bps=pairs(info.best_bandwidth_Bps))


def cached(facts: ClusterFacts, now: float | None = None) -> ClusterInfo | None:
    """The cached measurement of this cluster, if fresh; never starts a probe."""
    entry = _read_cache().get(facts.cache_key)
    if not _fresh(entry, time.time() if now is None else now):
        return None
    # Spark's facts are read afresh each time; only the measurements come from the cache.
    info = _from_entry(entry)  # type: ignore[arg-type] - _fresh checked it is a dict
    return replace(info, slots=facts.slots, executor_memory=facts.executor_memory,
                   gpus_per_executor=facts.gpus_per_executor, gpus_per_task=facts.gpus_per_task,
                   pyspark_memory=facts.pyspark_memory)


def remember(info: ClusterInfo, facts: ClusterFacts) -> None:
    """Cache `info` under this cluster's key (a read-only home only costs the next plan a probe)."""
    path = cache_path()
    cache = _read_cache()
    cache[facts.cache_key] = asdict(info)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # two drivers writing at once never mix halves
        tmp.write_text(json.dumps(cache))
        tmp.replace(path)
    except OSError:
        pass


def cache_path() -> Path:
    root = os.environ.get("SPARKDL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "sparkdl")
    return Path(root) / "calibration.json"


def _read_cache() -> dict[str, Any]:
    path = cache_path()
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}
    return {}


# Entries written before these measurements existed (collective probe, executor addresses, thread
# counts, the optimistic end) are measured again rather than half-trusted.
_REQUIRED = ("measured_at", "rank_executors", "threads_per_rank", "best_flops_per_s", "best_latency_s")


def _fresh(entry: dict[str, Any] | None, now: float) -> bool:
    if not isinstance(entry, dict) or any(key not in entry for key in _REQUIRED):
        return False
    return bool(entry["threads_per_rank"]) and now - float(entry["measured_at"]) < CACHE_TTL_S


def _matrix(rows: Any) -> Matrix:
    return tuple(tuple(float(v) for v in row) for row in rows)


def _from_entry(entry: dict[str, Any]) -> ClusterInfo:
    known = {f.name for f in fields(ClusterInfo)}
    values = {k: v for k, v in entry.items() if k in known}  # a newer sparkdl's extra keys are ignored
    for key in ("latency_s", "bandwidth_Bps", "best_latency_s", "best_bandwidth_Bps"):
        values[key] = _matrix(values.get(key, ()))
    for key in ("executors", "flops_per_s", "rank_executors", "threads_per_rank", "best_flops_per_s", "step_s",
                "best_step_s"):
        values[key] = tuple(values.get(key, ()))
    return ClusterInfo(**values)
