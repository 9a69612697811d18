"""Models larger than one worker, end to end on local-cluster: a model given as one factory per
layer is built only where each layer trains, sharded data parallel and hybrid equal data parallel
on the same rows, and the ranks' own peak RSS shows what each keeps."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparkdl import TorchEstimator
from sparkdl.model.layer_factories import LayerFactories

FEATURES = [f"f{i}" for i in range(6)]
SMALL = [lambda: nn.Linear(6, 32), nn.Tanh, lambda: nn.Linear(32, 32), nn.Tanh, lambda: nn.Linear(32, 3)]


def wide() -> nn.Module:
    return nn.Linear(1024, 1024)


def wide_on_meta() -> nn.Module:
    with torch.device("meta"):
        return nn.Linear(1024, 1024)


@pytest.fixture(scope="module")
def rows(spark):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(2)
    x = rng.normal(size=(64, 6))
    y = (x[:, 0] > 0).astype(int) + (x[:, 1] > 0.5).astype(int)
    data = [(*map(float, r), int(t)) for r, t in zip(x, y)]
    return spark.sparkContext.parallelize(data, 2).toDF(FEATURES + ["label"]).cache()


def fit(df, model, **options):  # type: ignore[no-untyped-def]
    settings = dict(model=model, feature_cols=FEATURES, label_col="label", epochs=1, batch_size=32, num_workers=2,
                    optimizer="sgd", lr=0.5, shuffle=False, seed=3, tracking=False, progress=False)
    settings.update(options)
    return TorchEstimator(**settings).fit(df)


def test_sharded_and_hybrid_equal_data_parallel_on_one_step(rows) -> None:  # type: ignore[no-untyped-def]
    table = rows.toArrow()
    x = torch.tensor(np.stack([table.column(c).to_numpy() for c in FEATURES], axis=1), dtype=torch.float32)
    y = torch.tensor(table.column("label").to_numpy())
    reference = LayerFactories.of(SMALL).build(seed=3)  # the weights every rank builds from the factories
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    F.cross_entropy(reference(x), y).backward()
    optimizer.step()
    for strategy, extra in [("data_parallel", {}), ("sharded", {}), ("hybrid", {"stages": 2, "microbatches": 2})]:
        trained = fit(rows, SMALL, strategy=strategy, **extra)
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(trained.torch_module().state_dict()[key], value, atol=1e-5, rtol=1e-5,
                                       msg=f"{strategy}: {key}")
        assert trained.history[0]["peak_rss_bytes_by_rank"] and trained.history[0]["max_peak_rss_bytes_per_rank"] > 0


def test_each_rank_keeps_a_quarter_of_the_training_state(spark) -> None:  # type: ignore[no-untyped-def]
    """Linear(16, 1024), 20 x Linear(1024, 1024), Linear(1024, 4): 21.0M parameters, whose fp32
    parameters, gradients and Adam moments (what data parallel keeps on every rank) are 336 MB,
    on 4 ranks: what each rank's RSS grew by from just before its model was built (the data path and
gloo's threads, tens of MB whatever the model, came before), measured by the rank."""
    rng = np.random.default_rng(0)
    columns = [f"x{i}" for i in range(16)]
    df = spark.createDataFrame([tuple(map(float, r)) + (int(i % 4),) for i, r in enumerate(rng.normal(size=(64, 16)))],
                               columns + ["label"]).repartition(4).cache()
    layers = [lambda: nn.Linear(16, 1024)] + [wide] * 10 + [wide_on_meta] * 10 + [lambda: nn.Linear(1024, 4)]
    params = 16 * 1024 + 1024 + 20 * (1024 * 1024 + 1024) + 1024 * 4 + 4
    state = 16 * params
    for strategy, extra in [("sharded", {}), ("hybrid", {"stages": 4, "microbatches": 2})]:
        model = TorchEstimator(model=layers, feature_cols=columns, label_col="label", epochs=1, batch_size=8,
                               num_workers=4, optimizer="adam", lr=1e-3, strategy=strategy, tracking=False,
                               progress=False, **extra).fit(df)
        record = model.history[-1]
        grown = [p - s for p, s in zip(record["peak_rss_bytes_by_rank"], record["model_start_rss_bytes_by_rank"])]
        print(strategy, [g >> 20 for g in grown], state >> 20)
        assert len(grown) == 4 and max(grown) < 0.6 * state, (strategy, grown, state)
        assert sum(p.numel() for p in model.torch_module().parameters()) == params
        # sharded: a quarter of the weights each; hybrid: stages cut by measured time, never the whole model
        assert record["max_param_bytes_per_rank"] < (0.3 if strategy == "sharded" else 0.6) * 4 * params
