"""The run's model step timed on the ranks anchors the planner's compute (issue 53, part 3:
"compute measured on the executors with the run's own threads"). The driver's profile predicted the
same GPT's step at 12 ms and at 51 ms in two fits while the ranks measured 26-34 ms: with a trial,
data parallel's predicted compute is the ranks' measured step at both calibration ends, the layers
keep their profiled split, and explain() says so. Numbers through price_plan (no Spark), and the
trial's step rule on a real model."""
from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
from torch import nn

from sparkdl.config import RunConfig
from sparkdl.driver.probe import model_step
from sparkdl.planner.candidates import price_plan
from sparkdl.planner.cluster import ClusterInfo, for_model, merge, with_step
from sparkdl.planner.ends import calibration_ends
from sparkdl.planner.step_trial import (MAX_TRIAL_BYTES, SCALE_LIMITS, lock_step_s, scale_to_trial, step_timer,
                                        step_trial, trial_key)
from tests.unit.test_planner_robust import OPS, calibration, mlp, model_costs


def config(**options):  # type: ignore[no-untyped-def]
    options = {"overlap_grads": False, "batch_size": 64, **options}
    return RunConfig.from_kwargs(feature_cols=[f"x{i}" for i in range(64)], label_col="label", num_workers=2,
                                 epochs=100, **options).validate()


def timed(cluster: ClusterInfo, median: tuple[float, float], best: tuple[float, float], key: str = "k") -> ClusterInfo:
    return dataclasses.replace(cluster, step_key=key, step_s=median, best_step_s=best, step_rse=0.03, step_repeats=9)


def priced(cluster: ClusterInfo):  # type: ignore[no-untyped-def]
    cfg = config()
    return price_plan(mlp(), cfg.data, cfg.train, cfg.launch, model_costs(), cluster, OPS, num_rows=1797)


def data_parallel(plan):  # type: ignore[no-untyped-def]
    return next(c for c in plan.candidates if c.label == "data_parallel")


def test_data_parallels_compute_is_the_slowest_ranks_measured_step_and_explain_says_so() -> None:
    fast_link = calibration((2e10, 2e10), 1e-4, 1e10, best_flops=(2.2e10, 2.2e10), best_latency=5e-5,
                            best_bandwidth=2e10)
    profiled = data_parallel(priced(fast_link)).compute_s
    for measured in (profiled * 3.0, profiled / 2.5):  # the profile too fast, then too slow
        plan = priced(timed(fast_link, (measured * 0.8, measured), (measured * 0.7, measured * 0.9)))
        assert data_parallel(plan).compute_s == pytest.approx(measured, rel=1e-6)
        # every candidate's compute moves with it: the layers keep their profiled split
        hybrid = next(c for c in plan.candidates if c.strategy == "hybrid")
        before = next(c for c in priced(fast_link).candidates if c.label == hybrid.label)
        assert hybrid.compute_s == pytest.approx(before.compute_s * measured / profiled, rel=0.02)
        note = next(n for n in plan.notes if "timed on the ranks" in n)
        assert f"{measured * 1e3:.2f} ms at batch 64" in note and f"{profiled * 1e3:.2f} ms" in note
        assert "scaled by" in note


def test_the_optimistic_end_takes_the_best_steps() -> None:
    cluster = timed(calibration((2e10, 2e10), 1e-4, 1e10, best_flops=(2.2e10, 2.1e10), best_latency=5e-5,
                                best_bandwidth=2e10), (0.020, 0.030), (0.015, 0.018))
    launch = config().launch
    measured, optimistic = calibration_ends(cluster, launch)
    assert measured.step_s == 0.030  # lock step: the slowest rank's median
    assert optimistic.step_s == 0.015  # ranks counted equal there: the fastest best
    unequal = dataclasses.replace(cluster, best_flops_per_s=(4e10, 1e10))
    assert calibration_ends(unequal, launch)[1].step_s == 0.018  # unequal ranks: the slowest's best


