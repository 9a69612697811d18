"""Hybrid pipeline x data through the estimator on local-cluster: same weights as data parallel,
a model over the per-rank memory budget trains, bad configurations fail before any job."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from torch import nn

from sparkdl import TorchEstimator, TorchModel
from sparkdl.errors import ConfigError, ResourceError

FEATURES = [f"f{i}" for i in range(6)]


def rows(spark, count: int, partitions: int):  # type: ignore[no-untyped-def]
    """`count` deterministic rows in exactly `partitions` partitions, so both strategies see the same
    rows on the same ranks."""
    from pyspark.sql import functions as F

    df = spark.range(0, count, 1, partitions)
    cols = [F.sin(F.col("id") * (i + 1) * 0.37).cast("double").alias(f"f{i}") for i in range(6)]
    return df.select(*cols, (F.col("id") % 3).cast("int").alias("label"))


@pytest.fixture(scope="module")
def rows_df(spark):  # type: ignore[no-untyped-def]
    return rows(spark, 96, 4).cache()


def deep_net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 3))


def fit(df, **options):  # type: ignore[no-untyped-def]
    # SGD: Adam's normalised step turns float-rounding noise in near-zero gradients (the order in
    # which micro-batch gradients add up differs between schedules) into full-size updates.
    settings = dict(model=deep_net, feature_cols=FEATURES, label_col="label", batch_size=8, epochs=1, lr=0.1,
                    optimizer="sgd", momentum=0.9, seed=3, tracking=False, progress=False)
    settings.update(options)
    return TorchEstimator(**settings).fit(df)


@pytest.mark.parametrize("workers,stages", [(2, 2), (4, 2)])
def test_hybrid_gives_the_weights_of_data_parallel(spark, workers: int, stages: int, capsys) -> None:  # type: ignore[no-untyped-def]
    df = rows(spark, workers * 3 * 8, workers)  # 3 steps of 8 rows on every rank
    reference = fit(df, num_workers=workers, strategy="data_parallel")
    if workers == 4:
        # With this cluster calibrated, the grid is placed on the measured links between the
        # executors this job's ranks land on (at run time); the update must not depend on it.
        from sparkdl.driver.planning import calibrate

        calibrate(spark, workers)
    hybrid = fit(df, num_workers=workers, strategy="hybrid", stages=stages, microbatches=4)
    grid = hybrid.history[0]["hybrid_grid"]
    assert grid[0][-1] == 0 and sorted(r for ranks in grid for r in ranks) == list(range(workers))
    assert len(grid) == workers // stages and all(len(ranks) == stages for ranks in grid)
    captured = capsys.readouterr()
    if workers == 4:  # (two workers may also be placed, when an earlier test calibrated them)
        assert "hybrid grid placed on measured links" in captured.out + captured.err
    expected = reference.torch_module().state_dict()
    got = hybrid.torch_module().state_dict()
    assert sorted(got) == sorted(expected)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], atol=1e-4, rtol=0, msg=key)
    assert hybrid.history[0]["steps"] == reference.history[0]["steps"] == 3
    assert hybrid.history[0]["loss"] == pytest.approx(reference.history[0]["loss"], rel=1e-4)
    assert_transform_uses_the_module(hybrid, df)


def assert_transform_uses_the_module(model: TorchModel, df) -> None:  # type: ignore[no-untyped-def]
    """The reassembled model is an ordinary TorchModel: transform scores with the trained module."""
    scored = model.transform(df).orderBy("f0").collect()
    features = torch.tensor([[r[c] for c in FEATURES] for r in scored], dtype=torch.float32)
    with torch.no_grad():
        expected = model.torch_module()(features).argmax(dim=1).tolist()
    assert [r["prediction"] for r in scored] == expected


def big_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256),
                         nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 3))


def test_model_over_the_memory_budget_trains_with_hybrid(rows_df, tmp_path) -> None:  # type: ignore[no-untyped-def]
    total = sum(p.numel() * p.element_size() for p in big_net().parameters())  # ~1.06 MB of fp32 weights
    budget = "3MB"  # Adam needs ~16 bytes per parameter: ~4.2 MB for the whole model, ~2.1 MB per stage
    started = time.monotonic()
    with pytest.raises(ResourceError, match="max_memory_per_rank='3MB'") as info:
        fit(rows_df, model=big_net, num_workers=2, max_memory_per_rank=budget, optimizer="adam", lr=1e-3,
            strategy="data_parallel")
    assert time.monotonic() - started < 30 and "strategy='hybrid'" in str(info.value)

    model = fit(rows_df, model=big_net, num_workers=2, strategy="hybrid", max_memory_per_rank=budget, epochs=2,
                validation_fraction=0.25, optimizer="adam", lr=1e-3)
    per_rank = model.history[-1]["max_param_bytes_per_rank"]
    assert per_rank < 0.6 * total  # about 1/K of the model on each rank (K=2 chosen automatically)
    assert model.history[-1]["max_activation_bytes_per_rank"] > 0
    assert "val_accuracy" in model.history[-1]
    assert sum(p.numel() * p.element_size() for p in model.torch_module().parameters()) == total

    path = str(tmp_path / "hybrid-model")
    model.save(path)
    loaded = TorchModel.load(path)
    assert loaded.history == model.history
    assert_transform_uses_the_module(loaded, rows_df)


def test_gpipe_and_1f1b_train_the_same_model(spark) -> None:  # type: ignore[no-untyped-def]
    df = rows(spark, 96, 2)  # as many partitions as workers: no repartition, the same row order in both fits
    a = fit(df, num_workers=2, strategy="hybrid", schedule="gpipe", microbatches=8)
    b = fit(df, num_workers=2, strategy="hybrid", schedule="1f1b", microbatches=8)
    for key, value in a.torch_module().state_dict().items():
        torch.testing.assert_close(b.torch_module().state_dict()[key], value, atol=1e-5, rtol=0)
    # 1F1B holds fewer micro-batches of activations than GPipe (here 2 against 8 on the first stage).
    assert b.history[0]["max_activation_bytes_per_rank"] < a.history[0]["max_activation_bytes_per_rank"]


def test_a_list_of_stage_modules_is_a_model(rows_df) -> None:  # type: ignore[no-untyped-def]
    stages = [nn.Sequential(nn.Linear(6, 16), nn.ReLU()), nn.Sequential(nn.Linear(16, 3))]
    model = fit(rows_df, model=stages, num_workers=2, strategy="hybrid", stages=2)
    assert isinstance(model.torch_module(), nn.Sequential) and len(model.torch_module()) == 2
    assert np.isfinite(model.history[0]["loss"])


@pytest.mark.parametrize("options,error,match", [
    ({"stages": 3, "num_workers": 4}, ConfigError, "train.stages=3 does not divide launch.num_workers=4"),
    ({"stages": 2, "num_workers": 2, "microbatches": 64}, ConfigError, "train.microbatches=64 is larger"),
    ({"stages": 2, "num_workers": 2, "backend": "horovod"}, ConfigError, "does not provide"),
])
def test_bad_hybrid_configurations_fail_before_any_job(rows_df, monkeypatch, options, error, match) -> None:  # type: ignore[no-untyped-def]
    import sparkdl.fit_stages

    def no_job(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("a training job was submitted for a configuration that cannot run")

    monkeypatch.setattr(sparkdl.fit_stages, "tracked_submit", no_job)
    with pytest.raises(error, match=match):
        fit(rows_df, strategy="hybrid", **options)
