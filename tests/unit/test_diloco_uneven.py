"""DiLoCo on uneven workers (strategies/diloco_uneven.py) on real gloo process groups: Dynamic Local
Updates and sample-weighted pseudo-gradients against a by-hand reference (Nesterov and Delayed
Nesterov), the agreed H_w from injected speeds, bounded staleness under a slow replica (and the stale
rule replayed by hand from the recorded schedule), DSSP's r*, and the options' checks."""
from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gloo_world import run_world
from sparkdl.config import RunConfig, TrainConfig
from sparkdl.errors import ConfigError
from sparkdl.strategies.diloco_uneven import (DelayedNesterov, agreed_plan, dynamic_local_steps, echoes,
                                              extra_rounds)

pytestmark = pytest.mark.timeout(180)
WORLD = 2
ROWS = (6, 10)  # rows per batch on each rank: unequal, so the sample weights matter
SPEEDS = (3.0, 1.0)  # injected inner steps/s: rank 0 three times as fast


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 3))


def batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(70 + rank)
    return [(torch.randn(ROWS[rank], 8, generator=generator), torch.randint(0, 3, (ROWS[rank],), generator=generator))
            for _ in range(steps)]


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.5)


# --- pure rules ------------------------------------------------------------------------------------
def test_dynamic_local_steps_follow_the_measured_speeds() -> None:
    assert dynamic_local_steps([3.0, 1.0], 4) == [12, 4]  # H_top = 12: floor(v_w / v_max * 12)
    assert dynamic_local_steps([1.0, 0.5, 0.25], 10) == [40, 20, 10]
    assert dynamic_local_steps([1.0, 0.6], 5) == [8, 5]  # floor(5 / 0.6) = 8; the slowest at least H
    assert dynamic_local_steps([10.0, 1.0], 5) == [20, 5]  # at most ECHO_LIMIT x H
    assert dynamic_local_steps([2.0, 2.0], 7) == [7, 7]
    for steps in (4, 7, 12):  # a round's echoes add up, every batch gets at least one inner step
        counts = [echoes(i, 4, steps) for i in range(4)]
        assert sum(counts) == steps and min(counts) >= 1


def test_dssp_grants_the_extra_rounds_that_meet_the_slow_replicas_next_arrival() -> None:
    # fast arrives at 0, 1, 2, ...; slow at 2.7, 5.2, 7.7, 10.2: closest at r = 5 (gap 0.2; r = 10 ties, fewer wins)
    assert extra_rounds(0.0, 1.0, 2.7, 2.5, 12) == 5
    assert extra_rounds(0.0, 1.0, 2.7, 2.5, 3) == 3  # bounded by r_max: 3 is 0.3 away, 2 is 0.7
    assert extra_rounds(0.0, 1.0, 0.0, 1.0, 12) == 0  # equal replicas: no extra rounds
    info = torch.zeros(2 * 5, dtype=torch.float64)  # rows, inner steps, compute s, interval, lead
    info[:5] = torch.tensor([6.0, 12, 4.0, 1.0, 2.7])  # rank 0: 3 steps/s, arrived 2.7 s before the sync ended
    info[5:] = torch.tensor([10.0, 4, 4.0, 2.5, 0.0])
    plan = agreed_plan(info, 4, True, (3, 15))
    assert plan.steps == (12, 4) and plan.staleness == 3 + extra_rounds(-2.7, 1.0, 0.0, 2.5, 12)
    assert agreed_plan(info, 4, False, (2, 2)).steps == (4, 4) and agreed_plan(info, 4, False, (2, 2)).staleness == 2


