"""LossWatch and the optimizer's non-finite skip, without Spark."""
from __future__ import annotations

import math

import pytest
import torch

from sparkdl.config.sections import TrainConfig
from sparkdl.errors import ConfigError, TrainingError
from sparkdl.executor.loss_watch import LossWatch
from sparkdl.strategies.stepping import OptimizerSteps, finite_gradients


def test_the_first_bad_step_and_the_last_finite_loss_are_named() -> None:
    watch = LossWatch("raise", rank=2, host="hostB", device="cpu")
    watch.start_epoch(0)
    for step, value in enumerate([2.5, 1.25], start=1):
        watch.observe(torch.tensor(value), rows=8, global_step=step, epoch=0)
    with pytest.raises(TrainingError) as caught:
        watch.observe(torch.tensor(math.inf), rows=8, global_step=3, epoch=0)
    text = str(caught.value)
    assert "became inf at step 3 (epoch 0) on rank 2 (host hostB)" in text
    assert "last finite loss was 1.25 at step 2" in text


def test_a_nan_on_the_very_first_step_says_so() -> None:
    watch = LossWatch("raise", rank=0, host="h", device="cpu")
    with pytest.raises(TrainingError, match="became nan at step 1 .*no step before it had a finite loss"):
        watch.observe(torch.tensor(math.nan), rows=4, global_step=1, epoch=0)


def test_skip_takes_nothing_of_a_bad_step_and_counts_it() -> None:
    watch = LossWatch("skip", rank=0, host="h", device="cpu")
    watch.start_epoch(0)
    taken = [float(watch.observe(torch.tensor(v), rows=4, global_step=i, epoch=0))
             for i, v in enumerate([1.0, math.nan, 3.0], start=1)]
    assert taken == [1.0, 0.0, 3.0]
    assert watch.end_epoch(0, steps=3) == {"skipped_steps": 1, "skipped_rows": 4}
    watch.start_epoch(3)
    for i in range(2):
        watch.observe(torch.tensor(math.nan), rows=4, global_step=4 + i, epoch=1)
    with pytest.raises(TrainingError, match="every one of epoch 1's 2 steps"):
        watch.end_epoch(1, steps=2)


def test_skip_mode_steps_only_on_finite_gradients() -> None:
    layer = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    steps = OptimizerSteps(TrainConfig(nonfinite_loss="skip"), "cpu")
    before = layer.weight.detach().clone()
    layer(torch.tensor([[math.nan, 1.0, 1.0]])).sum().backward()
    steps.step(optimizer, layer.parameters())
    assert torch.equal(layer.weight, before) and steps.taken == 0
    optimizer.zero_grad()
    layer(torch.ones(1, 3)).sum().backward()
    steps.step(optimizer, layer.parameters())
    assert not torch.equal(layer.weight, before) and steps.taken == 1


def test_finite_gradients_is_elementwise_not_a_norm() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3e38, 3e38])  # its norm overflows float32, yet every value is finite
    assert finite_gradients([p])
    p.grad = torch.tensor([1.0, -math.inf])
    assert not finite_gradients([p])
    assert finite_gradients([p], sum_over_ranks=lambda t: t * 0)  # the ranks' sum decides
    assert not finite_gradients([p], sum_over_ranks=lambda t: t)


def test_the_option_takes_only_its_modes() -> None:
    with pytest.raises(ConfigError, match="nonfinite_loss"):
        TrainConfig(nonfinite_loss="ignore").validate()