def test_no_trial_a_failed_one_or_a_wild_one_leaves_the_profile() -> None:
    cluster = calibration((2e10, 2e10), 1e-4, 1e10)
    profiled = data_parallel(priced(cluster)).compute_s
    failed = timed(cluster, (0.0, profiled), (0.0, profiled))  # a rank whose step raised reports 0
    assert data_parallel(priced(failed)).compute_s == pytest.approx(profiled)
    wild = timed(cluster, (profiled * 20, profiled * 20), (profiled * 20, profiled * 20))
    plan = priced(wild)
    assert data_parallel(plan).compute_s == pytest.approx(profiled)
    assert any("too far from the profile to trust" in n for n in plan.notes)
    assert not any("timed on the ranks" in n for n in priced(cluster).notes)
    assert lock_step_s(()) == 0.0 and lock_step_s((0.01, 0.0)) == 0.0 and lock_step_s((0.01, 0.02)) == 0.02
    assert scale_to_trial(0.0, 1.0) == 1.0 and scale_to_trial(1.0, SCALE_LIMITS[1] * 1.01) == 1.0
    assert scale_to_trial(0.01, 0.03) == pytest.approx(3.0)
    emulated = config(emulate_speed=[1.0, 0.5]).launch  # declared speeds are not measured ones
    assert calibration_ends(timed(cluster, (0.03, 0.03), (0.03, 0.03)), emulated)[0].step_s == 0.0


def test_a_step_timed_for_another_model_is_not_used() -> None:
    cluster = timed(calibration((2e10, 2e10), 1e-4, 1e10), (0.02, 0.03), (0.02, 0.03), key="other")
    assert for_model(cluster, "other").step_s == (0.02, 0.03)
    assert for_model(cluster, "mine").step_s == () and for_model(cluster, "").step_key == ""


def test_a_model_only_probe_is_matched_to_the_ranks_by_executor_and_merged_fastest() -> None:
    cluster = calibration((2e10, 2e10), 1e-4, 1e10)
    result = {"step": [0.03, 0.02], "step_best": [0.025, 0.015], "step_key": "k", "step_rse": 0.01,
              "step_repeats": 5, "executors": ["h:2", "h:1"]}  # this job placed rank 0 on h:2
    stepped = with_step(cluster, result)
    assert stepped.step_s == (0.02, 0.03) and stepped.best_step_s == (0.015, 0.025) and stepped.step_key == "k"
    assert with_step(cluster, {**result, "executors": ["x:1", "x:2"]}).step_s == ()  # unknown executors
    again = timed(cluster, (0.025, 0.025), (0.02, 0.02))
    assert merge(stepped, again).step_s == (0.02, 0.025)


def test_the_trial_covers_the_runs_step_and_refuses_what_it_cannot_time() -> None:
    cfg = config()
    trial = step_trial(mlp(), cfg.data, cfg.train, cfg.launch, 64)
    assert trial is not None and trial.inputs.shape == (64, 64) and trial.target.shape == (64,)
    assert trial.key == trial_key(trial.model, cfg.train, 64, trial.inputs)
    assert trial.key != step_trial(mlp(), config(batch_size=32).data, cfg.train, cfg.launch, 64).key
    for refused in (config(gpus_per_worker=1), config(emulate_speed=[1.0, 0.5])):
        assert step_trial(mlp(), refused.data, refused.train, refused.launch, 64) is None
    own = config(optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    assert step_trial(mlp(), own.data, own.train, own.launch, 64) is None
    big = nn.Linear(4096, MAX_TRIAL_BYTES // 4 // 4096 + 1)
    assert step_trial(big, cfg.data, cfg.train, cfg.launch, 4096) is None


def test_a_rank_times_the_step_and_reports_a_failing_one_as_zero() -> None:
    cfg = config()
    trial = step_trial(mlp(), cfg.data, cfg.train, cfg.launch, 64)
    timed_step = model_step((trial.key, pickle.dumps(trial)))
    assert timed_step["step"] > 0 and timed_step["step_best"] <= timed_step["step"]
    assert 3 <= timed_step["step_repeats"] and "step_error" not in timed_step
    broken = dataclasses.replace(trial, target=torch.zeros(3))  # a target the loss refuses
    failed = model_step((trial.key, pickle.dumps(broken)))
    assert failed["step"] == 0.0 and failed["step_error"]
    unpicklable = model_step((trial.key, b"not a pickle"))
    assert unpicklable["step"] == 0.0 and "UnpicklingError" in unpicklable["step_error"]
    # the same step rule as the driver's full-step profile: the weights move, a copy is given
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    step_timer(model, cfg.train, trial.inputs, trial.target)()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_explain_says_where_the_planning_time_went() -> None:
    cluster = dataclasses.replace(calibration((2e10, 2e10), 1e-4, 1e10), probe_s=4.2, probe_task_s=2.5)
    note = next(n for n in priced(cluster).notes if n.startswith("calibration time"))
    assert "the probe job took 4.2 s on the driver, 2.5 s of it measuring on the ranks" in note
    assert "the model's profile on the driver" in note
    assert not any(n.startswith("calibration time") for n in priced(calibration((2e10, 2e10), 1e-4, 1e10)).notes)