def test_delayed_nesterov_is_nesterov_at_n_1_and_the_published_rule_at_n_2() -> None:
    torch.manual_seed(1)
    grads = [torch.randn(5) for _ in range(6)]
    start = torch.randn(5)
    ours, theirs = start.clone(), start.clone().requires_grad_(False)
    delayed = DelayedNesterov([ours], lr=0.7, momentum=0.9, every=1)
    torch_param = nn.Parameter(theirs)
    nesterov = torch.optim.SGD([torch_param], lr=0.7, momentum=0.9, nesterov=True)
    for g in grads:
        ours.grad, torch_param.grad = g.clone(), g.clone()
        delayed.step()
        nesterov.step()
    np.testing.assert_allclose(ours.numpy(), torch_param.detach().numpy(), atol=1e-6)
    theta, m, buf = start.clone(), torch.zeros(5), torch.zeros(5)
    mine = start.clone()
    two = DelayedNesterov([mine], lr=0.7, momentum=0.9, every=2)
    for t, g in enumerate(grads, start=1):
        theta -= 0.7 * g / 2
        buf += g
        if t % 2 == 0:
            m = 0.9 * m + buf / 2
            theta -= 0.7 * 0.9 * m
            buf = torch.zeros(5)
        mine.grad = g.clone()
        two.step()
    np.testing.assert_allclose(mine.numpy(), theta.numpy(), atol=1e-6)


# --- by hand ---------------------------------------------------------------------------------------
def _outer(params: list[torch.Tensor], options: dict[str, Any]) -> Any:
    if options.get("outer_optimizer") == "delayed_nesterov":
        return DelayedNesterov(params, 0.7, 0.9, options.get("outer_momentum_every") or WORLD)
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def _inner_step(model: nn.Module, optimizer: torch.optim.Optimizer, features: torch.Tensor,
                labels: torch.Tensor) -> None:
    optimizer.zero_grad()
    F.cross_entropy(model(features), labels).backward()
    optimizer.step()


def reference(options: dict[str, Any], steps: int, landing: list[list[int]] | None = None) -> dict[str, np.ndarray]:
    """ALGORITHMS.md's DyLU in one process: round = H loader batches, replica w takes H_w inner steps
    (H_w from the injected speeds after the first sync), outer gradient = sum n_w delta_w / sum n_w.
    `landing[w][k]`: the staleness (rounds) with which replica w applied sync k (the recorded schedule)."""
    every = options["sync_every"]
    dynamic = options.get("local_updates") == "dynamic"
    model = mlp()
    replicas = [copy.deepcopy(model) for _ in range(WORLD)]
    inner = [sgd(m.parameters()) for m in replicas]
    globals_ = [[p.detach().clone() for p in model.parameters()] for _ in range(WORLD)]
    outers = [_outer(g, options) for g in globals_]
    anchors = [[p.detach().clone() for p in model.parameters()] for _ in range(WORLD)]
    data = [batches(rank, steps) for rank in range(WORLD)]
    current = [every] * WORLD  # H_w of the round under way
    landed_any = [False] * WORLD
    means: list[list[torch.Tensor]] = []
    own: list[list[list[torch.Tensor]]] = [[] for _ in range(WORLD)]
    landed = [0] * WORLD

    def land(w: int, k: int, fresh: bool) -> None:
        g = globals_[w]
        old = [x.clone() for x in g]
        for x, d in zip(g, means[k]):
            x.grad = d.clone()
        outers[w].step()
        with torch.no_grad():
            for i, p in enumerate(replicas[w].parameters()):
                if fresh:
                    p.copy_(g[i])
                    anchors[w][i].copy_(g[i])
                else:
                    shift = g[i] - old[i] + own[w][k][i]
                    p.add_(shift)
                    anchors[w][i].add_(shift)
        landed_any[w] = True

    def end_round(k: int) -> None:
        deltas = []
        for w in range(WORLD):
            with torch.no_grad():
                delta = [a - p.detach() for a, p in zip(anchors[w], replicas[w].parameters())]
                for a, p in zip(anchors[w], replicas[w].parameters()):
                    a.copy_(p.detach())
            own[w].append(delta)
            deltas.append(delta)
        means.append([sum(ROWS[w] * deltas[w][i] for w in range(WORLD)) / sum(ROWS)
                      for i in range(len(deltas[0]))])

    for t in range(1, steps + 1):
        for w in range(WORLD):
            for _ in range(echoes((t - 1) % every, every, current[w])):
                _inner_step(replicas[w], inner[w], *data[w][t - 1])
        if t % every == 0:
            k = t // every - 1
            end_round(k)
            for w in range(WORLD):
                stale = landing[w] if landing is not None else [0] * len(means)
                while landed[w] < len(means) and stale[landed[w]] <= k - landed[w]:
                    fresh = landed[w] == k
                    land(w, landed[w], fresh)
                    landed[w] += 1
                if dynamic and landed_any[w]:
                    current[w] = dynamic_local_steps(SPEEDS, every)[w]
    for w in range(WORLD):  # finish: what is in flight lands, then the last partial round
        while landed[w] < len(means):
            land(w, landed[w], False)
            landed[w] += 1
    if steps % every:
        end_round(len(means))
        for w in range(WORLD):
            land(w, len(means) - 1, True)
    elif landing is not None:
        for w in range(WORLD):
            with torch.no_grad():
                for p, g in zip(replicas[w].parameters(), globals_[w]):
                    p.copy_(g)
    return {name: p.detach().numpy() for name, p in replicas[0].named_parameters()}


