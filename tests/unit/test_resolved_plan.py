"""The resolved plan as a value users keep, without Spark: its JSON round trip (layouts, the planner's
candidates), and a kept plan reused on a run it fits, or refused with the difference named."""
from __future__ import annotations

import json
import math

import pytest
from torch import nn

from sparkdl.config import RunConfig
from sparkdl.data.layout import FeedLayout
from sparkdl.errors import ConfigError
from sparkdl.model.layouts import HybridLayout, IstLayout, default_grid
from sparkdl.planner.plan import Candidate, Plan
from sparkdl.driver.planning import plan_strategy
from sparkdl.driver.planning import reuse as reuse_sections
from sparkdl.planner.resolved import ResolvedPlan

FEED = FeedLayout(num_features=8, label_dtype="int64", source_feature_cols=("x",), num_classes=3)


def reuse(plan, module, config, layout):  # type: ignore[no-untyped-def]
    return reuse_sections(plan, module, config.data, config.train, config.launch, layout)


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


def config(**options: object) -> RunConfig:
    base = dict(feature_cols=["x"], num_workers=2, batch_size=8, tracking=False, progress=False)
    base.update(options)
    return RunConfig.from_kwargs(**base).validate()


def auto_plan() -> Plan:
    candidates = (
        Candidate("data_parallel", (("strategy", "data_parallel"), ("sync", "allreduce")), 0.02, 1e6, 2e6, True, "r0",
                  compute_s=0.01, comm_s=0.01),
        Candidate("hybrid", (("strategy", "hybrid"), ("stages", 2), ("microbatches", 4)), 0.01, 1e4, 1e6, True, "r1",
                  compute_s=0.008, comm_s=0.002),
        Candidate("ist", (("strategy", "ist"), ("ist_sync_every", 30)), math.inf, math.inf, math.inf, False,
                  "not an MLP"),
    )
    return Plan(candidates=candidates, chosen=1, world=2, latency_s=1e-4, bandwidth_Bps=1e9,
                notes=("a note",), executor_links=(("a:1", "b:2", 1e-4, 1e9),))


def hybrid_resolved() -> ResolvedPlan:
    cfg = config(strategy="hybrid", stages=2, microbatches=4)
    layout, params = plan_strategy(mlp(), cfg.data, cfg.train, cfg.launch, FEED)
    return ResolvedPlan.build(cfg.train, cfg.launch.num_workers, layout, params, auto_plan())


def test_json_round_trip_keeps_the_layout_and_the_candidates() -> None:
    plan = hybrid_resolved()
    assert isinstance(plan.layout, HybridLayout) and plan.strategy == "hybrid"
    text = plan.to_json()
    strict = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} is not strict JSON"))
    assert strict["layout"]["kind"] == "hybrid" and strict["auto"]["candidates"][2]["predicted_step_s"] == "inf"
    back = ResolvedPlan.from_json(text)
    assert back == plan  # the config is not part of the value
    assert back.layout == plan.layout and isinstance(back.layout.grid[0], tuple)
    assert back.candidates == plan.candidates and math.isinf(back.candidates[2].predicted_step_s)
    assert back.choice is not None and back.choice.label == "hybrid(stages=2, microbatches=4)"
    assert back.options["stages"] == 2 and back.options["strategy"] == "hybrid"
    assert "chosen:" in back.explain() and "2 stages x 1 replicas" in back.explain()


@pytest.mark.filterwarnings("ignore:sparkdl. IST deals")
def test_ist_and_data_parallel_plans_round_trip() -> None:
    cfg = config(strategy="ist")
    layout, params = plan_strategy(nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 3)), cfg.data,
                                   cfg.train, cfg.launch, FEED)
    ist = ResolvedPlan.build(cfg.train, cfg.launch.num_workers, layout, params)
    assert isinstance(ist.layout, IstLayout)
    assert ResolvedPlan.from_json(ist.to_json()) == ist
    diloco_config = config(strategy="data_parallel", sync="diloco", sync_every=7)
    diloco = ResolvedPlan.build(diloco_config.train, diloco_config.launch.num_workers, None, {})
    assert diloco.strategy == "diloco" and diloco.candidates == () and diloco.choice is None
    assert ResolvedPlan.from_json(diloco.to_json()) == diloco


