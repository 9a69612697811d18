"""Hybrid pipeline x data without Spark: schedules, stage cuts, driver-side checks, and the
strategy itself on real gloo process groups (spawned processes) against data parallel."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gloo_world import run_world
from sparkdl.config import RunConfig
from sparkdl.errors import ConfigError, ModelError, ResourceError
from sparkdl.planner.partition import balanced_cuts, stage_costs
from sparkdl.planner.profile import profile_sequential
from sparkdl.planner.stages import check_data_parallel_memory, plan_hybrid
from sparkdl.model.layouts import HybridLayout, default_grid
from sparkdl.strategies.hybrid import microbatch_sizes
from sparkdl.strategies.schedules import SCHEDULES, gpipe, max_in_flight, one_f_one_b


# -- schedules -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("stages,micro", [(2, 1), (2, 4), (3, 5), (4, 2), (4, 16)])
def test_every_schedule_runs_each_microbatch_forward_then_backward_once(name: str, stages: int, micro: int) -> None:
    for stage in range(stages):
        ops = SCHEDULES[name](stage, stages, micro)
        assert sorted(i for k, i in ops if k == "F") == list(range(micro))
        assert sorted(i for k, i in ops if k == "B") == list(range(micro))
        for i in range(micro):
            assert ops.index(("F", i)) < ops.index(("B", i))


def sections(c: RunConfig) -> tuple[Any, Any, Any]:
    """The sections the planner's hybrid functions take: data, train, launch."""
    return c.data, c.train, c.launch


def test_in_flight_microbatches_gpipe_m_and_1f1b_at_most_k_minus_stage() -> None:
    assert [max_in_flight(gpipe(k, 4, 8)) for k in range(4)] == [8, 8, 8, 8]
    assert [max_in_flight(one_f_one_b(k, 4, 8)) for k in range(4)] == [4, 3, 2, 1]
    assert max_in_flight(one_f_one_b(0, 4, 2)) == 2  # never more than the micro-batches there are


def test_schedules_cannot_deadlock_with_async_sends() -> None:
    """Simulate K stages where a forward needs the previous stage's forward and a backward the next
    stage's backward: every op must eventually run."""
    for name, schedule in SCHEDULES.items():
        for stages, micro in [(2, 3), (3, 7), (4, 4), (5, 2)]:
            queues = [list(schedule(k, stages, micro)) for k in range(stages)]
            done: set[tuple[int, str, int]] = set()
            progress = True
            while progress:
                progress = False
                for k, queue in enumerate(queues):
                    while queue:
                        kind, i = queue[0]
                        need = (k - 1, "F", i) if kind == "F" and k > 0 else \
                            (k + 1, "B", i) if kind == "B" and k < stages - 1 else None
                        if need is not None and need not in done:
                            break
                        done.add((k, kind, i))
                        queue.pop(0)
                        progress = True
            assert not any(queues), f"{name} deadlocks with K={stages}, m={micro}"


def test_microbatch_sizes_cover_every_row() -> None:
    assert microbatch_sizes(10, 4) == [3, 3, 2, 2]
    assert microbatch_sizes(3, 8) == [1, 1, 1]  # a short last batch: fewer micro-batches, none empty
    assert sum(microbatch_sizes(1001, 16)) == 1001


def test_default_grid_puts_the_loss_of_replica_zero_on_rank_zero() -> None:
    grid = default_grid(2, 3)
    assert grid[0][-1] == 0
    assert sorted(r for row in grid for r in row) == list(range(6))


# -- stage cuts ----------------------------------------------------------------------------------
def test_balanced_cuts_minimise_the_slowest_stage() -> None:
    assert balanced_cuts([1, 1, 1, 1], 2) == [0, 2, 4]
    assert balanced_cuts([5, 1, 1, 1, 1, 1], 2) == [0, 1, 6]
    cuts = balanced_cuts([1, 2, 3, 4, 5, 6, 7, 8, 9], 3)
    assert max(stage_costs([1, 2, 3, 4, 5, 6, 7, 8, 9], cuts)) == 17  # the optimum (brute force below)
    costs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    best = min(max(sum(costs[:a]), sum(costs[a:b]), sum(costs[b:]))
               for a in range(1, 7) for b in range(a + 1, 8))
    assert max(stage_costs(costs, balanced_cuts(costs, 3))) == best
    with pytest.raises(ValueError):
        balanced_cuts([1.0], 2)


