"""ClusterInfo: what the planner knows about the cluster, from Spark (executors, slots, executor
memory, GPU amounts) and from a calibration probe.

The probe is a short barrier job (`sparkdl.run`) of num_workers ranks that measures each rank's
matrix-product FLOP/s (with the threads a training rank gets) and, for every pair of ranks, the
latency (8-byte ping-pong) and bandwidth (4 MiB ping-pong). Results are cached per cluster (master,
executors, worker count) for CACHE_TTL_S in ~/.cache/sparkdl/calibration.json, so only the first
plan of a session pays for it.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sparkdl.planner.speed import matmul_flops

CACHE_TTL_S = 3600.0


@dataclass(frozen=True)
class ClusterInfo:
    master: str
    workers: int
    executors: tuple[str, ...]  # executor host:port ids, driver excluded
    flops_per_s: tuple[float, ...]  # per rank
    latency_s: tuple[tuple[float, ...], ...]  # [i][j] between ranks i and j
    bandwidth_Bps: tuple[tuple[float, ...], ...]
    measured_at: float
    probe_s: float
    rank_executors: tuple[str, ...] = ()  # executor address of each calibration rank (links are between these)
    # Effective per-hop latency and bandwidth of the backend's ring allreduce (0: not measured).
    collective_latency_s: float = 0.0
    collective_bandwidth_Bps: float = 0.0
    slots: int = 0  # tasks Spark can run at once
    executor_memory: str = ""  # spark.executor.memory
    gpus_per_executor: float = 0.0  # spark.executor.resource.gpu.amount
    gpus_per_task: float = 0.0  # spark.task.resource.gpu.amount

    @property
    def slowest_flops(self) -> float:
        return min(self.flops_per_s)

    def worst_link(self) -> tuple[float, float]:
        """(largest latency, smallest bandwidth) over all pairs: a ring runs at its slowest link."""
        pairs = [(i, j) for i in range(self.workers) for j in range(self.workers) if i != j]
        if not pairs:
            return 0.0, float("inf")
        return max(self.latency_s[i][j] for i, j in pairs), min(self.bandwidth_Bps[i][j] for i, j in pairs)

    def executor_links(self) -> tuple[tuple[str, str, float, float], ...]:
        """(executor a, executor b, latency, bandwidth) for every measured pair, keyed by executor
        address: Spark places a job's ranks on executors anew, so rank indices do not carry over."""
        if len(self.rank_executors) != self.workers:
            return ()
        best: dict[tuple[str, str], tuple[float, float]] = {}
        for i in range(self.workers):
            for j in range(self.workers):
                if i == j:
                    continue
                key = tuple(sorted((self.rank_executors[i], self.rank_executors[j])))
                latency, bandwidth = self.latency_s[i][j], self.bandwidth_Bps[i][j]
                old = best.get(key)  # type: ignore[arg-type]
                best[key] = (max(latency, old[0]), min(bandwidth, old[1])) if old else (latency, bandwidth)  # type: ignore[index]
        return tuple((a, b, lat, bw) for (a, b), (lat, bw) in sorted(best.items()))


def _probe(ctx: Any) -> dict[str, Any]:
    """Runs on every rank of the calibration job."""
    import torch

    flops = matmul_flops()
    world, rank = ctx.world_size, ctx.rank
    latency = [[0.0] * world for _ in range(world)]
    bandwidth = [[float("inf")] * world for _ in range(world)]
    small, large = torch.zeros(2), torch.zeros(1 << 20)  # 8 bytes, 4 MiB
    for i in range(world):
        for j in range(i + 1, world):
            for buffer, rounds, table in ((small, 20, latency), (large, 3, bandwidth)):
                ctx.comm.barrier()
                times = []
                for _ in range(rounds):
                    started = time.perf_counter()
                    if rank == i:
                        ctx.comm.send(buffer, j, 31).wait()
                        ctx.comm.recv(buffer, j, 32)
                    elif rank == j:
                        ctx.comm.recv(buffer, i, 31)
                        ctx.comm.send(buffer, i, 32).wait()
                    times.append((time.perf_counter() - started) / 2)
                if rank == i:
                    one_way = statistics.median(times)
                    if table is latency:
                        latency[i][j] = latency[j][i] = one_way
                    else:
                        nbytes = buffer.numel() * buffer.element_size()
                        seconds = max(one_way - latency[i][j], 1e-9)
                        bandwidth[i][j] = bandwidth[j][i] = nbytes / seconds
    collective_latency, collective_bandwidth = _collective(ctx, small, large)
    gathered = ctx.comm.allgather_object({"flops": flops, "latency": latency, "bandwidth": bandwidth})
    merged_latency = [[max(g["latency"][i][j] for g in gathered) for j in range(world)] for i in range(world)]
    merged_bandwidth = [[min(g["bandwidth"][i][j] for g in gathered) for j in range(world)] for i in range(world)]
    return {"flops": [g["flops"] for g in gathered], "latency": merged_latency, "bandwidth": merged_bandwidth,
            "collective_latency": collective_latency, "collective_bandwidth": collective_bandwidth,
            "executors": list(ctx.world.executors)}


