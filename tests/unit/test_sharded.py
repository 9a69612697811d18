"""Sharded data parallel (ZeRO-3 through the Communicator) on real gloo ranks against data parallel:
the same weights after several steps (SGD and Adam, dropout, accumulation, weights, clipping), 1/W
of the state per rank, checkpoints that resume exactly, and the pieces the driver merges."""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gloo_world import run_world
from sparkdl.config import TrainConfig
from sparkdl.data.epochs import Accumulation


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.d = nn.Linear(6, 8), nn.Linear(2, 8)

    def forward(self, query: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.q(query)) + torch.relu(self.d(doc))


def model(two_inputs: bool = False) -> nn.Module:
    torch.manual_seed(0)
    first: nn.Module = Pair() if two_inputs else nn.Linear(6, 8)
    return nn.Sequential(first, nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(inplace=True),
                         nn.Linear(16, 3))


def _batches(rank: int, steps: int, rows: int = 8) -> list[tuple[Any, torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(rows, 6, generator=generator), torch.randint(0, 3, (rows,), generator=generator),
             torch.rand(rows, generator=generator)) for _ in range(steps)]


def _train(comm: Any, name: str, options: dict[str, Any], two_inputs: bool, weighted: bool, steps: int,
           resume_at: int = -1) -> dict[str, Any]:
    from sparkdl.model.objectives import build_optimizer
    from sparkdl.strategies import strategy_class

    train = TrainConfig(**options)
    accumulate = train.accumulate_steps

    def build() -> Any:
        torch.manual_seed(7)  # the same dropout masks on both strategies
        strategy = strategy_class(name)(comm, None, train)
        strategy.setup(model(two_inputs), lambda params: build_optimizer(train, params),
                       lambda out, y, weight=None: F.cross_entropy(out, y) if weight is None else
                       (F.cross_entropy(out, y, reduction="none") * weight).sum() / weight.sum())
        return strategy

    strategy, saved = build(), None
    for step, (x, y, w) in enumerate(_batches(comm.rank, steps)):
        if step == resume_at:  # a fresh rank from the checkpoint (the dropout generator continues)
            saved, rng = copy.deepcopy(strategy.checkpoint_state()), torch.get_rng_state()
            strategy = build()
            strategy.load_checkpoint_state(saved)
            torch.set_rng_state(rng)
        inputs = {"query": x, "doc": x[:, :2]} if two_inputs else x
        strategy.train_step(inputs, y, w if weighted else None, Accumulation(step % accumulate, accumulate))
    # validation: rank 0 holds two batches, rank 1 none (every layer's gather is a collective)
    held_out = [(b[0], b[1]) for b in _batches(50 + comm.rank, 2 if comm.rank == 0 else 0)]
    if two_inputs:
        held_out = [({"query": x, "doc": x[:, :2]}, y) for x, y in held_out]
    sums = strategy.evaluate(iter(held_out), F.cross_entropy, True)
    state = strategy.result_state() or {}
    return {"state": {k: v.tolist() for k, v in state.items()}, "validation": sums.tolist(),
            "param_bytes": strategy.epoch_metrics()["param_bytes"], "bytes": comm.bytes_sent}


def _merged(results: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for result in results:
        merged.update({k: torch.tensor(v) for k, v in result["state"].items()})
    return merged


CASES = [
    ({"optimizer": "sgd", "lr": 0.5}, False, False),
    ({"optimizer": "adam", "lr": 0.01, "grad_clip": 0.05}, True, True),
    ({"optimizer": "sgd", "lr": 0.3, "momentum": 0.9, "accumulate_steps": 2}, False, True),
]


def _every_case(comm: Any) -> dict[str, Any]:
    """All cases on one pair of spawned ranks (each spawn costs seconds of imports): both
    strategies, and a sharded run resumed from its checkpoint at step 3."""
    out: dict[str, Any] = {}
    for index, (options, two_inputs, weighted) in enumerate(CASES):
        for name in ("sharded", "data_parallel"):
            out[f"{name}.{index}"] = _train(comm, name, options, two_inputs, weighted, 4)
    adam = {"optimizer": "adam", "lr": 0.01}
    out["straight"] = _train(comm, "sharded", adam, False, False, 5)
    out["resumed"] = _train(comm, "sharded", adam, False, False, 5, 3)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_world(2, _every_case, timeout=300)


@pytest.mark.parametrize("index", range(len(CASES)), ids=["sgd", "adam_clip_two_inputs_weights", "accumulate"])
def test_sharded_steps_equal_data_parallel(ranks: list[dict[str, Any]], index: int) -> None:
    sharded = [r[f"sharded.{index}"] for r in ranks]
    data_parallel = [r[f"data_parallel.{index}"] for r in ranks]
    reference = data_parallel[0]["state"]
    merged = _merged(sharded)
    assert sorted(merged) == sorted(reference)  # the driver's merge gives the whole model's state dict
    assert set(sharded[0]["state"]).isdisjoint(k for k in sharded[1]["state"] if "running" not in k)
    for key, value in reference.items():
        torch.testing.assert_close(merged[key], torch.tensor(value), atol=1e-5, rtol=1e-5)
    whole = sum(p.numel() * 4 for p in model(CASES[index][1]).parameters())
    assert all(r["param_bytes"] <= whole / 2 + 4 * 7 for r in sharded)  # 1/W of it (padding: < 1 per layer)
    assert data_parallel[0]["param_bytes"] == whole
    for mine, theirs in zip(sharded, data_parallel):  # the same validation sums, rank by rank
        assert mine["validation"] == pytest.approx(theirs["validation"], rel=1e-5, abs=1e-6)
    assert sharded[1]["validation"] == [0.0, 0.0, 0.0, 0.0] and sharded[0]["validation"][2] == 16


def test_a_sharded_checkpoint_resumes_exactly(ranks: list[dict[str, Any]]) -> None:
    straight = _merged([r["straight"] for r in ranks])
    resumed = _merged([r["resumed"] for r in ranks])
    for key, value in straight.items():
        torch.testing.assert_close(resumed[key], value, atol=0, rtol=0)

