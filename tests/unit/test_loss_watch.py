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


def _skipping_stages(comm):  # type: ignore[no-untyped-def]
    """Two pipeline stages; on the second step only the last stage's own gradients turn infinite
    (its weights' hook), the first stage's stay finite: both must skip that step together."""
    import torch.nn.functional as F
    from torch import nn

    from sparkdl.model.layouts import HybridLayout, default_grid
    from sparkdl.strategies.hybrid import Hybrid

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    strategy = Hybrid(comm, HybridLayout(
        stages=2, replicas=1, cuts=(0, 2, 3), boundary_shapes=((16,),), boundary_dtypes=("float32",), input_shape=(8,),
        label_dtype="int64", microbatches=2, schedule="1f1b", grid=default_grid(2, 1)),
        TrainConfig(nonfinite_loss="skip"))
    strategy.setup(model, lambda p: torch.optim.SGD(p, lr=0.1), F.cross_entropy)
    poison = {"on": False}
    if comm.rank == 1:
        for param in strategy._params:  # the last stage's own layer (the stage keeps its own copy)
            param.register_hook(lambda g: g * math.inf if poison["on"] else g)
    generator = torch.Generator().manual_seed(7)
    taken = []
    for step in range(3):
        poison["on"] = step == 1
        x, y = torch.randn(6, 8, generator=generator), torch.randint(0, 3, (6,), generator=generator)
        strategy.train_step(x, y)
        taken.append(strategy.steps.taken)
    return taken


def test_pipeline_stages_skip_a_non_finite_step_together() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
    from gloo_world import run_world

    first, last = run_world(2, _skipping_stages, timeout=90)
    assert first == last == [1, 1, 2]  # the first stage's finite gradients did not step alone
