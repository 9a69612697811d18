"""IST and DiLoCo through the estimator on local-cluster: they train, send far fewer bytes than data
parallel (counted at the communicator), and the trained model scores like any other."""
from __future__ import annotations

import numpy as np
import pytest
from torch import nn

from sparkdl import TorchEstimator, TorchModel
from sparkdl.datasets import DIGITS_FEATURE_COLS, digits_dataframe, train_test_split_digits
from sparkdl.errors import ModelError


def wide_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 10))


@pytest.fixture(scope="module")
def digits(spark):  # type: ignore[no-untyped-def]
    train_idx, test_idx = train_test_split_digits(seed=0)
    return (digits_dataframe(spark, indices=train_idx).repartition(2).cache(),
            digits_dataframe(spark, indices=test_idx).cache())


def fit(df, **options):  # type: ignore[no-untyped-def]
    settings = dict(model=wide_mlp, feature_cols=DIGITS_FEATURE_COLS, label_col="label", batch_size=32, epochs=8,
                    lr=2e-3, optimizer="adam", seed=0, num_workers=2, tracking=False, progress=False)
    settings.update(options)
    return TorchEstimator(**settings).fit(df)


def accuracy(model: TorchModel, df) -> float:  # type: ignore[no-untyped-def]
    rows = model.transform(df).select("label", "prediction").collect()
    return float(np.mean([r["label"] == r["prediction"] for r in rows]))


def total_bytes(model: TorchModel) -> int:
    return sum(record["bytes_sent_all_ranks"] for record in model.history)


@pytest.fixture(scope="module")
def data_parallel(digits):  # type: ignore[no-untyped-def]
    return fit(digits[0], strategy="data_parallel")


def test_ist_trains_with_a_fraction_of_the_bytes(digits, data_parallel) -> None:  # type: ignore[no-untyped-def]
    train, test = digits
    ist = fit(train, strategy="ist", ist_sync_every=30, validation_fraction=0.1)
    assert accuracy(ist, test) > 0.9  # the full model, written back from the subnets, scores through transform
    assert total_bytes(data_parallel) / total_bytes(ist) >= 20
    assert "val_accuracy" in ist.history[-1]
    assert ist.options["train.strategy"] == "ist"


def test_diloco_trains_with_a_fraction_of_the_bytes(digits, data_parallel) -> None:  # type: ignore[no-untyped-def]
    train, test = digits
    diloco = fit(train, sync="diloco", sync_every=50, optimizer="adamw", sync_dtype="fp16")
    assert accuracy(diloco, test) > 0.85
    # ~23 steps per epoch on each rank: 184 gradient allreduces against 4 fp16 synchronisations.
    assert total_bytes(data_parallel) / total_bytes(diloco) >= 40


def test_ist_rejects_a_model_it_cannot_partition(digits, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import sparkdl.fit_stages

    monkeypatch.setattr(sparkdl.fit_stages, "tracked_submit", lambda *a, **k: pytest.fail("a job was submitted"))
    with pytest.raises(ModelError, match=r"layer 1 \(LayerNorm\) cannot be partitioned by IST"):
        fit(digits[0], strategy="ist",
            model=lambda: nn.Sequential(nn.Linear(64, 32), nn.LayerNorm(32), nn.Linear(32, 10)))


def test_ist_warns_about_narrow_layers(digits, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import sparkdl.fit_stages

    monkeypatch.setattr(sparkdl.fit_stages, "tracked_submit", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("stop")))
    with pytest.warns(UserWarning, match=r"hidden layer 0 \(64 neurons\) are narrower than 256 x 2"):
        with pytest.raises(RuntimeError, match="stop"):
            fit(digits[0], strategy="ist", model=lambda: nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)))
