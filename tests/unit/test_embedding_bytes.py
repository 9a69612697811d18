"""`embedding_bytes_per_step` in the history (strategies/embedding_tables.EpochBytes, issue 52): the
mean over the epoch's training steps and the ranks, not rank 0's last step (a partial batch)."""
from __future__ import annotations

import os
import sys
from typing import Any

import pytest

from sparkdl.strategies.embedding_tables import EpochBytes

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "support"))


class _OneRank:
    def allreduce(self, tensor: Any, op: str = "sum") -> Any:
        return tensor


def test_the_mean_over_the_epochs_steps_not_its_last() -> None:
    counted = EpochBytes()
    for step in range(9):  # eight full steps and a partial last one
        counted.add({"counts": 16, "ids": 1000, "rows": 8000, "gradients": 8000} if step < 8 else
                    {"counts": 16, "ids": 200, "rows": 1600, "gradients": 1600})
    mean = counted.take_mean(_OneRank())
    assert mean == {"counts": 16.0, "ids": pytest.approx(8200 / 9, abs=0.05),
                    "rows": pytest.approx(65600 / 9, abs=0.05), "gradients": pytest.approx(65600 / 9, abs=0.05)}
    assert "touched" not in mean  # sharded tables send no row mask
    counted.add({"gradients": 10, "touched": 2})  # the next epoch starts afresh
    assert counted.take_mean(_OneRank()) == {"gradients": 10.0, "touched": 2.0}
    assert EpochBytes().take_mean(_OneRank()) == {}  # an epoch without training steps on this rank


def _rank_bytes(comm: Any) -> dict[str, float]:
    counted = EpochBytes()
    for _ in range(2 + 2 * comm.rank):  # rank 1 ran more steps of other sizes: each rank's mean counts once
        counted.add({"ids": 100 * (comm.rank + 1), "rows": 0})
    return counted.take_mean(comm)


def test_the_ranks_means_are_averaged_alike_on_every_rank() -> None:
    from gloo_world import run_world

    results = run_world(2, _rank_bytes)
    assert results == [{"ids": 150.0, "rows": 0.0}] * 2
