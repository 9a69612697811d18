"""The re-plan rule of executor/replan.py (issue 53, item 4), on figures alone: no torch, no Spark."""
from __future__ import annotations

import pytest

from sparkdl.config import TrainConfig
from sparkdl.errors import ConfigError
from sparkdl.executor.replan import (BACK_TO_EXACT, LEAVE_EXACT, Pace, Replanner, Streak, judge, pace_of,
                                     target_options)
from sparkdl.planner.plan import Candidate, Plan
from sparkdl.wire.replan import ReplanFigures, replan_figures

FIGURES = ReplanFigures(exact_step_s=0.010, diloco_step_s=0.009,
                        diloco_options=(("sync", "diloco"), ("sync_every", 10)), diloco_steps_factor=1.5)


def record(compute: list[float], waits: list[float], steps: int = 10, **extra: object) -> dict:
    return {"steps": steps, "compute_seconds_by_rank": compute, "wait_seconds_by_rank": waits, **extra}


def test_pace_under_data_parallel_takes_the_slowest_step_and_the_least_wait():
    pace = pace_of(record([0.10, 0.05], [0.40, 0.45]), "allreduce", FIGURES)
    assert pace == Pace(step_s=pytest.approx(0.05), compute_s=pytest.approx(0.01), link_s=pytest.approx(0.04))


def test_pace_under_diloco_is_the_link_per_whole_model_exchange_in_fp32():
    int8 = ReplanFigures(0.01, 0.01, (("sync", "diloco"), ("sync_every", 10), ("sync_dtype", "int8")))
    pace = pace_of(record([0.1, 0.1], [0.02, 0.03], outer_sync_seconds_by_rank=[0.04, 0.05], outer_syncs=4,
                          outer_fragments=2), "diloco", int8)
    # 2 whole-model exchanges of 0.02 s each in int8 -> 0.08 s in fp32, per optimizer step
    assert pace is not None and pace.link_s == pytest.approx(0.08)
    assert pace_of(record([0.1, 0.1], [0.0, 0.0], outer_sync_seconds_by_rank=[0.0, 0.0], outer_syncs=0),
                   "diloco", int8) is None  # no sync this epoch: nothing said about the link


def test_slow_link_leaves_data_parallel():
    # predicted 10 ms; measured 50 ms, of which every rank waited 40 ms for the wire
    verdict = judge("allreduce", Pace(step_s=0.050, compute_s=0.010, link_s=0.040), FIGURES)
    assert verdict.switch and verdict.drift == pytest.approx(4.0)
    assert verdict.diloco_s == pytest.approx(0.014) and verdict.win >= LEAVE_EXACT


def test_slow_compute_is_no_reason_to_leave_exact():
    # as slow, but computing (a busy host): the link explains nothing, DiLoCo would not help
    assert not judge("allreduce", Pace(step_s=0.050, compute_s=0.049, link_s=0.001), FIGURES).switch


def test_within_tolerance_stays_even_where_diloco_would_win():
    assert not judge("allreduce", Pace(step_s=0.012, compute_s=0.002, link_s=0.010), FIGURES).switch


def test_sub_millisecond_drift_is_noise():
    tiny = ReplanFigures(0.0004, 0.0003, (("sync", "diloco"), ("sync_every", 10)))
    assert not judge("allreduce", Pace(step_s=0.0020, compute_s=0.0002, link_s=0.0018), tiny).switch


def test_close_call_stays_exact():
    # 25 % slower than predicted, link-bound, but DiLoCo with k=1.5 is not LEAVE_EXACT times sooner
    slower = ReplanFigures(0.100, 0.09, FIGURES.diloco_options, diloco_steps_factor=1.5)
    verdict = judge("allreduce", Pace(step_s=0.130, compute_s=0.075, link_s=0.055), slower)
    assert verdict.drift > 0.25 and verdict.win < LEAVE_EXACT and not verdict.switch


def test_diloco_goes_back_when_the_link_is_not_the_bound():
    back = judge("diloco", Pace(step_s=0.010, compute_s=0.010, link_s=0.001), FIGURES)
    assert back.switch and back.win < BACK_TO_EXACT
    stay = judge("diloco", Pace(step_s=0.014, compute_s=0.010, link_s=0.040), FIGURES)
    assert not stay.switch and stay.win >= BACK_TO_EXACT