def _collective(ctx: Any, small: Any, large: Any) -> tuple[float, float]:
    """Ring parameters that reproduce the measured allreduce of 8 bytes and of 4 MiB:
    T(n) = 2(W-1) a + 2(W-1)/W n / b. Rank 0's medians (after a barrier, so all ranks start together)."""
    world = ctx.world_size
    if world < 2:
        return 0.0, 0.0
    medians = []
    for buffer, rounds in ((small, 20), (large, 5)):
        ctx.comm.barrier()
        ctx.comm.allreduce(buffer.clone(), op="sum")  # warm-up
        times = []
        for _ in range(rounds):
            work = buffer.clone()
            started = time.perf_counter()
            ctx.comm.allreduce(work, op="avg")
            times.append(time.perf_counter() - started)
        medians.append(statistics.median(times))
    hops = 2 * (world - 1)
    latency = medians[0] / hops
    nbytes = large.numel() * large.element_size()
    bandwidth = hops / world * nbytes / max(medians[1] - medians[0], 1e-9)
    decided = ctx.comm.allgather_object((latency, bandwidth))[0]  # every rank reports rank 0's
    return decided


def _cache_path() -> Path:
    root = os.environ.get("SPARKDL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "sparkdl")
    return Path(root) / "calibration.json"


def _executors(spark: Any) -> tuple[str, ...]:
    try:
        infos = spark.sparkContext._jsc.sc().statusTracker().getExecutorInfos()  # noqa: SLF001
        hosts = sorted(f"{e.host()}:{e.port()}" for e in infos)
        return tuple(hosts[1:]) if len(hosts) > 1 else tuple(hosts)  # the first entry is the driver
    except Exception:  # noqa: BLE001 - Spark Connect: no JVM view
        return ()


def _cache_key(spark: Any, workers: int) -> str:
    return f"{spark.sparkContext.master}|{workers}|{','.join(_executors(spark))}"


def _read_cache() -> dict[str, Any]:
    path = _cache_path()
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
    return {}


def _fresh(entry: dict[str, Any] | None) -> bool:
    # Entries written before the collective probe and executor addresses existed are measured again.
    return bool(entry) and time.time() - entry["measured_at"] < CACHE_TTL_S and "rank_executors" in entry  # type: ignore[index]


def cached_cluster_info(spark: Any, workers: int) -> ClusterInfo | None:
    """The cached measurement of this cluster, if fresh; never starts a probe."""
    entry = _read_cache().get(_cache_key(spark, workers))
    return _from_entry(entry) if _fresh(entry) else None


def cluster_info(spark: Any, workers: int, threads_per_worker: int | None = None, refresh: bool = False,
                 backend: str = "torch") -> ClusterInfo:
    """Measured (or cached) facts about the ranks a run of `workers` workers would get."""
    master = spark.sparkContext.master
    executors = _executors(spark)
    key = _cache_key(spark, workers)
    path = _cache_path()
    cache = _read_cache()
    entry = cache.get(key)
    if not refresh and _fresh(entry):
        return _from_entry(entry)
    import sparkdl

    started = time.perf_counter()
    options: dict[str, Any] = {"progress": False, "backend": "torch"}
    if threads_per_worker:
        options["threads_per_worker"] = threads_per_worker
    probe = sparkdl.run(_probe, num_workers=workers, **options)
    conf = spark.sparkContext.getConf()
    from sparkdl.launch.driver import concurrent_slots

    info = ClusterInfo(master=master, workers=workers, executors=executors,
                       flops_per_s=tuple(probe["flops"]),
                       latency_s=tuple(tuple(r) for r in probe["latency"]),
                       bandwidth_Bps=tuple(tuple(r) for r in probe["bandwidth"]),
                       rank_executors=tuple(probe["executors"]),
                       collective_latency_s=probe["collective_latency"],
                       collective_bandwidth_Bps=probe["collective_bandwidth"],
                       measured_at=time.time(), probe_s=time.perf_counter() - started,
                       slots=concurrent_slots(spark), executor_memory=conf.get("spark.executor.memory", "1g"),
                       gpus_per_executor=float(conf.get("spark.executor.resource.gpu.amount", "0")),
                       gpus_per_task=float(conf.get("spark.task.resource.gpu.amount", "0")))
    cache[key] = asdict(info)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cache))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home only costs the next plan another probe
    return info


def _from_entry(entry: dict[str, Any]) -> ClusterInfo:
    return ClusterInfo(master=entry["master"], workers=entry["workers"], executors=tuple(entry["executors"]),
                       flops_per_s=tuple(entry["flops_per_s"]),
                       latency_s=tuple(tuple(r) for r in entry["latency_s"]),
                       bandwidth_Bps=tuple(tuple(r) for r in entry["bandwidth_Bps"]),
                       measured_at=entry["measured_at"], probe_s=entry["probe_s"], slots=entry.get("slots", 0),
                       rank_executors=tuple(entry.get("rank_executors", ())),
                       collective_latency_s=entry.get("collective_latency_s", 0.0),
                       collective_bandwidth_Bps=entry.get("collective_bandwidth_Bps", 0.0),
                       executor_memory=entry.get("executor_memory", ""),
                       gpus_per_executor=entry.get("gpus_per_executor", 0.0),
                       gpus_per_task=entry.get("gpus_per_task", 0.0))
