"""executor/pace.py: each rank's compute time, speed and waits, and the ranks named as slow."""
from __future__ import annotations

import pytest

from sparkdl.driver.monitor import pace_points
from sparkdl.executor.pace import pace_figures, slow_rank_message, slow_ranks, slow_ranks_in_groups, wait_fraction


def test_compute_is_step_time_less_the_collective_waits() -> None:
    figures = pace_figures([10.0, 10.0, 10.0], [7.0, 6.5, 0.5], [300, 300, 300])
    assert figures["compute_seconds_by_rank"] == [3.0, 3.5, 9.5]
    assert figures["rows_per_compute_s_by_rank"] == pytest.approx([100.0, 300 / 3.5, 300 / 9.5])
    assert pace_figures([1.0], [2.0], [5])["compute_seconds_by_rank"] == [0.0]  # clock skew never goes below 0
    assert pace_figures([1.0], [1.0], [5])["rows_per_compute_s_by_rank"] == [0.0]
    assert wait_fraction([10.0, 10.0, 10.0], [7.0, 6.5, 0.5]) == pytest.approx(14 / 30)
    assert wait_fraction([0.0], [0.0]) == 0.0


def test_a_rank_more_than_one_and_a_half_times_slower_than_the_median_is_named_with_its_host() -> None:
    hosts = ["h0", "h1", "h2", "h3"]
    assert slow_ranks([100.0, 100.0, 100.0, 34.0], hosts) == [{"rank": 3, "host": "h3", "slower": 100 / 34.0}]
    assert slow_ranks([100.0, 100.0, 100.0, 70.0], hosts) == []  # 1.43x: within the bound
    assert [e["rank"] for e in slow_ranks([100.0, 20.0, 100.0, 40.0], hosts)] == [1, 3]  # slowest first
    assert slow_ranks([100.0], hosts[:1]) == [] and slow_ranks([0.0, 5.0], hosts[:2]) == []
    # Pipeline stages do different work: a rank is held against its own stage's replicas only.
    speeds, four = [100.0, 10.0, 90.0, 3.0], ["h0", "h1", "h2", "h3"]
    assert slow_ranks_in_groups(speeds, four, [[0, 2], [1, 3]]) == [{"rank": 3, "host": "h3", "slower": 6.5 / 3.0}]
    assert slow_ranks_in_groups(speeds, four, [[0], [1], [2], [3]]) == []  # no peers: nobody to compare with
    message = slow_rank_message({"rank": 2, "host": "10.0.0.3", "slower": 2.94}, 0.41)
    assert message == ("sparkdl: rank 2 on host 10.0.0.3 computes 2.9x slower than the median; 41% of step time "
                       "is spent waiting for it")


def test_the_pace_reaches_mlflow_as_metrics() -> None:
    points = pace_points({"wait_fraction": 0.25, "rows_per_compute_s_by_rank": [10.0, 5.0],
                          "compute_seconds_by_rank": [1.0, 2.0], "wait_seconds_by_rank": [1.0, 0.0]})
    assert points == {"epoch_wait_fraction": 0.25, "rows_per_compute_s_rank_0": 10.0, "rows_per_compute_s_rank_1": 5.0,
                      "compute_seconds_rank_0": 1.0, "compute_seconds_rank_1": 2.0, "wait_seconds_rank_0": 1.0,
                      "wait_seconds_rank_1": 0.0}
    assert pace_points({"loss": 1.0}) == {}


def test_every_backends_collectives_count_once_as_this_threads_blocked_time(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import itertools
    import threading

    import torch

    import sparkdl.comm.base as base
    from sparkdl.comm.base import Communicator, WorldInfo, blocked_seconds

    class Fake(Communicator):
        def allreduce(self, tensor, op="sum"):  # type: ignore[no-untyped-def]
            return tensor

        def broadcast(self, tensor, src=0):  # type: ignore[no-untyped-def]
            return tensor

        def allgather(self, tensor):  # type: ignore[no-untyped-def]
            return [tensor]

        def barrier(self) -> None:
            pass

    ticks = itertools.count()
    monkeypatch.setattr(base.time, "perf_counter", lambda: float(next(ticks)))  # each timed call: exactly 1 s
    comm = Fake(WorldInfo(0, 1, 0, 1, ("h",), "h", 1))
    before = blocked_seconds()
    comm.reduce_scatter(torch.zeros(2))  # the interface's reduce_scatter runs allreduce: counted once
    assert blocked_seconds() - before == 1.0
    comm.allreduce(torch.zeros(1))
    assert blocked_seconds() - before == 2.0
    other = threading.Thread(target=lambda: comm.barrier())
    other.start()
    other.join()
    assert blocked_seconds() - before == 2.0  # another thread's collective is not this thread's wait


def test_a_backends_own_collective_counts_as_a_wait() -> None:
    import time

    from sparkdl.comm.base import blocked_seconds, blocking

    before = blocked_seconds()
    assert blocking(lambda: time.sleep(0.05) or "done") == "done"  # Horovod's synchronize(), say
    assert blocked_seconds() - before >= 0.05