def test_profile_measures_cost_not_layer_count() -> None:
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.ReLU(), nn.ReLU(), nn.ReLU(), nn.Linear(512, 512))
    profile = profile_sequential(model, (512,), rows=256)
    assert profile.layers[0].params == 512 * 512 + 512
    assert profile.layers[0].out_shape == (512,) and profile.layers[0].out_bytes == 512 * 4
    assert profile.layers[1].saved_bytes == 512 * 4  # ReLU keeps its output for backward
    cuts = balanced_cuts([layer.seconds for layer in profile.layers], 2)
    assert cuts[1] in (1, 2, 3, 4, 5)
    # The two Linear layers dominate, so each stage gets one; a count-balanced cut would be [0, 3, 6]
    # with both heavy layers' costs split the same way, but the measured cut must separate them.
    assert cuts[1] < 6 and cuts[1] > 0
    assert all(p.grad is None for p in model.parameters())  # the dry run leaves the model untouched


# -- driver-side checks --------------------------------------------------------------------------
def config(**options: Any) -> RunConfig:
    base = {"feature_cols": ["f"], "strategy": "hybrid", "num_workers": 4, "batch_size": 8}
    base.update(options)
    return RunConfig.from_kwargs(**base).validate()


def deep_mlp(width: int = 32, depth: int = 4) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(8, width), nn.ReLU()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 3))


def test_stages_must_divide_the_world_size() -> None:
    with pytest.raises(ConfigError, match=r"train.stages=3 does not divide launch.num_workers=4"):
        config(stages=3)


def test_more_stages_than_layers() -> None:
    with pytest.raises(ConfigError, match=r"train.stages=4 but the model has only 2 top-level layer"):
        plan_hybrid(nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 3)), *sections(config(stages=4)), 8, "int64")


def test_a_model_that_is_not_sequential_cannot_be_cut() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x)

    with pytest.raises(ModelError, match="cuts an nn.Sequential.*Net"):
        plan_hybrid(Net(), *sections(config(stages=2)), 8, "int64")


