"""Tensor columns (input_cols): images as shaped arrays and PNG bytes, token sequences, two keyword
inputs with weights, through data parallel, DiLoCo and hybrid, inference and save/load."""
from __future__ import annotations

import copy
import math

import numpy as np
import pyarrow as pa
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparkdl import TorchEstimator, TorchModel
from sparkdl.datasets import (decode_digit_png, digits_images_dataframe, synthetic_tokens_dataframe,
                              train_test_split_digits)

from sparkdl_test_models import TOKEN_LEN as T, TOKEN_VOCAB as V, tiny_gpt as gpt  # noqa: N811
COMMON = dict(num_workers=2, tracking=False, progress=False)


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(512, 10))


class TwoTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.d = nn.Linear(4, 16), nn.Linear(4, 16)
        self.head = nn.Linear(32, 2)

    def forward(self, query: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([torch.relu(self.q(query)), torch.relu(self.d(doc))], dim=1))


class Towers(nn.Module):
    """The first layer of a Sequential that takes the model's two keyword inputs (what a pipeline's
    first stage receives)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.d = nn.Linear(4, 16), nn.Linear(4, 16)

    def forward(self, query: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.relu(self.q(query)), torch.relu(self.d(doc))], dim=1)


def sequential_towers() -> nn.Module:
    return nn.Sequential(Towers(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))


def token_rows(df) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    rows = df.toArrow()
    return tuple(torch.tensor(np.stack(rows.column(c).to_pylist()), dtype=torch.long)  # type: ignore[return-value]
                 for c in ("tokens", "targets"))


def assert_one_sgd_step(trained, start: nn.Module, loss_of, atol: float) -> None:  # type: ignore[no-untyped-def]
    """`trained` holds the weights of one SGD(lr=0.5) step from `start` on the loss `loss_of(model)`."""
    reference = copy.deepcopy(start)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    loss_of(reference).backward()
    optimizer.step()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(trained.torch_module().state_dict()[key], value, atol=atol, rtol=atol)


def accuracy(model, df) -> float:  # type: ignore[no-untyped-def]
    rows = model.transform(df).select("prediction", "label").collect()
    return sum(r["prediction"] == r["label"] for r in rows) / len(rows)


@pytest.fixture(scope="module")
def images(spark):  # type: ignore[no-untyped-def]
    train, test = train_test_split_digits(seed=0)
    return digits_images_dataframe(spark, indices=train).cache(), digits_images_dataframe(spark, indices=test).cache()


def test_a_cnn_on_shaped_arrays_learns_digits_and_reloads_identically(images, tmp_path) -> None:  # type: ignore[no-untyped-def]
    train, test = images
    model = TorchEstimator(model=cnn, input_cols=["pixels"], input_shapes={"pixels": [1, 8, 8]}, label_col="label",
                           epochs=8, batch_size=32, lr=3e-3, seed=0, **COMMON).fit(train)
    assert accuracy(model, test) >= 0.93
    model.write().overwrite().save(str(tmp_path / "cnn"))
    again = TorchModel.load(str(tmp_path / "cnn"))
    first = [r["prediction"] for r in model.transform(test).collect()]
    assert [r["prediction"] for r in again.transform(test).collect()] == first


def test_a_cnn_on_png_bytes_decoded_by_transform_fn(images, tmp_path) -> None:  # type: ignore[no-untyped-def]
    train, test = images
    model = TorchEstimator(model=cnn, input_cols=["png"], transform_fn=decode_digit_png, label_col="label",
                           epochs=8, batch_size=32, lr=3e-3, seed=0, validation_fraction=0.1, **COMMON).fit(train)
    assert accuracy(model, test) >= 0.9
    assert all(h["transform_seconds"] > 0 for h in model.history)
    model.write().overwrite().save(str(tmp_path / "png"))
    again = TorchModel.load(str(tmp_path / "png"))  # transform_fn comes back with it
    assert [r["prediction"] for r in again.transform(test).collect()] == \
        [r["prediction"] for r in model.transform(test).collect()]


@pytest.fixture(scope="module")
def tokens(spark):  # type: ignore[no-untyped-def]
    train = synthetic_tokens_dataframe(spark, rows=1536, seq_len=T, vocab=V, seed=0).repartition(2).cache()
    test = synthetic_tokens_dataframe(spark, rows=256, seq_len=T, vocab=V, seed=1).cache()
    return train, test


def _lm(strategy: str, **options):  # type: ignore[no-untyped-def]
    return TorchEstimator(model=gpt, input_cols=["tokens"], label_col="targets", strategy=strategy, epochs=5,
                          batch_size=32, lr=3e-3, optimizer="adamw", seed=0, validation_df=None, **COMMON, **options)


def test_a_causal_lm_learns_and_diloco_sends_far_less(tokens) -> None:  # type: ignore[no-untyped-def]
    train, test = tokens
    exact = _lm("data_parallel", validation_fraction=0.2).fit(train)
    diloco = _lm("data_parallel", sync="diloco", sync_every=10, sync_dtype="fp16", outer_lr=1.0, outer_momentum=0.5, validation_fraction=0.2).fit(train)
    assert exact.history[-1]["val_loss"] < 0.5 * math.log(V)
    sent = [sum(h["bytes_sent_all_ranks"] for h in m.history) for m in (exact, diloco)]
    assert sent[0] >= 10 * sent[1]
    print("val_loss exact %.3f diloco %.3f" % (exact.history[-1]["val_loss"], diloco.history[-1]["val_loss"]), sent)
    assert diloco.history[-1]["val_loss"] <= 1.15 * exact.history[-1]["val_loss"]
    row = exact.transform(test.limit(4)).collect()[0]
    assert isinstance(row["prediction"], list) and len(row["prediction"]) == T
    assert all(0 <= p < V for p in row["prediction"])


def test_hybrid_one_step_on_tokens_equals_the_full_batch_step(spark, tokens) -> None:  # type: ignore[no-untyped-def]
    train, _ = tokens
    one = train.limit(64).repartition(2).cache()
    options = dict(epochs=1, batch_size=32, optimizer="sgd", lr=0.5, shuffle=False, seed=0)
    torch.manual_seed(0)
    start = gpt()
    hybrid = TorchEstimator(model=start, input_cols=["tokens"], label_col="targets", strategy="hybrid", stages=2,
                            microbatches=4, **COMMON, **options).fit(one)
    x, y = token_rows(one)
    assert_one_sgd_step(hybrid, start, lambda m: F.cross_entropy(m(x).reshape(-1, V), y.reshape(-1)), atol=1e-4)


@pytest.fixture(scope="module")
def towers(spark):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(0)
    n = 1200
    q, d = rng.normal(size=(n, 4)).astype(np.float32), rng.normal(size=(n, 4)).astype(np.float32)
    y = ((q[:, 0] + d[:, 1]) > 0).astype(np.int64)
    w = np.ones(n, np.float32)
    noisy = rng.random(n) < 0.4  # rows with the wrong label and weight 0: must not hurt
    y_train = np.where(noisy, 1 - y, y)
    w[noisy] = 0.0
    table = pa.table({"q_vec": pa.array(list(q), pa.list_(pa.float32())), "d_vec": pa.array(list(d), pa.list_(pa.float32())),
                      "y": pa.array(y_train), "w": pa.array(w), "label": pa.array(y)})
    return spark.createDataFrame(table).repartition(2).cache()


def test_two_keyword_inputs_with_weights_ignore_zero_weight_rows(towers) -> None:  # type: ignore[no-untyped-def]
    model = TorchEstimator(model=TwoTower, input_cols={"query": "q_vec", "doc": "d_vec"}, label_col="y",
                           weight_col="w", epochs=15, batch_size=32, lr=1e-2, seed=0, **COMMON).fit(towers)
    assert accuracy(model, towers) >= 0.9
    unweighted = TorchEstimator(model=TwoTower, input_cols={"query": "q_vec", "doc": "d_vec"}, label_col="y",
                                epochs=15, batch_size=32, lr=1e-2, seed=0, **COMMON).fit(towers)
    assert accuracy(unweighted, towers) < accuracy(model, towers)


def test_weighted_data_parallel_equals_one_weighted_full_batch_step(spark, towers) -> None:  # type: ignore[no-untyped-def]
    one = towers.limit(64).repartition(2).cache()
    torch.manual_seed(0)
    start = TwoTower()
    trained = TorchEstimator(model=start, input_cols={"query": "q_vec", "doc": "d_vec"}, label_col="y", weight_col="w",
                             strategy="data_parallel", epochs=1, batch_size=32, optimizer="sgd", lr=0.5, shuffle=False,
                             seed=0, **COMMON).fit(one)
    rows = one.toArrow()
    q = torch.tensor(np.stack(rows.column("q_vec").to_pylist()), dtype=torch.float32)
    d = torch.tensor(np.stack(rows.column("d_vec").to_pylist()), dtype=torch.float32)
    y, w = torch.tensor(rows.column("y").to_numpy()), torch.tensor(rows.column("w").to_numpy())
    assert_one_sgd_step(trained, start, lambda m: (F.cross_entropy(m(q, d), y, reduction="none") * w).sum() / w.sum(),
                        atol=1e-5)


def test_hybrid_takes_two_keyword_inputs_with_weights_and_equals_the_full_batch_step(spark, towers) -> None:  # type: ignore[no-untyped-def]
    one = towers.limit(64).repartition(2).cache()
    torch.manual_seed(0)
    start = sequential_towers()
    trained = TorchEstimator(model=start, input_cols={"query": "q_vec", "doc": "d_vec"}, label_col="y", weight_col="w",
                             strategy="hybrid", stages=2, microbatches=4, epochs=1, batch_size=32, optimizer="sgd",
                             lr=0.5, shuffle=False, seed=0, **COMMON).fit(one)
    rows = one.toArrow()
    q = torch.tensor(np.stack(rows.column("q_vec").to_pylist()), dtype=torch.float32)
    d = torch.tensor(np.stack(rows.column("d_vec").to_pylist()), dtype=torch.float32)
    y, w = torch.tensor(rows.column("y").to_numpy()), torch.tensor(rows.column("w").to_numpy())

    def weighted(model: nn.Module) -> torch.Tensor:
        logits = model[1:](model[0](query=q, doc=d))
        return (F.cross_entropy(logits, y, reduction="none") * w).sum() / w.sum()

    assert_one_sgd_step(trained, start, weighted, atol=1e-5)
    assert trained.history[-1]["max_activation_bytes_per_rank"] > 0  # it ran as a pipeline
    predicted = [r["prediction"] for r in trained.transform(one).select("prediction").collect()]
    assert len(predicted) == 64 and set(predicted) <= {0, 1}


def test_hybrid_on_two_inputs_learns_and_validates(towers) -> None:  # type: ignore[no-untyped-def]
    model = TorchEstimator(model=sequential_towers, input_cols={"query": "q_vec", "doc": "d_vec"}, label_col="y",
                           weight_col="w", strategy="hybrid", stages=2, epochs=12, batch_size=32, lr=1e-2, seed=0,
                           validation_fraction=0.2, metrics=["accuracy"], **COMMON).fit(towers)
    assert accuracy(model, towers) >= 0.9
    assert model.history[-1]["val_accuracy"] >= 0.55  # validation rows keep their (noisy) training labels
    assert math.isfinite(model.history[-1]["val_loss"])


def test_custom_loop_batches_carry_the_input_structure(spark, towers) -> None:  # type: ignore[no-untyped-def]
    import sparkdl

    def train_fn(ctx):  # type: ignore[no-untyped-def]
        inputs, label, weight = next(iter(ctx.batches(0)))
        return sorted(inputs), tuple(inputs["query"].shape), str(label.dtype), tuple(weight.shape)

    keys, shape, dtype, weights = sparkdl.run(train_fn, df=towers, input_cols={"query": "q_vec", "doc": "d_vec"},
                                              label_col="y", weight_col="w", batch_size=8, progress=False)
    assert keys == ["doc", "query"] and shape == (8, 4) and dtype == "torch.int64" and weights == (8,)


def test_feature_cols_take_weights_too_and_stay_exact(spark) -> None:  # type: ignore[no-untyped-def]
    from pyspark.sql import functions as F

    from sparkdl.datasets import DIGITS_FEATURE_COLS, digits_dataframe

    one = digits_dataframe(spark).limit(64).withColumn("w", (F.col("label") % 3).cast("double")).repartition(2).cache()
    torch.manual_seed(0)
    start = nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))
    trained = TorchEstimator(model=start, feature_cols=DIGITS_FEATURE_COLS, label_col="label", weight_col="w",
                             strategy="data_parallel", epochs=1, batch_size=32, optimizer="sgd", lr=0.5, shuffle=False,
                             seed=0, **COMMON).fit(one)
    rows = one.toPandas()
    x = torch.tensor(rows[list(DIGITS_FEATURE_COLS)].to_numpy(), dtype=torch.float32)
    y, w = torch.tensor(rows["label"].to_numpy()), torch.tensor(rows["w"].to_numpy(), dtype=torch.float32)
    assert_one_sgd_step(trained, start, lambda m: (torch.nn.functional.cross_entropy(m(x), y, reduction="none") * w).sum()
                        / w.sum(), atol=1e-5)


def test_weighted_hybrid_on_two_replicas_equals_the_weighted_full_batch_step(spark) -> None:  # type: ignore[no-untyped-def]
    """2 stages x 2 replicas: the last stages sum the weights of both replicas before weighing."""
    from pyspark.sql import functions as sf

    rows_df = synthetic_tokens_dataframe(spark, rows=64, seq_len=T, vocab=V, seed=4) \
        .withColumn("w", (sf.element_at("tokens", 1) % 4).cast("double")).repartition(4).cache()
    torch.manual_seed(0)
    start = gpt()
    hybrid = TorchEstimator(model=start, input_cols=["tokens"], label_col="targets", weight_col="w", strategy="hybrid",
                            stages=2, microbatches=2, epochs=1, batch_size=16, optimizer="sgd", lr=0.5, shuffle=False,
                            seed=0, num_workers=4, tracking=False, progress=False).fit(rows_df)
    x, y = token_rows(rows_df)
    w = torch.tensor(rows_df.toArrow().column("w").to_numpy(), dtype=torch.float32)

    def weighted(model: nn.Module) -> torch.Tensor:
        per_token = F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1), reduction="none").view(len(w), T)
        return (per_token * w[:, None]).sum() / (w.sum() * T)

    assert_one_sgd_step(hybrid, start, weighted, atol=1e-4)


def test_ignored_positions_give_the_global_token_mean_and_validation_df_is_cast_alike(spark) -> None:  # type: ignore[no-untyped-def]
    """-100 labels: the loss is the mean over the positions that count in the whole batch (not a
    mean of per-rank means); a validation_df with array<bigint> tokens is cast to the training types."""
    from pyspark.sql import functions as sf

    base = synthetic_tokens_dataframe(spark, rows=64, seq_len=T, vocab=V, seed=5)
    # Rows with an even first token ignore their first half of positions: ranks count unequal positions.
    masked = base.withColumn("targets", sf.when(sf.element_at("tokens", 1) % 2 == 0, sf.concat(
        sf.array_repeat(sf.lit(-100), T // 2), sf.slice("targets", T // 2 + 1, T))).otherwise(sf.col("targets")))
    one = masked.repartition(2).cache()
    validation = synthetic_tokens_dataframe(spark, rows=32, seq_len=T, vocab=V, seed=6) \
        .withColumn("tokens", sf.col("tokens").cast("array<bigint>"))
    torch.manual_seed(0)
    start = gpt()
    trained = TorchEstimator(model=start, input_cols=["tokens"], label_col="targets", strategy="data_parallel",
                             epochs=1, batch_size=32, optimizer="sgd", lr=0.5, shuffle=False, seed=0,
                             validation_df=validation, **COMMON).fit(one)
    assert "val_loss" in trained.history[0] and trained.history[0]["val_accuracy"] >= 0.0
    x, y = token_rows(one)
    assert_one_sgd_step(trained, start, lambda m: F.cross_entropy(m(x).reshape(-1, V), y.reshape(-1), ignore_index=-100),
                        atol=1e-5)


def test_a_custom_loop_gets_int64_per_position_labels(spark, tokens) -> None:  # type: ignore[no-untyped-def]
    import sparkdl

    train, _ = tokens

    def train_fn(ctx):  # type: ignore[no-untyped-def]
        (x,), y, _ = next(iter(ctx.batches(0)))
        return str(x.dtype), str(y.dtype), tuple(y.shape)

    assert sparkdl.run(train_fn, df=train, input_cols=["tokens"], label_col="targets", batch_size=8,
                       progress=False) == ("torch.int64", "torch.int64", (8, T))
