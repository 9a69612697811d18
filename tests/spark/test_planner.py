"""The planner on local-cluster: a plan with every candidate and its reasons, choices that follow the
network and the memory budget, strategy="auto" end to end, and `sparkdl plan`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch import nn

import sparkdl
from sparkdl import TorchEstimator
from sparkdl.datasets import DIGITS_FEATURE_COLS


def wide() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def common(**options):  # type: ignore[no-untyped-def]
    settings = dict(feature_cols=DIGITS_FEATURE_COLS, label_col="label", batch_size=64, num_workers=2,
                    tracking=False, progress=False)
    settings.update(options)
    return settings


@pytest.fixture(scope="module")
def digits(spark):  # type: ignore[no-untyped-def]
    from sparkdl.datasets import digits_dataframe

    return digits_dataframe(spark).repartition(2).cache()


def test_plan_lists_every_candidate_and_explains(digits) -> None:  # type: ignore[no-untyped-def]
    plan = sparkdl.plan(wide, digits, **common(emulate_network={"latency_ms": 1.0, "gbps": 0.01}))
    strategies = {c.strategy for c in plan.candidates}
    assert strategies == {"data_parallel", "diloco", "hybrid", "ist", "sharded"}
    for candidate in plan.candidates:
        assert candidate.predicted_step_s > 0 and candidate.memory_bytes > 0
    for candidate in plan.candidates:
        assert candidate.reason, f"{candidate.label} has no reason in the table"
    text = plan.explain()
    assert "EMULATED" in text and "chosen:" in text and "hybrid(stages=2" in text
    # 10 Mbit/s: a 4.5 MB gradient allreduce per step dominates; an exact strategy is not worth it.
    assert plan.strategy in ("ist", "diloco")


def test_compute_bound_steps_keep_data_parallel(digits) -> None:  # type: ignore[no-untyped-def]
    # Large batches of a small model: the step is compute-bound even on this host's real loopback (an
    # emulated link is never faster than the real one), so the exact strategy is kept.
    model = lambda: nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),  # noqa: E731
                                  nn.Linear(256, 10))
    plan = sparkdl.plan(model, digits, **common(batch_size=4096, emulate_network={"latency_ms": 0.0, "gbps": 1000.0}))
    dp = next(c for c in plan.candidates if c.strategy == "data_parallel")
    assert dp.comm_s <= 0.2 * dp.compute_s, plan.explain()
    assert plan.strategy == "data_parallel"


def test_a_budget_that_excludes_data_parallel(digits) -> None:  # type: ignore[no-untyped-def]
    plan = sparkdl.plan(wide, digits, **common(max_memory_per_rank="12MB",
                                                emulate_network={"latency_ms": 0.1, "gbps": 10.0}))
    dp = next(c for c in plan.candidates if c.strategy == "data_parallel")
    assert not dp.feasible and "over the budget" in dp.reason
    assert plan.choice.feasible and plan.strategy != "data_parallel"


def test_auto_is_the_default_and_fits_with_the_chosen_strategy(digits) -> None:  # type: ignore[no-untyped-def]
    # 4 epochs of 14 steps at 10 Mbit/s: data parallel's 4.5 MB allreduce per step would take minutes.
    model = TorchEstimator(model=wide, epochs=4, lr=1e-3,
                           **common(emulate_network={"latency_ms": 1.0, "gbps": 0.01})).fit(digits)
    options = model.options
    assert options["train.strategy"] == "ist" or options["train.sync"] == "diloco", options
    assert model.history[-1]["steps"] >= 10


def test_a_short_run_keeps_exact_updates(digits) -> None:  # type: ignore[no-untyped-def]
    # 100 Mbit/s: ~0.08 s per exact step (hybrid), ~0.01 s for IST; one epoch is 14 steps
    network = {"latency_ms": 0.5, "gbps": 0.1}
    short = sparkdl.plan(wide, digits, **common(epochs=1, emulate_network=network))
    assert short.strategy in ("data_parallel", "hybrid") and "too short" in short.choice.reason, short.explain()
    long = sparkdl.plan(wide, digits, **common(epochs=100, emulate_network=network))
    assert long.strategy in ("ist", "diloco"), long.explain()
    exact = sparkdl.plan(wide, digits, **common(epochs=100, emulate_network=network, approximate_min_speedup=1e9))
    assert exact.strategy in ("data_parallel", "hybrid") and "an approximate strategy needs" in exact.choice.reason


def test_cli_plan_prints_the_table(spark, repo_root: Path, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from sparkdl import cli
    from sparkdl.datasets import digits_dataframe

    path = tmp_path / "digits.parquet"
    digits_dataframe(spark).write.parquet(str(path))
    rc = cli.main(["plan", "--conf", str(repo_root / "conf" / "examples" / "digits.toml"),
                   "--set", f"input.path={path}", "--set", "tracking.progress=false",
                   "--set", "launch.emulate_network={latency_ms = 1.0, gbps = 0.1}",
                   "--out", str(tmp_path / "plan.json")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "chosen:" in out and "data_parallel" in out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["emulated"] is True and summary["strategy"]
    from sparkdl.planner.resolved import ResolvedPlan

    kept = ResolvedPlan.from_json((tmp_path / "plan.json").read_text())  # for --set train.plan_file=...
    assert kept.strategy == summary["strategy"] and kept.options == summary["options"]


def test_cluster_info_records_spark_resources(spark) -> None:  # type: ignore[no-untyped-def]
    from sparkdl.driver.planning import calibrate

    info = calibrate(spark, 2, refresh=True)
    assert info.slots == 4 and info.executor_memory == "1g" and len(info.executors) == 2
    assert len(info.flops_per_s) == 2 and min(info.flops_per_s) > 1e8
    latency, bandwidth = info.worst_link()
    assert 0 < latency < 0.1 and bandwidth > 1e6
    # the probe reports the threads its ranks ran with, and the optimistic end of every measurement
    assert len(info.threads_per_rank) == 2 and min(info.threads_per_rank) >= 1
    assert all(b >= m for b, m in zip(info.best_flops_per_s, info.flops_per_s))
    best_latency, best_bandwidth = info.optimistic().worst_link()
    assert 0 < best_latency <= latency and best_bandwidth >= bandwidth
    # repeated until settled (or the budget ran out): the confidence reached is part of the figures
    assert info.flops_repeats >= 10 and 3 <= info.bandwidth_rounds <= 12
    assert 0 <= info.flops_rse < 1 and 0 <= info.bandwidth_rse < 1
    assert calibrate(spark, 2).measured_at == info.measured_at  # cached


def test_batches_shared_by_speed_give_the_step_over_all_rows(spark) -> None:  # type: ignore[no-untyped-def]
    import numpy as np
    import torch

    rng = np.random.default_rng(2)
    x = rng.normal(size=(64, 5)).astype(np.float32)
    y = rng.integers(0, 3, size=64)
    cols = ["a", "b", "c", "d", "e", "label"]
    # Two partitions, rows 0-31 and 32-63: partition r is rank r's shard.
    df = spark.sparkContext.parallelize([(*map(float, r), int(t)) for r, t in zip(x, y)], 2).toDF(cols)

    def factory() -> nn.Module:
        return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))

    model = TorchEstimator(model=factory, optimizer="sgd", lr=0.5, feature_cols=cols[:-1], label_col="label",
                           batch_size=32, epochs=1, num_workers=2, shuffle=False, seed=7, tracking=False,
                           progress=False, batch_balance="speed", emulate_speed=[1.0, 1 / 3]).fit(df)
    assert model.options["train.strategy"] == "data_parallel"
    assert model.history[0]["batch_rows_per_rank"] == [48, 16] and model.history[0]["steps"] == 1

    # Rank 0 (speed 1) takes 48 rows: its 32, then the first 16 again; rank 1 (speed 1/3) its first 16.
    rows = list(range(32)) + list(range(16)) + list(range(32, 48))
    torch.manual_seed(7)
    reference = factory()
    loss = nn.functional.cross_entropy(reference(torch.tensor(x[rows])), torch.tensor(y[rows]))
    loss.backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    for (name, got), want in zip(model.torch_module().state_dict().items(), reference.state_dict().values()):
        assert torch.max(torch.abs(got - want)).item() < 1e-5, name


def test_the_planner_shares_batches_on_ranks_of_different_speeds(digits) -> None:  # type: ignore[no-untyped-def]
    model = lambda: nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),  # noqa: E731
                                  nn.Linear(256, 10))
    options = common(batch_size=4096, epochs=1, emulate_speed=[1.0, 0.25],
                     emulate_network={"latency_ms": 0.0, "gbps": 1000.0})
    plan = sparkdl.plan(model, digits, **options)
    equal = next(c for c in plan.candidates if c.label == "data_parallel")
    # rows re-split by speed, moved point to point (gloo): batch_balance="dynamic"
    shared = next(c for c in plan.candidates if c.label == "data_parallel(batch_balance=dynamic)")
    # the slow rank sets the pace with equal shares: 1 / 0.25 vs 1 / mean(1, 0.25) of the fast rank's time
    assert shared.compute_s < 0.75 * equal.compute_s, plan.explain()
    assert plan.choice.label == shared.label and "EMULATED speeds" in plan.explain()
    assert not any(c.feasible for c in plan.candidates if c.strategy in ("hybrid", "ist"))
    fitted = TorchEstimator(model=model, **options).fit(digits)
    assert fitted.options["train.batch_balance"] == "dynamic"
    assert fitted.history[0]["batch_rows_per_rank"] == [6554, 1638]  # from the declared speeds at once


def test_the_models_step_is_timed_on_the_executors_and_anchors_the_plan(spark, digits, tmp_path, monkeypatch
                                                                         ) -> None:  # type: ignore[no-untyped-def]
    """The run's model, from a file only the driver can import (shipped by value for the probe as
    for the training job), timed on each executor with the calibration; a model the executors
    cannot rebuild leaves the calibration and the plan as the profile alone makes them."""
    import sys

    from sparkdl.driver.planning import calibrate
    from sparkdl.planner.step_trial import step_trial

    (tmp_path / "driver_only_net.py").write_text(
        "import os\nfrom torch import nn\n\n"
        "class Net(nn.Sequential):\n"
        "    def __init__(self):\n"
        "        super().__init__(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 10))\n\n"
        "class DriverBound(Net):\n"
        "    def __setstate__(self, state):  # rebuilt only in the process that built it\n"
        "        if state.get('_built_in') != os.getpid():\n"
        "            raise RuntimeError('this model only rebuilds on the driver')\n"
        "        super().__setstate__(state)\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self._built_in = os.getpid()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import driver_only_net

    settings = sparkdl.RunConfig.from_kwargs(**common()).validate()
    trial = step_trial(driver_only_net.Net(), settings.data, settings.train, settings.launch, 64)
    calibrate(spark, 2, refresh=True)
    cached = calibrate(spark, 2)
    timed = calibrate(spark, 2, trial=trial)  # the cluster's figures cached: a probe of the model alone
    assert timed.measured_at == cached.measured_at and timed.step_key == trial.key
    assert len(timed.step_s) == 2 and all(0 < b <= m < 5 for b, m in zip(timed.best_step_s, timed.step_s))
    assert calibrate(spark, 2, trial=trial) == timed  # cached with it
    plan = sparkdl.plan(driver_only_net.Net, digits, **common())
    assert "timed on the ranks" in plan.explain() and "s of it measuring on the ranks" in plan.explain()
    # an MLP IST may train (512 hidden units: 256 a rank): one IST round ran on the executors too, and prices IST
    assert "IST: one round of 30 steps timed on the ranks prices it" in plan.explain()

    bound = step_trial(driver_only_net.DriverBound(), settings.data, settings.train, settings.launch, 64)
    failed = calibrate(spark, 2, refresh=True, trial=bound)
    assert failed.step_key == bound.key and failed.step_s == (0.0, 0.0) and len(failed.flops_per_s) == 2
    plan = sparkdl.plan(driver_only_net.DriverBound, digits, **common())
    assert plan.strategy and "timed on the ranks" not in plan.explain()
    del sys.modules["driver_only_net"]
