"""An importable model factory for the `model.factory` tests (installed on the test path)."""
from torch import nn


def small_digits_net() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))
