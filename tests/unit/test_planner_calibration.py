"""The planner's cluster data without Spark (planner/cluster.py): a ClusterInfo from Spark's facts and
a calibration probe's result, the cache's round trip and freshness, the optimistic end, merging two
calibrations; the run's step count as the workers count it; the threads a rank gets."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sparkdl.config import RunConfig
from sparkdl.planner import cluster as cl
from sparkdl.planner.cluster import ClusterFacts

INF = float("inf")


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPARKDL_CACHE_DIR", str(tmp_path))
    return tmp_path


def facts(executors: tuple[str, ...] = ("h:1", "h:2")) -> ClusterFacts:
    return ClusterFacts(master="spark://m:7077", workers=2, executors=executors, slots=4, executor_memory="2g",
                        gpus_per_executor=1.0, gpus_per_task=0.5)


def probe(flops: tuple[float, float] = (2e10, 1e10), latency: float = 1e-3, bandwidth: float = 1e8,
          executors: tuple[str, str] = ("h:2", "h:1")) -> dict[str, Any]:
    """A driver.probe result as rank 0 returns it; the best end is 2x better than the median."""
    def pair(value: float, diagonal: float) -> list[list[float]]:
        return [[diagonal, value], [value, diagonal]]

    return {"flops": list(flops), "flops_best": [2 * f for f in flops], "threads": [2, 2],
            "latency": pair(latency, 0.0), "latency_best": pair(latency / 2, 0.0),
            "bandwidth": pair(bandwidth, INF), "bandwidth_best": pair(2 * bandwidth, INF),
            "collective_latency": latency, "collective_bandwidth": bandwidth,
            "collective_latency_best": latency / 2, "collective_bandwidth_best": 2 * bandwidth,
            "executors": list(executors)}


def test_a_cluster_info_from_facts_and_a_probe() -> None:
    info = cl.cluster_from_probe(facts(), probe(), probe_s=3.5, threads_option=2, measured_at=100.0)
    assert info.master == "spark://m:7077" and info.workers == 2 and info.executors == ("h:1", "h:2")
    assert info.slots == 4 and info.executor_memory == "2g" and info.gpus_per_task == 0.5
    assert info.flops_per_s == (2e10, 1e10) and info.slowest_flops == 1e10
    assert info.worst_link() == (1e-3, 1e8) and info.threads_per_rank == (2, 2) and info.threads_option == 2
    # placement reads each pair's best latency (load only adds to it) and its typical bandwidth
    assert info.rank_executors == ("h:2", "h:1") and info.executor_links() == (("h:1", "h:2", 5e-4, 1e8),)
    best = info.optimistic()
    assert best.flops_per_s == (4e10, 2e10) and best.worst_link() == (5e-4, 2e8)
    assert best.collective_latency_s == 5e-4 and best.collective_bandwidth_Bps == 2e8
    # without a measured spread there is one end only
    bare = cl.cluster_from_probe(facts(), {k: v for k, v in probe().items() if not k.endswith("_best")}, 1.0)
    assert not bare.has_spread and bare.optimistic() is bare
    assert bare.executor_links() == (("h:1", "h:2", 1e-3, 1e8),)


def test_the_cache_round_trip(cache_dir: Path) -> None:
    assert cl.cached(facts()) is None
    info = cl.cluster_from_probe(facts(), probe(), probe_s=3.5)
    cl.remember(info, facts())
    assert (cache_dir / "calibration.json").is_file()
    assert cl.cached(facts()) == info
    # Spark's facts are read afresh; another cluster (other executors) has no entry
    moved = cl.cached(ClusterFacts("spark://m:7077", 2, ("h:1", "h:2"), slots=8, executor_memory="4g"))
    assert moved is not None and moved.slots == 8 and moved.executor_memory == "4g"
    assert moved.flops_per_s == info.flops_per_s
    assert cl.cached(facts(("h:1", "h:3"))) is None


def test_stale_or_incomplete_entries_are_measured_again(cache_dir: Path) -> None:
    info = cl.cluster_from_probe(facts(), probe(), probe_s=1.0, measured_at=1000.0)
    cl.remember(info, facts())
    assert cl.cached(facts(), now=1000.0 + cl.CACHE_TTL_S - 1) is not None
    assert cl.cached(facts(), now=1000.0 + cl.CACHE_TTL_S + 1) is None
    path = cache_dir / "calibration.json"
    entries = json.loads(path.read_text())
    for missing in ("threads_per_rank", "best_flops_per_s", "rank_executors"):
        entry = dict(entries[facts().cache_key])
        del entry[missing]  # written by an older sparkdl
        path.write_text(json.dumps({facts().cache_key: entry}))
        assert cl.cached(facts(), now=1000.0) is None, missing
    path.write_text("not json")
    assert cl.cached(facts()) is None


def test_merging_two_calibrations_keeps_the_best_of_each_measurement() -> None:
    first = cl.cluster_from_probe(facts(), probe(flops=(2e10, 1e10), latency=1e-3, bandwidth=1e8,
                                                 executors=("h:2", "h:1")), 1.0)
    # the second job placed its ranks the other way round: rank 0 is on h:1
    second = cl.cluster_from_probe(facts(), probe(flops=(3e10, 1.5e10), latency=4e-3, bandwidth=3e8,
                                                  executors=("h:1", "h:2")), 2.0)
    merged = cl.merge(first, second)
    assert merged.probes == 2 and merged.probe_s == 3.0 and merged.rank_executors == ("h:2", "h:1")
    # h:2's rank was 2e10 then 1.5e10; h:1's was 1e10 then 3e10
    assert merged.flops_per_s == (2e10, 3e10) and merged.best_flops_per_s == (4e10, 6e10)
    assert merged.worst_link() == (1e-3, 3e8) and merged.optimistic().worst_link() == (5e-4, 6e8)
    assert merged.collective_latency_s == 1e-3 and merged.collective_bandwidth_Bps == 3e8
    # ranks that cannot be matched by executor: the newer calibration as it is
    other = cl.cluster_from_probe(facts(), probe(executors=("h:3", "h:1")), 1.0)
    assert cl.merge(first, other).flops_per_s == other.flops_per_s and cl.merge(first, other).probes == 2


def config(**options: Any) -> RunConfig:
    return RunConfig.from_kwargs(feature_cols=["a"], label_col="label", num_workers=2, **options).validate()


@pytest.mark.parametrize("rows, workers, batch, drop_last, epochs", [
    (1797, 2, 64, False, 1), (1797, 2, 64, True, 3), (1000, 3, 7, False, 2), (64, 2, 32, False, 1),
    (65, 2, 32, True, 1), (10, 4, 64, False, 5)])
def test_run_steps_count_as_the_workers_do(rows: int, workers: int, batch: int, drop_last: bool, epochs: int) -> None:
    from sparkdl.data.batches import steps_per_epoch
    from sparkdl.data.epochs import expected_row_counts
    from sparkdl.planner.candidates import run_steps

    cfg = RunConfig.from_kwargs(feature_cols=["a"], label_col="label", num_workers=workers, batch_size=batch,
                                drop_last=drop_last, epochs=epochs).validate()
    shards = expected_row_counts(rows, workers)
    assert run_steps(cfg.data, cfg.train, cfg.launch, rows) == epochs * steps_per_epoch(list(shards), batch, drop_last)
    if rows == 1797 and not drop_last:
        assert run_steps(cfg.data, cfg.train, cfg.launch,
                         rows) == 15  # 899 rows on the larger shard: 14 full steps and a last one


def test_worker_threads_come_from_the_calibration() -> None:
    from sparkdl.driver.planning import worker_threads

    info = cl.cluster_from_probe(facts(), {**probe(), "threads": [3, 2]}, 1.0)
    assert worker_threads(config().launch, info) == 2
    assert worker_threads(config(threads_per_worker=4).launch, None) == 4
    assert worker_threads(config().launch, None) == 1


# -- planning composes: facts -> cache -> probe -> ClusterInfo -> plan (Spark and the probe faked) --

def test_planning_measures_once_more_when_the_ends_disagree(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch import nn

    from sparkdl.driver import calibration, planning
    from sparkdl.driver import probe as probe_module

    calls: list[tuple[int, int | None]] = []

    def fake_probe(spark: Any, workers: int, threads: int | None, trial: Any = None, cluster: bool = True
                   ) -> dict[str, Any]:
        calls.append((workers, threads))
        # a jittery network: 5 ms and 80 Mbit/s as measured, 1 us and 8 Tbit/s at best
        result = probe(flops=(2e10, 2e10), latency=5e-3, bandwidth=1e7, executors=("h:1", "h:2"))
        best = [[0.0, 1e-6], [1e-6, 0.0]], [[INF, 1e12], [1e12, INF]]
        # the model's step "timed" as failed on both ranks (0 s): the driver's profile prices it
        step = {"step": [0.0, 0.0], "step_best": [0.0, 0.0], "step_key": trial.key} if trial is not None else {}
        return {**result, "latency_best": best[0], "bandwidth_best": best[1], "collective_latency_best": 1e-6,
                "collective_bandwidth_best": 1e12, "threads": [1, 1], **step}

    monkeypatch.setattr(probe_module, "run_probe", fake_probe)
    monkeypatch.setattr(calibration, "session_facts", lambda spark, workers: ClusterFacts("local-cluster", workers,
                                                                                       ("h:1", "h:2"), slots=4))
    model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    cfg = RunConfig.from_kwargs(feature_cols=[f"x{i}" for i in range(64)], label_col="label", batch_size=64,
                                num_workers=2, epochs=100, progress=False).validate()
    plan = planning.make_plan(model, cfg.data, cfg.train, cfg.launch, cfg.tracking, 64, spark=None, num_rows=1797)
    assert len(calls) == 2  # the ends disagreed: measured once more, decided on the best of both
    assert plan.strategy in ("data_parallel", "hybrid") and plan.hinge and "kept exact" in plan.choice.reason
    assert any("best of 2 probes" in note for note in plan.notes)
    again = planning.make_plan(model, cfg.data, cfg.train, cfg.launch, cfg.tracking, 64, spark=None, num_rows=1797)
    assert len(calls) == 2 and again.strategy == plan.strategy  # the merged calibration is cached
    assert planning.calibrate(None, 2, threads_per_worker=1).threads_option == 1 and len(calls) == 3
