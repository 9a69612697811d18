"""Gradient averaging overlapped with backward (train.overlap_grads): the same gradients and weights
as averaging after backward, on real gloo ranks (no Spark); its waits still counted."""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from gloo_world import run_world
from sparkdl.comm.base import PendingReduce, blocked_seconds
from sparkdl.config import TrainConfig
from sparkdl.errors import ConfigError
from sparkdl.strategies.grad_overlap import plan_buckets
from sparkdl.strategies.stepping import Accumulation

STEPS = 4


class Branchy(nn.Module):
    """A trunk, a branch a step may skip (its gradients then stay None on that rank), a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.branch = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)
        self.use_branch = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.trunk(x)
        if self.use_branch:
            hidden = hidden + torch.tanh(self.branch(hidden))
        return self.head(hidden)


def _data(rank: int, steps: int, rows: int = 6) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(70 + rank)
    return [(torch.randn(rows, 8, generator=generator), torch.randint(0, 3, (rows,), generator=generator),
             torch.rand(rows, generator=generator) + 0.1) for _ in range(steps)]


SCENARIOS: dict[str, dict[str, Any]] = {
    "plain": {},
    "weighted": {"weighted": True},
    "accumulate": {"accumulate": 2},
    "accumulate_weighted": {"accumulate": 2, "weighted": True},
    "unused_branch": {"skip": (1, 1)},  # rank 1 skips the branch at step 1
    "buckets": {"tiny": True, "weighted": True, "skip": (0, 2)},
    "late_rank": {"tiny": True, "late": 0.1},  # rank 1 starts every step 0.1 s late: rank 0 waits for it
}


def _train(comm: Any, overlap: bool, accumulate: int = 1, weighted: bool = False, tiny: bool = False,
           skip: tuple[int, int] | None = None, late: float = 0.0) -> dict[str, Any]:
    from sparkdl.model.objectives import LOSSES
    from sparkdl.strategies.data_parallel import DataParallel

    strategy = DataParallel(comm, None, TrainConfig(overlap_grads=overlap, accumulate_steps=accumulate))
    if tiny:
        strategy.first_bucket_bytes, strategy.bucket_bytes = 64, 600
    model = Branchy()
    strategy.setup(model, lambda params: torch.optim.SGD(params, lr=0.1), LOSSES["cross_entropy"])
    bytes_before, blocked_before = comm.bytes_sent, blocked_seconds()
    early = 0
    for step, (features, labels, weights) in enumerate(_data(comm.rank, STEPS * accumulate)):
        model.use_branch = skip != (comm.rank, step // accumulate)
        micro = Accumulation(step % accumulate, accumulate)
        if late and comm.rank == 1:
            time.sleep(late)
        strategy.train_step(features, labels, weights if weighted else None, micro)
        if strategy._overlap is not None and micro.last:
            early += strategy._overlap.started_in_backward
    overlapped = strategy._overlap
    return {"state": {k: v.numpy().copy() for k, v in strategy.module().state_dict().items()},
            "bytes": comm.bytes_sent - bytes_before, "blocked": blocked_seconds() - blocked_before,
            "comm_wait_s": strategy.epoch_metrics()["comm_wait_s"], "early": early,
            "buckets": len(overlapped.buckets) if overlapped is not None else 0}


def _rank(comm: Any) -> dict[str, Any]:
    return {f"{name}/{overlap}": _train(comm, overlap, **options)
            for name, options in SCENARIOS.items() for overlap in (True, False)}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_world(2, _rank, timeout=240)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_overlap_gives_the_same_weights(results: list[dict[str, Any]], name: str) -> None:
    for rank in results:
        on, off = rank[f"{name}/True"], rank[f"{name}/False"]
        assert on["buckets"] >= 1 and off["buckets"] == 0
        for key, value in off["state"].items():
            if name == "accumulate_weighted":
                # After backward the window's gradients are scaled by W / total before the average;
                # overlapped the total rides with them and divides their sum: rounding apart.
                np.testing.assert_allclose(on["state"][key], value, rtol=1e-6, atol=1e-7, err_msg=key)
            else:
                np.testing.assert_array_equal(on["state"][key], value, err_msg=f"{name}: {key}")
    for key, value in results[0][f"{name}/True"]["state"].items():
        np.testing.assert_array_equal(results[1][f"{name}/True"]["state"][key], value, err_msg=key)


def test_overlap_sends_the_same_bytes_and_its_waits_count(results: list[dict[str, Any]]) -> None:
    for rank in results:
        # The weight total rides along either way; accumulate_weighted's off path sends it in a collective of its own.
        for name in ("plain", "weighted", "accumulate", "unused_branch", "buckets", "late_rank"):
            assert rank[f"{name}/True"]["bytes"] == rank[f"{name}/False"]["bytes"], name
        for name in SCENARIOS:
            on = rank[f"{name}/True"]
            assert on["blocked"] > 0 and on["comm_wait_s"] > 0, name
        buckets = rank["buckets/True"]
        assert buckets["buckets"] >= 4
        assert buckets["early"] >= STEPS, "no bucket went out before backward ended"
    # Rank 0's allreduces cannot finish before rank 1 starts its step: that wait (on work started
    # asynchronously during backward) is the training thread's, in blocked_seconds and comm_wait_s.
    waited = results[0]["late_rank/True"]
    assert waited["blocked"] >= 0.75 * 0.1 * STEPS and waited["comm_wait_s"] >= 0.75 * 0.1 * STEPS, waited


def test_buckets_run_in_reverse_parameter_order_with_a_small_first_one() -> None:
    params = [nn.Parameter(torch.zeros(n)) for n in (100, 10, 10, 50, 5)]  # 400, 40, 40, 200, 20 bytes
    assert plan_buckets(params, 50, 250) == [[4, 3], [2, 1, 0]]
    assert plan_buckets(params, 1 << 20, 1 << 20) == [[4, 3, 2, 1, 0]]
    mixed = params[:2] + [nn.Parameter(torch.zeros(4, dtype=torch.float64))]
    assert plan_buckets(mixed, 1 << 20, 1 << 20) == [[2], [1, 0]]  # one dtype a bucket


def test_waiting_on_pending_work_counts_as_blocked() -> None:
    class Slow:
        def wait(self) -> None:
            time.sleep(0.05)

    tensor = torch.ones(2)
    pending = PendingReduce(tensor, Slow(), lambda t: t.div_(2))
    before = blocked_seconds()
    assert pending.wait() is tensor and tensor.tolist() == [0.5, 0.5]
    assert blocked_seconds() - before >= 0.04
    pending.wait()  # done already: nothing applied twice
    assert tensor.tolist() == [0.5, 0.5]


def test_overlap_grads_must_be_a_bool() -> None:
    with pytest.raises(ConfigError, match="train.overlap_grads"):
        TrainConfig(overlap_grads="yes").validate()  # type: ignore[arg-type]