def test_streak_needs_a_sustained_window():
    streak = Streak(window=2)
    assert [streak.update(v) for v in (True, False, True, True)] == [False, False, False, True]


def test_switch_options():
    assert target_options("diloco", FIGURES, False) == {"sync": "allreduce"}
    streamed = ReplanFigures(0.01, 0.01, (("sync", "diloco"), ("sync_every", 64), ("fragments", 4),
                                          ("sync_dtype", "int8")))
    assert target_options("allreduce", streamed, False)["fragments"] == 4
    # batch_balance="dynamic": plain DiLoCo (the uneven-worker sync weighs the replicas' rows)
    assert target_options("allreduce", streamed, True) == {"sync": "diloco", "sync_every": 64, "sync_dtype": "int8"}


class FakeStrategy:
    """What Replanner asks of strategies/data_parallel.DataParallel."""

    can_switch_sync = True

    def __init__(self) -> None:
        self.sync_mode = "allreduce"
        self.switches: list[dict] = []

    def switch_sync(self, options: dict) -> None:
        self.switches.append(options)
        self.sync_mode = options["sync"]


def test_replanner_switches_at_the_window_and_records_where():
    strategy = FakeStrategy()
    planner = Replanner(FIGURES, strategy, accumulate=1, dynamic_balance=False)
    slow = record([0.1, 0.1], [0.4, 0.4])  # 50 ms a step, 40 of them on the wire
    history = []
    for epoch in range(2):
        history.append(dict(slow))
        planner.after_epoch(history[-1], epoch, last=False)
    assert "replanned" not in history[0] and history[1]["replanned"]["from"] == "allreduce"
    assert history[1]["replanned"]["to"] == "diloco" and strategy.sync_mode == "diloco"
    assert history[0]["sync"] == "allreduce" and history[0]["step_measured_s"] == pytest.approx(0.05)
    fast = record([0.1, 0.1], [0.0, 0.0], outer_sync_seconds_by_rank=[0.001, 0.002], outer_syncs=1)
    for epoch in (2, 3):
        history.append(dict(fast))
        planner.after_epoch(history[-1], epoch, last=False)
    assert history[3]["replanned"]["to"] == "allreduce" and strategy.sync_mode == "allreduce"
    assert "re-planned after epoch 3" in history[3]["replanned"]["reason"]


def test_no_switch_after_the_last_epoch():
    strategy = FakeStrategy()
    planner = Replanner(FIGURES, strategy, accumulate=1, dynamic_balance=False)
    for epoch in range(2):
        planner.after_epoch(record([0.1, 0.1], [0.4, 0.4]), epoch, last=epoch == 1)
    assert strategy.switches == []


def _plan(chosen: int = 0) -> Plan:
    dp = Candidate("data_parallel", (("strategy", "data_parallel"), ("sync", "allreduce")), 0.01, 1e6, 1e6, True, "")
    diloco = Candidate("diloco", (("strategy", "data_parallel"), ("sync", "diloco"), ("sync_every", 32)),
                       0.004, 1e4, 1e6, True, "")
    return Plan(candidates=(dp, diloco), chosen=chosen, world=2, latency_s=1e-4, bandwidth_Bps=1e9)


def test_figures_come_from_the_plan_only_for_auto_data_parallel():
    train = TrainConfig(strategy="data_parallel")
    figures = replan_figures(_plan(), train)
    assert figures is not None and figures.exact_step_s == 0.01 and figures.diloco_step_s == 0.004
    assert figures.sync_every == 32 and dict(figures.diloco_options)["sync"] == "diloco"
    assert replan_figures(None, train) is None  # a named strategy: no plan, no re-plan
    assert replan_figures(_plan(), TrainConfig(strategy="data_parallel", replan="off")) is None
    assert replan_figures(_plan(chosen=1), TrainConfig(strategy="data_parallel", sync="diloco")) is None


def test_replan_option_is_validated():
    with pytest.raises(ConfigError, match="train.replan"):
        TrainConfig(replan="sometimes").validate()