def test_a_layer_returning_a_tuple_cannot_be_a_stage_boundary() -> None:
    class Pair(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x

    with pytest.raises(ModelError, match=r"layer 1 \(Pair\) returns tuple"):
        plan_hybrid(nn.Sequential(nn.Linear(8, 8), Pair(), nn.Linear(8, 3)), *sections(config(stages=2)), 8, "int64")


def test_more_microbatches_than_rows_per_replica() -> None:
    with pytest.raises(ConfigError, match=r"train.microbatches=17 is larger than the per-replica batch \(2 stages "
                                          r"x batch_size 8 = 16 rows\)"):
        plan_hybrid(deep_mlp(), *sections(config(stages=2, microbatches=17)), 8, "int64")


def test_horovod_has_no_send_recv_for_hybrid() -> None:
    from sparkdl.api import check_backend

    with pytest.raises(ConfigError, match="needs send_recv, subgroup.*backend='horovod'"):
        horovod = config(backend="horovod")
        check_backend(horovod.train, horovod.launch)


def test_plan_balances_and_fills_the_layout() -> None:
    layout, profile, memory = plan_hybrid(deep_mlp(), *sections(config(stages=2, schedule="gpipe")), 8, "int64")
    assert layout.stages == 2 and layout.replicas == 2 and layout.microbatches == 8  # 4 x K by default
    assert layout.cuts[0] == 0 and layout.cuts[-1] == len(profile.layers)
    assert layout.boundary_shapes == ((profile.layers[layout.cuts[1] - 1].out_shape),)
    assert len(memory) == 2 and all(m.state_bytes > 0 for m in memory)


def test_memory_budget_refuses_data_parallel_and_picks_enough_stages() -> None:
    model = deep_mlp(width=256, depth=6)  # ~270k params: ~4.3 MB of Adam training state
    dp = config(strategy="data_parallel", max_memory_per_rank="3MB")
    with pytest.raises(ResourceError, match="max_memory_per_rank='3MB'.*") as info:
        check_data_parallel_memory(model, *sections(dp), 8)
    assert "strategy='hybrid'" in str(info.value)
    layout, _, memory = plan_hybrid(model, *sections(config(max_memory_per_rank="3MB")), 8, "int64")
    assert layout.stages == 2 and max(m.total for m in memory) <= 3e6
    with pytest.raises(ResourceError, match="no hybrid layout fits"):
        plan_hybrid(model, *sections(config(max_memory_per_rank="1MB")), 8, "int64")


# -- the strategy on real process groups ---------------------------------------------------------
def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def _hybrid_rank(comm: Any, stages: int, schedule: str) -> tuple[int, Any, list, list, dict]:
    from sparkdl.strategies.data_parallel import DataParallel
    from sparkdl.strategies.hybrid import Hybrid

    rank, world = comm.rank, comm.size
    if stages == 1:
        strategy: Any = DataParallel(comm)
    else:
        cuts = {2: (0, 2, 5), 3: (0, 1, 3, 5)}[stages]
        strategy = Hybrid(comm, HybridLayout(
            stages=stages, replicas=world // stages, cuts=cuts, boundary_shapes=((16,),) * (stages - 1),
            boundary_dtypes=("float32",) * (stages - 1), input_shape=(8,), label_dtype="int64", microbatches=4,
            schedule=schedule, grid=default_grid(stages, world // stages)))
    # SGD with momentum: per-stage optimizer state, without Adam's amplification of rounding noise.
    strategy.setup(_model(), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), F.cross_entropy)
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own rows, as from Spark
    losses = []
    for _ in range(3):
        x, y = torch.randn(10, 8, generator=generator), torch.randint(0, 3, (10,), generator=generator)
        losses.append((float(strategy.train_step(x, y)), strategy.loss_rows(10)))
    held_out = [(torch.randn(5 + rank, 8, generator=generator), torch.randint(0, 3, (5 + rank,), generator=generator))]
    sums = comm.allreduce(strategy.evaluate(held_out, F.cross_entropy, True), "sum")
    state = strategy.result_state()
    return (rank, {k: v.numpy() for k, v in state.items()} if state else None, losses, sums.tolist(),
            strategy.epoch_metrics())


def _run(world: int, stages: int, schedule: str = "1f1b") -> tuple[dict[str, np.ndarray], list[Any]]:
    results = run_world(world, _hybrid_rank, stages, schedule)
    state: dict[str, np.ndarray] = {}
    for _, part, *_ in results:
        if part:
            assert not set(part) & set(state), "two ranks returned the same layer"
            state.update(part)
    return state, results


@pytest.mark.parametrize("world,stages,schedule", [(2, 2, "1f1b"), (4, 2, "gpipe"), (3, 3, "1f1b")])
def test_hybrid_update_equals_data_parallel_on_the_same_rows(world: int, stages: int, schedule: str) -> None:
    reference, dp_results = _run(world, 1)
    state, results = _run(world, stages, schedule)
    assert sorted(state) == sorted(reference)  # the stages together are the whole model
    for key in reference:
        np.testing.assert_allclose(state[key], reference[key], atol=1e-5, err_msg=key)
    # Validation through the pipeline sees every rank's held-out rows: same sums as data parallel.
    np.testing.assert_allclose(results[0][3], dp_results[0][3], rtol=1e-5)
    # The mean loss over all rows, weighted by loss_rows, equals data parallel's first-step loss.
    def first_loss(res: list[Any]) -> float:
        pairs = [r[2][0] for r in res]
        return sum(loss * rows for loss, rows in pairs) / sum(rows for _, rows in pairs)
    assert first_loss(results) == pytest.approx(first_loss(dp_results), rel=1e-5)
    # Each rank holds only its stage: fewer parameter bytes than the whole model.
    whole = dp_results[0][4]["param_bytes"]
    assert max(r[4]["param_bytes"] for r in results) < whole
    assert sum(results[r][4]["param_bytes"] for r in default_grid(stages, world // stages)[0]) == whole


def test_cuts_respect_the_memory_budget_and_float_boundaries() -> None:
    assert balanced_cuts([1, 1, 1, 1], 2, lambda k, i, j: j - i <= 3 and (j == 4 or j != 2)) in ([0, 1, 4], [0, 3, 4])
    with pytest.raises(ValueError):
        balanced_cuts([1, 1, 1, 1], 2, lambda k, i, j: False)

    class ToIndex(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x > 0).long()

    class Embed(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.float() * 2

    layout, _, _ = plan_hybrid(nn.Sequential(nn.Linear(8, 8), ToIndex(), Embed(), nn.Linear(8, 3)),
                               *sections(config(stages=2)), 8, "int64")
    assert layout.cuts[1] != 2  # never after the integer output
    with pytest.raises(ModelError, match=r"layer\(s\) 0 \(ToIndex: int64\)"):
        plan_hybrid(nn.Sequential(ToIndex(), Embed()), *sections(config(stages=2)), 8, "int64")
