"""The resolved plan as a value users keep, end to end on local-cluster with a real MLflow server:
sparkdl.plan's value trains with exactly its layout (plan=), its JSON is the run's plan.json beside
plan.txt, and plan_from_run=<run id> trains with an earlier run's plan, neither planning again."""
from __future__ import annotations

import json

import pytest
from torch import nn

import sparkdl
from sparkdl import TorchEstimator
from sparkdl.datasets import DIGITS_FEATURE_COLS
from sparkdl.errors import ConfigError
from sparkdl.planner.resolved import ResolvedPlan


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))


def options(**extra):  # type: ignore[no-untyped-def]
    settings = dict(feature_cols=DIGITS_FEATURE_COLS, label_col="label", batch_size=64, num_workers=2, epochs=1,
                    progress=False, optimizer="sgd", lr=0.1)
    settings.update(extra)
    return settings


@pytest.fixture(scope="module")
def digits(spark):  # type: ignore[no-untyped-def]
    from sparkdl.datasets import digits_dataframe

    return digits_dataframe(spark).repartition(2).cache()


def forbid_planning(monkeypatch):  # type: ignore[no-untyped-def]
    """A tripwire: from now on a fit that plans (or calibrates, or cuts stages) again fails loudly."""
    import sparkdl.driver.planning as planning

    def refuse(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("planned again although a kept plan was given")

    for name in ("make_plan", "plan_strategy", "measured_links", "calibrate"):
        if hasattr(planning, name):
            monkeypatch.setattr(planning, name, refuse)


def test_a_kept_plan_trains_with_its_layout_and_is_logged(digits, mlflow_server, monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from mlflow import MlflowClient

    hybrid = ResolvedPlan.from_json(_planned_hybrid(digits).to_json())  # as if read back from a file
    forbid_planning(monkeypatch)
    fitted = TorchEstimator(model=model, plan=hybrid, tracking_uri=mlflow_server.uri, experiment="sparkdl-plans",
                            **options()).fit(digits)
    assert fitted.options["train.strategy"] == "hybrid" and fitted.options["train.microbatches"] == 2
    assert fitted.history[0]["hybrid_grid"] == [list(r) for r in hybrid.layout.grid]
    assert fitted.plan is not None and fitted.plan.layout == hybrid.layout
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    run = client.get_run(fitted.run_id)
    assert run.data.params["plan.reused"] == "true" and run.data.params["hybrid.stages"] == "2"
    with open(client.download_artifacts(fitted.run_id, "plan.json", str(tmp_path))) as stream:
        saved = json.load(stream)
    assert saved["strategy"] == "hybrid" and saved["layout"]["cuts"] == list(hybrid.layout.cuts)
    with open(client.download_artifacts(fitted.run_id, "plan.txt", str(tmp_path))) as stream:
        assert "2 stages x 1 replicas" in stream.read()

    # plan_from_run: the same layout from that run's plan.json, again without planning
    again = TorchEstimator(model=model, plan_from_run=fitted.run_id, tracking_uri=mlflow_server.uri,
                           experiment="sparkdl-plans", **options()).fit(digits)
    assert again.plan.layout == hybrid.layout and again.options["train.strategy"] == "hybrid"


def _planned_hybrid(digits):  # type: ignore[no-untyped-def]
    plan = sparkdl.plan(model, digits, **options(strategy="hybrid", microbatches=2, tracking=False))
    assert plan.strategy == "hybrid" and plan.layout.stages == 2 and plan.layout.microbatches == 2
    assert "2 stages x 1 replicas" in plan.explain()
    return plan


def test_a_kept_plan_for_another_world_fails_before_any_job(digits) -> None:  # type: ignore[no-untyped-def]
    kept = _planned_hybrid(digits)
    with pytest.raises(ConfigError, match="made for 2 workers, but launch.num_workers=1"):
        TorchEstimator(model=model, plan=kept, **options(num_workers=1, tracking=False)).fit(digits)
    with pytest.raises(ConfigError, match="both plan= and train.plan_from_run"):
        TorchEstimator(model=model, plan=kept.to_json(), plan_from_run="abc", **options(tracking=False))
    with pytest.raises(ConfigError, match="cannot read plan.json of MLflow run"):
        TorchEstimator(model=model, plan_from_run="0" * 32, **options(tracking=False,
                                                                         tracking_uri="sqlite:///:memory:")).fit(digits)
