"""A loss that turns NaN stops the fit within the epoch, naming the step, the rank and the last finite
loss (train.nonfinite_loss="raise", the default); "skip" leaves such steps out and trains on."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from sparkdl import TorchEstimator
from sparkdl.datasets import DIGITS_FEATURE_COLS, digits_dataframe
from sparkdl.errors import TrainingError

BAD_CALL = 6  # the training forward (on rank 1) whose output is poisoned


class PoisonedOnce(nn.Module):
    """A small net whose output is NaN on rank 1's BAD_CALL-th training forward, finite otherwise."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if self.training and rank == 1:
            self.calls += 1
            if self.calls == BAD_CALL:
                out = out * float("nan")
        return out


@pytest.fixture(scope="module")
def digits(spark):  # type: ignore[no-untyped-def]
    return digits_dataframe(spark).limit(512).repartition(2).cache()


def _estimator(**options: object) -> TorchEstimator:
    return TorchEstimator(model=PoisonedOnce, feature_cols=DIGITS_FEATURE_COLS, batch_size=64, num_workers=2,
                          strategy="data_parallel", tracking=False, progress=False, **options)


def test_a_nan_loss_raises_within_its_epoch_naming_step_rank_and_last_finite_loss(digits) -> None:  # type: ignore[no-untyped-def]
    # 256 rows a rank, 64 a rank's step: 4 steps an epoch, so the poisoned step 6 is in the second of three
    with pytest.raises(TrainingError) as caught:
        _estimator(epochs=3).fit(digits)
    text = str(caught.value)
    assert f"at step {BAD_CALL} (epoch 1) on rank 1" in text, text
    assert "the last finite loss was" in text and f"at step {BAD_CALL - 1}" in text, text
    assert "nonfinite_loss='skip'" in text  # the way out is named


def test_skip_leaves_the_bad_step_out_and_trains_on_to_finite_weights(digits) -> None:  # type: ignore[no-untyped-def]
    model = _estimator(epochs=2, nonfinite_loss="skip").fit(digits)
    first, second = model.history  # rank 1's 6th step is the second epoch's second
    assert first["nonfinite_steps_skipped"] == 0 and second["nonfinite_steps_skipped"] == 1
    assert math.isfinite(second["loss"]) and second["loss"] < first["loss"]
    assert first["samples"] == 512 and second["samples"] == 512 - 64  # rank 1's poisoned 64 rows not counted
    assert all(torch.isfinite(t).all() for t in model.torch_module().state_dict().values())