@pytest.mark.parametrize("text", ["", "{}", "[1, 2]", '{"format": 99}', '{"format": 1, "strategy": "x"}'])
def test_what_is_not_a_plan_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError, match="not a sparkdl plan"):
        ResolvedPlan.from_json(text)


def test_a_kept_plan_is_reused_without_planning() -> None:
    kept = ResolvedPlan.from_json(hybrid_resolved().to_json())
    reused = reuse(kept, mlp(), config(), FEED)  # the user's strategy is "auto": the plan decides
    assert reused.layout == kept.layout and reused.train is not None
    assert reused.train.strategy == "hybrid" and reused.train.stages == 2
    assert reused.as_params()["plan.reused"] == "true" and reused.auto == kept.auto


@pytest.mark.parametrize("change, message", [
    (dict(num_workers=4), "made for 2 workers, but launch.num_workers=4"),
    (dict(strategy="ist"), "train.strategy='ist' contradicts plan="),
    (dict(batch_size=1), "4 micro-batches exceed 2 stages x batch_size 1"),
])
def test_a_kept_plan_that_does_not_fit_the_run_is_refused(change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        reuse(hybrid_resolved(), mlp(), config(**change), FEED)


@pytest.mark.filterwarnings("ignore:sparkdl. IST deals")
def test_a_kept_plan_for_another_model_or_input_is_refused() -> None:
    kept = hybrid_resolved()
    with pytest.raises(ConfigError, match="nn.Sequential of 5 layers, the model has 3"):
        reuse(kept, nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)), config(), FEED)
    wider = FeedLayout(num_features=9, label_dtype="int64")
    with pytest.raises(ConfigError, match=r"planned for float32 inputs of shape \[8\] per row, this data has float32 of shape \[9\]"):
        reuse(kept, mlp(), config(), wider)
    cfg = config(strategy="ist")
    ist_layout, params = plan_strategy(nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 3)), cfg.data,
                                       cfg.train, cfg.launch, FEED)
    ist = ResolvedPlan.build(cfg.train, cfg.launch.num_workers, ist_layout, params)
    with pytest.raises(ConfigError, match="hidden widths \\[64\\]"):
        reuse(ist, nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3)), config(), FEED)


def test_the_default_grid_survives_json() -> None:
    layout = HybridLayout(stages=2, replicas=2, cuts=(0, 2, 5), boundary_shapes=((16,),), boundary_dtypes=("float32",),
                          input_shape=(8,), label_dtype="int64", microbatches=4, schedule="1f1b",
                          grid=default_grid(2, 2))
    plan = ResolvedPlan(strategy="hybrid", settings=(("strategy", "hybrid"), ("stages", 2)), world=4, layout=layout)
    assert ResolvedPlan.from_json(plan.to_json()).layout.grid == ((1, 0), (3, 2))


def test_a_plan_file_and_its_errors(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from sparkdl.api import kept_plan

    plan = hybrid_resolved()
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    assert kept_plan(None, config(plan_file=str(path))) == plan
    assert kept_plan(plan.to_json(), config()) == plan
    with pytest.raises(ConfigError, match="cannot read train.plan_file"):
        kept_plan(None, config(plan_file=str(tmp_path / "missing.json")))
    with pytest.raises(ConfigError, match="both plan= and train.plan_file are set"):
        kept_plan(plan, config(plan_file=str(path)))
    with pytest.raises(ConfigError, match="plan_from_run and train.plan_file are both set"):
        config(plan_file=str(path), plan_from_run="abc")
    with pytest.raises(ConfigError, match="plan= must be the ResolvedPlan"):
        kept_plan(42, config())  # type: ignore[arg-type]


def test_a_kept_hybrid_plan_for_other_layer_widths_or_over_the_budget_is_refused() -> None:
    kept = hybrid_resolved()  # cut after layer 2: 16 values per row cross the boundary
    wider = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))
    with pytest.raises(ConfigError, match=r"exchange float32 rows of shape \[16\].*outputs float32 of shape \[32\]"):
        reuse(kept, wider, config(), FEED)
    with pytest.raises(ConfigError, match="needs about .* MiB per rank .* over launch.max_memory_per_rank='1KB'"):
        reuse(kept, mlp(), config(max_memory_per_rank="1KB"), FEED)
    assert reuse(kept, mlp(), config(max_memory_per_rank="1GB"), FEED).layout == kept.layout
