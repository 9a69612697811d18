"""The one rule that decides whether unequal speeds cost a run something a user should act on
(executor/pace.py, issue 52): the monitor names slow ranks by it, the rebalancer re-splits (and says
speeds drifted) by it. Noise on sub-millisecond steps never qualifies; a rank slowed for real does,
once it lasts WINDOW measurements. No Spark."""
from __future__ import annotations

import os
import sys
from typing import Any

import pytest

from sparkdl.driver.monitor import RunMonitor
from sparkdl.executor.pace import (MIN_LOST_S, WINDOW, Cost, Sustained, costs_the_run, slow_rank_message,
                                   slow_ranks_in_groups, with_costs)
from sparkdl.executor.rebalance import resplit, split_cost, window_cost

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "support"))


def test_one_measurement_costs_the_run_above_the_floor_and_the_share() -> None:
    assert not costs_the_run(Cost(0.0002, 0.0005))  # 40% of a 0.5 ms step: noise, whatever its share
    assert not costs_the_run(Cost(MIN_LOST_S * 0.9, 0.010))  # below the absolute floor
    assert not costs_the_run(Cost(0.020, 2.0))  # 20 ms of a 2 s step: 1%, not worth acting on
    assert costs_the_run(Cost(0.030, 0.045))
    assert Cost(0.03, 0.0).share == 0.0


def test_a_cost_must_last_a_window_of_measurements_in_a_row() -> None:
    costly, cheap = Cost(0.03, 0.05), Cost(0.0001, 0.0004)
    streaks = Sustained()
    assert WINDOW >= 2
    assert streaks.update({1: costly}) == []  # one bad epoch (warm-up, a neighbour's burst) is not enough
    assert streaks.update({1: costly}) == [1]
    assert streaks.update({1: cheap}) == []  # a cheap measurement breaks the streak
    assert streaks.update({1: costly}) == []
    assert streaks.update({}) == []  # absent from a record: it cost nothing that time
    assert streaks.update({1: costly, 0: costly}) == []
    assert streaks.update({1: costly, 0: costly}) == [1, 0]


def demo_epoch(compute: tuple[float, float], steps: int = 23) -> dict[str, Any]:
    """Figures like `make demo`'s: two ranks on two cores, sub-millisecond steps, one rank measured
    slower by noise (the ranks' compute seconds over the epoch)."""
    rows = 368.0
    speeds = [rows / compute[0], rows / compute[1]]
    slow = slow_ranks_in_groups(speeds, ["10.0.0.1", "10.0.0.1"], [[0, 1]])
    step_seconds = [max(compute) + 0.004, max(compute) + 0.004]
    return {"slow": slow, "kept": with_costs(slow, list(compute), step_seconds, [[0, 1]], steps)}


def test_the_demos_noise_is_measured_but_never_kept_as_a_slow_rank() -> None:
    # rank 0 "1.6x slower than the median" (of two: their mean), 12.6 ms over 23 steps: 0.55 ms a step
    epoch = demo_epoch((0.0226, 0.010))
    assert [e["rank"] for e in epoch["slow"]] == [0]  # slower than the factor...
    assert epoch["kept"] == []  # ...but it costs nothing a user could act on


def test_a_rank_slowed_for_real_is_kept_with_what_it_costs() -> None:
    epoch = demo_epoch((0.020 + 14 * 0.030, 0.020), steps=14)  # 30 ms a step more, as tests/spark/test_pace.py
    (entry,) = epoch["kept"]
    assert entry["rank"] == 0 and entry["lost_s_per_step"] == pytest.approx(0.030)
    assert entry["step_s"] > entry["lost_s_per_step"]
    message = slow_rank_message(entry, 0.99)
    assert message.startswith("sparkdl: rank 0 on host 10.0.0.1 computes 11.5x slower than the median; ")
    assert "of step time is spent waiting for it (30 ms a step)" in message
    # Held against its own peers: three ranks, one slow; the others' median is the baseline.
    slow = slow_ranks_in_groups([100.0, 100.0, 20.0], ["a", "b", "c"], [[0, 1, 2]])
    (kept,) = with_costs(slow, [1.0, 1.0, 5.0], [5.5, 5.5, 5.5], [[0, 1, 2]], 100)
    assert kept["rank"] == 2 and kept["lost_s_per_step"] == pytest.approx(0.04)
    assert with_costs(slow, [1.0, 1.0, 5.0], [5.5, 5.5, 5.5], [[0, 1, 2]], 0) == []