def _train(comm: Any, options: dict[str, Any], steps: int, slow: float) -> dict[str, Any]:
    from sparkdl.strategies.data_parallel import DataParallel

    speed = slow if slow and comm.rank == WORLD - 1 else 1.0
    strategy = DataParallel(comm, None, TrainConfig(**options), compute_speed=speed)
    strategy.setup(mlp(), sgd, F.cross_entropy)
    if not slow:
        strategy._outer_sync.speed_override = SPEEDS[comm.rank]  # noqa: SLF001 - injected measurements
    for features, labels in batches(comm.rank, steps):
        strategy.train_step(features, labels)
    strategy.finish()
    strategy.end_epoch()
    record = strategy.epoch_record()
    return {"state": {k: v.detach().numpy() for k, v in strategy.module().named_parameters()}, "record": record}


def _train_cases(comm: Any, cases: dict[str, tuple[dict[str, Any], int, float]]) -> dict[str, Any]:
    return {name: _train(comm, options, steps, slow) for name, (options, steps, slow) in cases.items()}


DYLU = {"sync": "diloco", "sync_every": 4, "local_updates": "dynamic"}
STALE = {"sync": "diloco", "sync_every": 2, "max_staleness": 2, "outer_optimizer": "delayed_nesterov"}
CASES: dict[str, tuple[dict[str, Any], int, float]] = {
    "dylu nesterov": (DYLU, 14, 0.0),
    "dylu delayed": ({**DYLU, "outer_optimizer": "delayed_nesterov"}, 14, 0.0),
    "dylu delayed n1": ({**DYLU, "outer_optimizer": "delayed_nesterov", "outer_momentum_every": 1}, 12, 0.0),
    "stale": (STALE, 24, 0.2),
    "stale adaptive": ({**STALE, "max_staleness": [1, 3], "local_updates": "dynamic"}, 24, 0.2),
}


@pytest.fixture(scope="module")
def trained() -> list[dict[str, Any]]:
    return run_world(WORLD, _train_cases, CASES, timeout=170)


@pytest.mark.parametrize("case", ["dylu nesterov", "dylu delayed", "dylu delayed n1"])
def test_dynamic_local_updates_follow_the_published_rule(trained: list[dict[str, Any]], case: str) -> None:
    options, steps, _ = CASES[case]
    expected = reference(options, steps)
    for rank, result in enumerate(trained):
        for key, value in expected.items():
            np.testing.assert_allclose(result[case]["state"][key], value, atol=1e-5, err_msg=f"rank {rank} {key}")


def test_the_agreed_local_steps_follow_the_injected_speeds(trained: list[dict[str, Any]]) -> None:
    record = trained[0]["dylu nesterov"]["record"]
    assert record == trained[1]["dylu nesterov"]["record"]  # the same on every rank
    # round 1 plain (no measurement yet), then H_w = [12, 4]: rank 0 echoes each batch 3 times
    assert record["diloco_round_steps_by_rank"] == [[4, 12, 12, 12], [4, 4, 4, 4]]
    assert record["diloco_inner_steps_by_rank"] == [4 + 12 * 2 + 6, 14]
    assert record["diloco_max_staleness"] == 0


