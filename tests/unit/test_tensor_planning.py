"""The planner on tensor-column models, without Spark: profiles run on the run's own sample rows
(token ids stay ids), hybrid layouts carry any boundary shape, IST is left out with its reason."""
from __future__ import annotations

import math

import torch
from sparkdl_test_models import TOKEN_LEN, TOKEN_VOCAB, TOKEN_WIDTH, tiny_gpt

from sparkdl.config import RunConfig
from sparkdl.data.layout import FIXED, FeedLayout, TensorColumn
from sparkdl.planner.candidates import price_plan, profile_model
from sparkdl.planner.cluster import ClusterInfo
from sparkdl.planner.profile import ModelInput, profile_sequential
from sparkdl.driver.planning import model_input, plan_strategy

TOKENS = TensorColumn("tokens", "__sparkdl_in_0", FIXED, "int32", "int64", (TOKEN_LEN,))
LABEL = TensorColumn("targets", "__sparkdl_label", FIXED, "int32", "int64", (TOKEN_LEN,))
FEED = FeedLayout(num_features=0, label_dtype="int64", inputs=(TOKENS,), label=LABEL, num_classes=TOKEN_VOCAB)


def sample(rows: int = 4) -> tuple[torch.Tensor, torch.Tensor, None]:
    ids = torch.randint(0, TOKEN_VOCAB, (rows, TOKEN_LEN + 1), generator=torch.Generator().manual_seed(0))
    return (ids[:, :-1],), ids[:, 1:], None


def config(**options) -> RunConfig:  # type: ignore[no-untyped-def]
    return RunConfig.from_kwargs(input_cols=["tokens"], label_col="targets", num_workers=2, batch_size=16,
                                 **options).validate()


def test_profiles_run_on_tiled_sample_rows_and_see_the_blocks_shapes() -> None:
    inputs = model_input(FEED, sample())
    assert inputs.shape == (TOKEN_LEN,) and inputs.dtype == "int64" and inputs.label_shape == (TOKEN_LEN,)
    tiled = inputs.rows(10)
    assert tiled.shape == (10, TOKEN_LEN) and tiled.dtype == torch.int64 and torch.equal(tiled[4], tiled[0])
    profile = profile_sequential(tiny_gpt(), inputs, rows=8)
    assert [layer.out_shape for layer in profile.layers] == [(TOKEN_LEN, TOKEN_WIDTH)] * 3 + [(TOKEN_LEN, TOKEN_VOCAB)]
    assert all(layer.seconds > 0 for layer in profile.layers)
    assert profile.layers[1].saved_bytes > 0  # attention blocks keep activations for backward
    assert inputs.bytes_per_row == 8 * TOKEN_LEN  # int64 ids


def test_hybrid_layout_of_a_token_model_carries_its_input_and_boundaries() -> None:
    hybrid = config(strategy="hybrid", stages=2)
    layout, params = plan_strategy(tiny_gpt(), hybrid.data, hybrid.train, hybrid.launch, FEED,
                                   inputs=model_input(FEED, sample()))
    assert layout.input_shape == (TOKEN_LEN,) and layout.input_dtype == "int64"
    assert layout.label_shape == (TOKEN_LEN,)
    assert layout.boundary_shapes == ((TOKEN_LEN, TOKEN_WIDTH),) and layout.boundary_dtypes == ("float32",)


def test_the_planner_prices_a_token_model_and_leaves_ist_out() -> None:
    cfg = config()
    costs = profile_model(tiny_gpt(), cfg.data, cfg.train, cfg.launch, model_input(FEED, sample()))
    assert costs.input_bytes == 8 * TOKEN_LEN and costs.num_features == 0 and costs.subnet is None
    inf = float("inf")
    cluster = ClusterInfo(master="local-cluster[2,2,1024]", workers=2, executors=("h:1", "h:2"),
                          flops_per_s=(5e9, 5e9), latency_s=((0.0, 1e-4), (1e-4, 0.0)),
                          bandwidth_Bps=((inf, 1e9), (1e9, inf)), measured_at=0.0, probe_s=1.0,
                          rank_executors=("h:1", "h:2"), collective_latency_s=1e-4, collective_bandwidth_Bps=1e9,
                          threads_per_rank=(1, 1))
    from sparkdl.comm import backend_class

    plan = price_plan(tiny_gpt(), cfg.data, cfg.train, cfg.launch, costs, cluster, backend_class("torch").ops, num_rows=2048)
    by_strategy = {c.strategy: c for c in plan.candidates}
    assert not by_strategy["ist"].feasible and "input_cols" in by_strategy["ist"].reason
    assert by_strategy["data_parallel"].feasible and math.isfinite(by_strategy["data_parallel"].predicted_step_s)
    assert any(c.strategy == "hybrid" and c.feasible for c in plan.candidates)
    assert plan.choice.strategy in ("data_parallel", "diloco", "hybrid")


class Bilinear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(y)


def test_random_rows_for_feature_vectors_as_before() -> None:
    assert ModelInput.of(8).rows(3).shape == (3, 8) and ModelInput.of((2, 4)).shape == (2, 4)
    # two inputs reach the first layer of the first stage; the layout keeps their structure
    hybrid = config(strategy="hybrid", stages=2)
    layout, _ = plan_strategy(torch.nn.Sequential(Bilinear(), torch.nn.Linear(2, 2)),
                              hybrid.data, hybrid.train, hybrid.launch, FEED,
                              inputs=ModelInput.from_sample((torch.zeros(2, 4), torch.zeros(2, 4)), torch.zeros(2)))
    assert layout.input_specs == (("", (4,), "float32"), ("", (4,), "float32"))
