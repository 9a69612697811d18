"""DataParallel.switch_sync on real gloo ranks (no Spark): data parallel -> DiLoCo -> data parallel with
the weights continuous, the inner optimizer's state kept, and every rank holding the same weights
after the switch back (executor/replan.py decides when; this is how)."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from gloo_world import run_world
from sparkdl.config import TrainConfig


def _batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(90 + rank)  # each rank its own rows: DiLoCo's replicas drift
    return [(torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator))
            for _ in range(steps)]


def _weights(module: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in module.state_dict().items()}


def _rank(comm: Any, diloco: dict[str, Any]) -> dict[str, Any]:
    from sparkdl.model.objectives import LOSSES
    from sparkdl.strategies.data_parallel import DataParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))
    strategy = DataParallel(comm, None, TrainConfig())
    strategy.setup(model, lambda params: torch.optim.AdamW(params, lr=0.01), LOSSES["cross_entropy"])
    batches = iter(_batches(comm.rank, 12))
    for _ in range(3):
        strategy.train_step(*next(batches))
    out: dict[str, Any] = {"dp": _weights(model), "optimizer": strategy._optimizer}
    strategy.switch_sync({"sync": "diloco", **diloco})
    out.update(entered=_weights(model), mode=strategy.sync_mode, same_optimizer=strategy._optimizer is out["optimizer"],
               adam_steps=int(next(iter(strategy._optimizer.state.values()))["step"]))
    for _ in range(5):
        strategy.train_step(*next(batches))
    out["drifted"] = _weights(model)
    out["record"] = strategy.epoch_record()
    out["state_keys"] = sorted(strategy.checkpoint_state())
    strategy.switch_sync({"sync": "allreduce"})
    out.update(left=_weights(model), back=strategy.sync_mode, overlapped=strategy._overlap is not None)
    for _ in range(2):
        strategy.train_step(*next(batches))
    out["end"] = _weights(model)
    del out["optimizer"]
    return out


@pytest.mark.parametrize("diloco", [{"sync_every": 2},
                                    {"sync_every": 4, "fragments": 2, "fragment_sync_delay": 1, "sync_dtype": "int8"}],
                         ids=["plain", "streamed"])
def test_switch_there_and_back_keeps_weights_continuous(diloco: dict[str, Any]) -> None:
    ranks = run_world(2, _rank, diloco, timeout=180)
    for rank in ranks:
        assert rank["mode"] == "diloco" and rank["back"] == "allreduce" and rank["overlapped"]
        assert rank["same_optimizer"] and rank["adam_steps"] == 3  # the inner optimizer goes on from its state
        for key, value in rank["dp"].items():
            np.testing.assert_array_equal(rank["entered"][key], value, err_msg=key)  # entering changes nothing
        assert rank["record"]["outer_syncs"] >= 1 and len(rank["record"]["outer_sync_seconds_by_rank"]) == 2
        assert "replanned_sync" in rank["state_keys"]
    drifted = any(not np.array_equal(ranks[0]["drifted"][k], ranks[1]["drifted"][k]) for k in ranks[0]["drifted"])
    assert drifted  # DiLoCo's replicas trained apart between syncs...
    for key in ranks[0]["left"]:  # ...and leaving DiLoCo puts one model on every rank
        np.testing.assert_array_equal(ranks[0]["left"][key], ranks[1]["left"][key], err_msg=key)
        np.testing.assert_array_equal(ranks[0]["end"][key], ranks[1]["end"][key], err_msg=key)
