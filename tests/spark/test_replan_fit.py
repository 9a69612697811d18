"""Issue 53, item 4: a re-plan on drift moves a running fit from data parallel to DiLoCo and back
exactly at epoch boundaries, the weights continuous, and the history (and MLflow, and the console,
once a switch) says where.

The plan is the planner's value for "auto" choosing data parallel with DiLoCo beside it (kept and
passed as plan=, as sparkdl.plan's value is), so the test fixes the predictions; the drift is the
test's own slow link (tests/support/slow_link.py): model-sized allreduces take 0.3 s longer for the
first two epochs' steps, and every step computes 40 ms. Data parallel then measures ~0.34 s a step
against 40 ms predicted, every rank waiting on the wire: after 2 epochs (the sustained window) the
run switches to DiLoCo (H=4). The link is fast from then on, so DiLoCo's syncs show it is not the
bound: after 2 more epochs it switches back, and the last 2 epochs train data parallel."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from slow_link import SlowLinkLoss
from sparkdl import TorchEstimator
from sparkdl.config import TrainConfig
from sparkdl.planner.plan import Candidate, Plan
from sparkdl.planner.resolved import ResolvedPlan

STEPS_PER_EPOCH = 9  # 1026 rows over 2 ranks in batches of 64: the larger shard's 513+ rows


def auto_plan() -> ResolvedPlan:
    """What strategy="auto" resolves to when it chooses data parallel over DiLoCo (k = 1.5 where the
    planner states steps factors)."""
    dp = Candidate("data_parallel", (("strategy", "data_parallel"), ("sync", "allreduce")), 0.040, 1e3, 1e6, True, "")
    diloco = Candidate("diloco", (("strategy", "data_parallel"), ("sync", "diloco"), ("sync_every", 4)),
                       0.041, 3e2, 1e6, True, "")
    if "steps_factor" in {f.name for f in dataclasses.fields(Candidate)}:
        diloco = dataclasses.replace(diloco, steps_factor=1.5)
    plan = Plan(candidates=(dp, diloco), chosen=0, world=2, latency_s=1e-4, bandwidth_Bps=1.25e9)
    return ResolvedPlan.build(TrainConfig(strategy="data_parallel"), 2, None, {"plan.chosen": "data_parallel"}, plan)


def rows(spark):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(5)
    x = rng.normal(size=(1026 + 128, 8))
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(int)
    data = [(*map(float, r), int(t)) for r, t in zip(x, y)]
    cols = [f"f{i}" for i in range(8)]
    train = spark.createDataFrame(data[:1026], cols + ["label"]).repartition(2).cache()
    return train, spark.createDataFrame(data[1026:], cols + ["label"]).cache(), data[1026:], cols


def test_replan_on_drift_moves_a_fit_to_diloco_and_back_at_epoch_boundaries(spark, mlflow_server, capfd) -> None:  # type: ignore[no-untyped-def]
    from mlflow.tracking import MlflowClient

    train, validation, held_out, cols = rows(spark)
    model = TorchEstimator(model=lambda: nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)),
                           feature_cols=cols, label_col="label", epochs=6, batch_size=64, num_workers=2, lr=0.01,
                           loss=SlowLinkLoss(slow_steps=2 * STEPS_PER_EPOCH, delay_s=0.3, compute_s=0.04),
                           plan=auto_plan(), overlap_grads=False, emulate_network={"latency_ms": 0, "gbps": 100},
                           validation_df=validation, tracking_uri=mlflow_server.uri, experiment="sparkdl-replan",
                           progress=False).fit(train)
    history = model.history
    assert [h["sync"] for h in history] == ["allreduce"] * 2 + ["diloco"] * 2 + ["allreduce"] * 2, history
    switches = {h["epoch"]: h["replanned"] for h in history if "replanned" in h}
    assert sorted(switches) == [1, 3]
    there, back = switches[1], switches[3]
    assert (there["from"], there["to"], back["from"], back["to"]) == ("allreduce", "diloco", "diloco", "allreduce")
    assert there["measured_step_s"] > 1.25 * there["predicted_step_s"] == pytest.approx(1.25 * 0.040)
    assert history[0]["step_measured_s"] > 0.3 and history[4]["step_predicted_s"] == pytest.approx(0.040)
    assert all(h["outer_syncs"] >= 1 for h in history[2:4])  # DiLoCo synced: its link was measured

    # weights continuous: no jump in the training loss at either switch; the model returned is the
    # one every rank validated at the end (data parallel again: one model on every rank)
    losses = [h["loss"] for h in history]
    assert losses[2] < 1.1 * losses[1] and losses[4] < 1.1 * losses[3] and losses[-1] < losses[0], losses
    vx = torch.tensor([r[:-1] for r in held_out], dtype=torch.float32)
    vy = torch.tensor([r[-1] for r in held_out])
    with torch.no_grad():
        assert float(F.cross_entropy(model.torch_module()(vx), vy)) == pytest.approx(history[-1]["val_loss"], rel=1e-5)

    err = capfd.readouterr().err
    assert err.count("sparkdl: re-planned after epoch 1: data parallel -> DiLoCo from epoch 2 on") == 1, err[-3000:]
    assert err.count("sparkdl: re-planned after epoch 3: DiLoCo -> data parallel from epoch 4 on") == 1
    client = MlflowClient(mlflow_server.uri)
    run = client.search_runs([client.get_experiment_by_name("sparkdl-replan").experiment_id])[0]
    assert run.data.tags["sparkdl.replan.after_epoch_1"] == "allreduce -> diloco"
    assert run.data.tags["sparkdl.replan.after_epoch_3"] == "diloco -> allreduce"
    synced = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "epoch_sync_diloco"))
    assert [v for _, v in synced] == [0.0, 0.0, 1.0, 1.0, 0.0, 0.0]
