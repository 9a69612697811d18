"""The calibration's repeats (driver/probe.py): a measurement is repeated until its median's relative
standard error is within the stated tolerance, or a cap or time budget ends it, and the confidence
reached travels with the figures into the ClusterInfo the planner prices with."""
from __future__ import annotations

import itertools

import pytest

from sparkdl.driver.probe import SETTLED_RSE, median_rse, settle
from sparkdl.planner.cluster import ClusterFacts, cluster_from_probe


def test_median_rse_is_the_spread_of_the_median() -> None:
    assert median_rse([5.0]) == 0.0 and median_rse([]) == 0.0
    assert median_rse([2.0, 2.0, 2.0]) == 0.0
    assert median_rse([1.0, 3.0]) == pytest.approx(1.2533 * 2 ** 0.5 / (2 ** 0.5 * 2.0))


def test_quiet_samples_stop_at_once_and_noisy_ones_take_more_repeats() -> None:
    calls = itertools.count()

    def more() -> list[float]:
        next(calls)
        return [100.0, 101.0, 99.0]

    assert settle([100.0, 100.5, 99.5], more, cap=30, budget_s=10.0) == [100.0, 100.5, 99.5]
    assert next(calls) == 0  # already settled: no repeat
    noisy = settle([40.0, 160.0, 100.0], more, cap=30, budget_s=10.0)
    assert len(noisy) > 3 and median_rse(noisy) <= SETTLED_RSE


def test_the_cap_and_the_budget_end_a_measurement_that_never_settles() -> None:
    flip = itertools.cycle([[10.0], [1000.0]])
    assert len(settle([10.0, 1000.0], lambda: next(flip), cap=8, budget_s=10.0)) == 8
    assert settle([10.0, 1000.0], lambda: next(flip), cap=100, budget_s=0.0) == [10.0, 1000.0]


def test_the_confidence_reached_reaches_the_cluster_info() -> None:
    facts = ClusterFacts(master="local-cluster[2,1,1024]", workers=2, executors=("e1:1", "e2:1"), slots=2)
    probe = {"flops": [1e9, 1.1e9], "latency": [[0, 1e-4], [1e-4, 0]], "bandwidth": [[0, 1e8], [1e8, 0]],
             "flops_rse": [0.01, 0.04], "flops_repeats": [10, 16], "bandwidth_rse": 0.03, "bandwidth_rounds": 7}
    info = cluster_from_probe(facts, probe, probe_s=1.0)
    assert (info.flops_rse, info.flops_repeats, info.bandwidth_rse, info.bandwidth_rounds) == (0.04, 16, 0.03, 7)
    old = cluster_from_probe(facts, {k: v for k, v in probe.items() if "rse" not in k and "rep" not in k
                                     and "rounds" not in k}, probe_s=1.0)
    assert old.flops_rse == 0.0 and old.bandwidth_rounds == 0  # an older probe's result: not measured


def test_a_calibration_is_cached_per_spark_task_cpus() -> None:
    # the ranks' threads follow spark.task.cpus, and the measured FLOP/s with them
    one = ClusterFacts(master="spark://m:7077", workers=2, executors=("e1:1", "e2:1"), slots=4)
    two = ClusterFacts(master="spark://m:7077", workers=2, executors=("e1:1", "e2:1"), slots=2, task_cpus=2)
    assert one.cache_key == "spark://m:7077|2|e1:1,e2:1"  # the default's key is unchanged
    assert two.cache_key != one.cache_key and two.cache_key.endswith("|cpus=2")