@pytest.mark.parametrize("case", ["stale", "stale adaptive"])
def test_staleness_never_exceeds_the_bound_under_a_slow_replica(trained: list[dict[str, Any]], case: str) -> None:
    record = trained[0][case]["record"]
    landed, bounds = record["diloco_landing_staleness_by_rank"], record["diloco_staleness_bound_by_rank"]
    for rank in range(WORLD):
        assert len(landed[rank]) == 12  # every sync landed once
        if case == "stale":  # a fixed s: every landing within it
            assert all(staleness <= 2 for staleness in landed[rank]), landed[rank]
    high = 2 if case == "stale" else 3
    assert max(max(s) for s in landed) <= high and all(1 <= b <= high for r in bounds for b in r)
    assert max(landed[0]) >= 1  # the fast replica ran ahead
    for key, value in trained[0][case]["state"].items():  # every replica ends with the global model
        np.testing.assert_array_equal(trained[1][case]["state"][key], value, err_msg=key)


def test_the_stale_rule_replayed_by_hand_from_the_recorded_schedule(trained: list[dict[str, Any]]) -> None:
    options, steps, _ = CASES["stale"]
    landing = trained[0]["stale"]["record"]["diloco_landing_staleness_by_rank"]
    expected = reference(options, steps, landing)
    for key, value in expected.items():
        np.testing.assert_allclose(trained[0]["stale"]["state"][key], value, atol=1e-5, err_msg=key)


def test_uneven_options_are_checked() -> None:
    def config(**options: Any) -> None:
        RunConfig.from_kwargs(feature_cols=["a"], **options).validate()

    with pytest.raises(ConfigError, match="train.local_updates"):
        config(sync="diloco", local_updates="fast")
    with pytest.raises(ConfigError, match="train.outer_optimizer"):
        config(sync="diloco", outer_optimizer="adam")
    with pytest.raises(ConfigError, match=r"train.max_staleness must be .* got \(4, 2\)"):
        config(sync="diloco", max_staleness=(4, 2))
    with pytest.raises(ConfigError, match="train.max_staleness must be"):
        config(sync="diloco", max_staleness=-1)
    with pytest.raises(ConfigError, match="train.fragments=2 streams it"):
        config(sync="diloco", sync_every=4, fragments=2, local_updates="dynamic")
    with pytest.raises(ConfigError, match="accumulate_steps=2"):
        config(sync="diloco", local_updates="dynamic", accumulate_steps=2)
    with pytest.raises(ConfigError, match="but train.strategy='hybrid'"):
        config(strategy="hybrid", max_staleness=1)
    with pytest.raises(ConfigError, match="train.outer_momentum_every"):
        config(sync="diloco", outer_optimizer="delayed_nesterov", outer_momentum_every=-1)
    config(sync="diloco", local_updates="dynamic", max_staleness=[3, 15], outer_optimizer="delayed_nesterov")
    assert RunConfig().with_overrides(["train.max_staleness=[1, 4]"]).train.max_staleness == (1, 4)


def test_a_staleness_bound_on_horovod_is_refused_before_any_job() -> None:
    from sparkdl.config import RunConfig
    from sparkdl.driver.checks import check_backend
    from sparkdl.errors import ConfigError

    horovod = RunConfig.from_kwargs(feature_cols=["a"], strategy="data_parallel", sync="diloco", max_staleness=2,
                                    backend="horovod")
    with pytest.raises(ConfigError, match="train.max_staleness=2 overlaps whole rounds' syncs.*'horovod'"):
        check_backend(horovod.train, horovod.launch)
    torch_backend = RunConfig.from_kwargs(feature_cols=["a"], strategy="data_parallel", sync="diloco", max_staleness=2)
    check_backend(torch_backend.train, torch_backend.launch)
