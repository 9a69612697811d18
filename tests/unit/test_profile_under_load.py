"""The planner's per-layer profile on a loaded driver (planner/profile.py): layers of the same shape
cost the same, and a pipeline cut does not move when other processes compete for the cores."""
from __future__ import annotations

import multiprocessing
import time

import pytest
import torch
from torch import nn

from sparkdl.planner.partition import balanced_cuts
from sparkdl.planner.profile import profile_sequential

pytestmark = pytest.mark.timeout(180)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


def stack() -> nn.Sequential:
    """A small 'transformer': an embedding, twelve identical blocks, a head."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 96), *[Block(96) for _ in range(12)], nn.Linear(96, 4))


def burn(stop_at: float) -> None:
    x = torch.randn(256, 256)
    while time.time() < stop_at:
        x = torch.tanh(x @ x.T / 256)


def test_identical_blocks_cost_the_same_and_the_cut_holds_under_load() -> None:
    torch.set_num_threads(1)
    model = stack()
    quiet = profile_sequential(model, 16, rows=64)
    context = multiprocessing.get_context("spawn")
    burners = [context.Process(target=burn, args=(time.time() + 60,)) for _ in range(3)]  # 3 on 2 cores
    for process in burners:
        process.start()
    try:
        time.sleep(2)  # the burners are busy before the driver measures
        loaded = [profile_sequential(model, 16, rows=64) for _ in range(3)]
    finally:
        for process in burners:
            process.kill()
            process.join(10)
    for profile in [quiet, *loaded]:
        blocks = {layer.seconds for layer in profile.layers[1:13]}
        assert len(blocks) == 1, sorted(blocks)  # one cost for twelve identical blocks
    for stages in (2, 3, 4):
        expected = balanced_cuts([layer.seconds for layer in quiet.layers], stages)
        for profile in loaded:
            assert balanced_cuts([layer.seconds for layer in profile.layers], stages) == expected, stages