def test_the_rebalancer_asks_the_same_rule() -> None:
    even = [0.5, 0.5]
    # 32 rows a step at tens of thousands of rows/s: a re-split would save 0.2 ms a step
    cost = split_cost(even, [50_000.0, 15_000.0], 32, 1)
    assert cost is not None and cost.lost_s < MIN_LOST_S and resplit(even, [50_000.0, 15_000.0], 32, 1) is None
    # the same ratio at 500 rows/s: 22 ms a step saved
    assert resplit(even, [500.0, 150.0], 32, 1) == pytest.approx([500 / 650, 150 / 650])
    assert split_cost(even, [500.0, 0.0], 32, 1) is None


def test_an_agreement_is_judged_on_its_own_steps_and_keyed_by_the_rank_that_sets_the_pace() -> None:
    even = [0.5, 0.5]
    (rank, cost), = window_cost(even, [500.0, 150.0], 32, 1).items()
    assert rank == 1 and costs_the_run(cost)
    assert list(window_cost(even, [150.0, 500.0], 32, 1)) == [0]
    assert list(window_cost([0.8, 0.2], [500.0, 500.0], 32, 1)) == [0]  # too many rows on a rank as fast
    assert window_cost(even, [500.0, 0.0], 32, 1) == {}


def test_a_burst_moving_from_rank_to_rank_is_no_streak() -> None:
    from gloo_world import run_world
    from test_rebalance import _epoch

    # A loaded machine: each window one rank or the other is starved (3x slower, 16 rows at 100 rows/s).
    results = run_world(2, _epoch, [[100.0, 100 / 3], [100 / 3, 100.0]] * 3, 2)
    assert results[0]["counts"] == {"rebalances": 0, "rows_moved": 0}


def test_sub_millisecond_noise_never_re_splits_nor_says_speeds_drifted() -> None:
    from gloo_world import run_world
    from test_rebalance import _epoch  # the exchange's own harness: speeds injected per step

    results = run_world(2, _epoch, [[60_000.0, 15_000.0]], 2)  # 4x apart, 16 rows a step: under a millisecond
    assert results[0]["counts"] == {"rebalances": 0, "rows_moved": 0}  # and no "speed_drift"
    assert results[0]["rows"] == [16] * 10 + [3]


class _Tracker:
    def __init__(self) -> None:
        self.texts: list[tuple[str, str]] = []

    def log_text(self, text: str, name: str) -> None:
        self.texts.append((name, text))

    def log_metric_points(self, points: Any) -> None:
        pass

    def set_tags(self, tags: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:  # the world's params/metrics/tags: not what these tests read
        return lambda *args, **kwargs: None


def _record(epoch: int, slow: list[dict[str, Any]], **more: Any) -> dict[str, Any]:
    return {"epoch": epoch, "loss": 0.5, "wait_fraction": 0.4, "slow_ranks": slow, **more}


def test_the_monitor_names_a_rank_once_its_cost_lasts_the_window(capsys) -> None:  # type: ignore[no-untyped-def]
    monitor = RunMonitor(_Tracker(), progress=False)
    costly = {"rank": 1, "host": "h1", "slower": 3.0, "lost_s_per_step": 0.03, "step_s": 0.05}
    monitor.on_message({"kind": "epoch", "record": _record(0, [costly])})
    assert "rank 1" not in capsys.readouterr().err  # one epoch: not yet
    monitor.on_message({"kind": "epoch", "record": _record(1, [costly])})
    err = capsys.readouterr().err
    assert "sparkdl: rank 1 on host h1 computes 3.0x slower than the median; 60% of step time" in err
    monitor.on_message({"kind": "epoch", "record": _record(2, [costly])})
    assert "rank 1" not in capsys.readouterr().err  # once per run
    monitor.flush()


def test_the_monitor_says_nothing_for_records_without_a_cost(capsys) -> None:  # type: ignore[no-untyped-def]
    monitor = RunMonitor(_Tracker(), progress=False)
    for epoch in range(15):  # the demo's epochs: noise is left out of slow_ranks by the ranks
        monitor.on_message({"kind": "epoch", "record": _record(epoch, [])})
    old = {"rank": 0, "host": "h0", "slower": 1.6}  # a record written before costs were kept
    monitor.on_message({"kind": "epoch", "record": _record(15, [old])})
    monitor.on_message({"kind": "epoch", "record": _record(16, [old])})
    assert "sparkdl:" not in capsys.readouterr().err
    monitor.on_message({"kind": "epoch", "record": _record(17, [], speed_drift="rank 0 runs at 0.3x",
                                                           batch_rows_per_rank=[40, 24])})
    assert "measured speeds left the run's starting point (rank 0 runs at 0.3x)" in capsys.readouterr().err
