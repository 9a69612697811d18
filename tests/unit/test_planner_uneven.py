"""The planner on ranks of unequal speed (issue 43, item 6; planner/uneven.py): lock-step priced at
the slowest rank, balanced data parallel at the mean's plus moved rows, per-rank speeds in
explain(), DiLoCo's H from measured compute and sync times, and the drift bound."""
from __future__ import annotations

import pytest

from sparkdl.planner import cost
from sparkdl.planner.uneven import DRIFT_BOUND, H_MAX, H_MIN, balanced, diloco_rounds, drift
from test_planner_robust import OPS, calibration, plan


def test_diloco_rounds_keep_the_sync_under_a_tenth_of_the_round() -> None:
    # sync 1 s, one inner step 0.1 s: H = 90 makes the sync 1/90 s per step, 10% of the round
    assert diloco_rounds(0.1, 1.0) == 90
    assert diloco_rounds(0.1, 1e-4) == H_MIN  # cheap syncs: the smallest H (closest to synchronous)
    assert diloco_rounds(0.001, 100.0) == H_MAX
    assert diloco_rounds(0.1, 1.0, multiple=4) % 4 == 0
    assert diloco_rounds(0.001, 100.0, run_steps=1000) == 50  # at least 20 rounds in the run
    every = diloco_rounds(0.05, 1.3)
    assert every == 235 and 1.3 / every <= 0.1 / 0.9 * 0.05 < 1.3 / (every - 5)


def test_balanced_data_parallel_costs_about_the_mean_rank() -> None:
    layers = (cost.LayerCost(params=1_000_000, flops=2e6, out_bytes=40.0, saved_bytes=40.0),)
    work = cost.Workload(layers=layers, world=3, rows=64, flops_per_s=1e10, optimizer_bytes_per_param=8,
                         input_bytes_per_row=256.0)
    net = cost.Network(latency_s=1e-4, bandwidth_Bps=1.25e8)
    speeds = (3e10, 3e10, 1e10)  # one rank at a third
    lock_step = cost.data_parallel(work, net)
    even = balanced(work, net, speeds, 256.0)
    assert even.compute_s == pytest.approx(lock_step.compute_s * 1e10 / (7e10 / 3))
    assert even.step_s < lock_step.step_s and even.bytes_per_step > lock_step.bytes_per_step  # rows move
    slow_link = balanced(work, cost.Network(latency_s=1e-4, bandwidth_Bps=1e3), speeds, 256.0)
    assert slow_link.step_s > even.step_s  # rows that cannot hide behind compute are paid for


def test_unequal_ranks_are_priced_and_explained() -> None:
    unequal = plan(calibration(flops=(4.5e10, 1.5e10), latency=3e-5, bandwidth=5e9, best_flops=(5e10, 1.6e10),
                               best_latency=2e-5, best_bandwidth=6e9), overlap_grads=True)
    labels = [c.label for c in unequal.candidates]
    assert "data_parallel(batch_balance=dynamic)" in labels, labels
    text = unequal.explain()
    assert "rank speeds (GFLOP/s): r0 45.0, r1 15.0" in text and "slowest rank's pace" in text
    assert unequal.choice.label == "data_parallel(batch_balance=dynamic)", text
    # Without point-to-point messages (Horovod) the shares are fixed at the start instead.
    from sparkdl.config import RunConfig
    from sparkdl.planner.candidates import price_plan
    from test_planner_robust import mlp, model_costs

    config = RunConfig.from_kwargs(feature_cols=[f"x{i}" for i in range(64)], label_col="label", batch_size=64,
                                   num_workers=2, epochs=100).validate()
    horovod = price_plan(mlp(), config.data, config.train, config.launch, model_costs(),
                         calibration(flops=(4.5e10, 1.5e10), latency=3e-5, bandwidth=5e9),
                         frozenset({"allreduce", "broadcast", "allgather", "barrier"}), num_rows=1797)
    assert "data_parallel(batch_balance=speed)" in [c.label for c in horovod.candidates]
    assert OPS  # the torch backend's operations are the default above


def test_drift_names_the_rank_that_moved_beyond_the_bound() -> None:
    assert drift([1.0, 1.0, 1.0], [1.0, 0.9, 1.1]) is None
    moved = drift([1.0, 1.0, 1.0], [1.0, 1.0, 0.3])
    assert moved is not None and moved.startswith("rank 2 runs at 0.30x") and f"bound {DRIFT_BOUND:g}x" in moved
    assert drift([1.0, 0.3], [1.0, 0.3]) is None  # slow as calibrated: the plan already knew
    assert drift([1.0], [0.1]) is None
