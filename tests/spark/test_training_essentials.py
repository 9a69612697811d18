"""Training essentials end to end on local-cluster: lr schedules (logged lr points follow the curve),
validation metrics against driver references, live callbacks that stop a fit, early stopping that
restores the best epoch on every stage of a pipeline, gradient accumulation equal to a larger batch
(the same bytes per optimizer step), and bf16 training as accurate as fp32."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import mean_absolute_error, mean_squared_error, roc_auc_score, top_k_accuracy_score
from torch import nn

import sparkdl
from sparkdl import TorchEstimator
from sparkdl.datasets import digits_dataframe, digits_images_dataframe, load_digits, train_test_split_digits
from sparkdl.errors import ConfigError
from sparkdl.strategies.lr_schedule import LrCurve

PIXELS = [f"p{i}" for i in range(64)]
COMMON = dict(num_workers=2, progress=False)
SEEN: list[tuple[int, float]] = []  # (epoch, when) of every record the callback saw


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def stop_after_epoch_two(record: dict) -> str | None:
    SEEN.append((int(record["epoch"]), time.monotonic()))
    return "stop" if record["epoch"] == 2 else None


def features_and_labels(df) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    table = df.select(*PIXELS, "label").toArrow()
    x = torch.tensor(np.stack([table.column(c).to_numpy() for c in PIXELS], axis=1), dtype=torch.float32)
    return x, torch.tensor(table.column("label").to_numpy())


@pytest.fixture(scope="module")
def digits_split(spark):  # type: ignore[no-untyped-def]
    train, test = train_test_split_digits(seed=1)
    return digits_dataframe(spark, indices=train).cache(), digits_dataframe(spark, indices=test).cache()


@pytest.fixture(scope="module")
def scheduled(digits_split, mlflow_server):  # type: ignore[no-untyped-def]
    """One tracked fit: cosine with warm-up, three metrics, and a callback stopping after epoch 2 of 5."""
    train, test = digits_split
    SEEN.clear()
    started = time.monotonic()
    model = TorchEstimator(model=mlp, feature_cols=PIXELS, label_col="label", epochs=5, batch_size=32, lr=0.01,
                           lr_schedule="cosine", warmup_steps=10, min_lr=0.001, log_every=1, strategy="data_parallel",
                           metrics=["accuracy", "top_3_accuracy", "perplexity", "auc"], validation_df=test,
                           callbacks=[stop_after_epoch_two], tracking_uri=mlflow_server.uri,
                           experiment="sparkdl-essentials", **COMMON).fit(train)
    return model, time.monotonic() - started, mlflow_server


def test_logged_lr_points_follow_the_schedule(scheduled) -> None:  # type: ignore[no-untyped-def]
    model, _, server = scheduled
    from mlflow.tracking import MlflowClient

    client = MlflowClient(server.uri)
    points = {p.step: p.value for p in client.get_metric_history(model.run_id, "lr")}
    steps = model.history[0]["steps"]
    curve = LrCurve("cosine", total_steps=5 * steps, warmup_steps=10, min_factor=0.1)
    assert len(points) >= 3 * steps - 1
    for step, lr in points.items():  # the lr after `step` optimizer steps: the next step's
        assert lr == pytest.approx(0.01 * curve(step), rel=1e-6, abs=1e-12), step
    assert points[5] == pytest.approx(0.005)  # half-way through the warm-up


def test_a_callback_stop_ends_the_fit_after_that_epoch(scheduled) -> None:  # type: ignore[no-untyped-def]
    model, seconds, server = scheduled
    assert [epoch for epoch, _ in SEEN] == [0, 1, 2]
    assert SEEN[0][1] - (SEEN[-1][1] - seconds) < seconds  # seen while the fit ran, not after it
    assert len(model.history) == 3 and model.history[-1]["stopped_by"] == "callback:stop_after_epoch_two"
    from mlflow.tracking import MlflowClient

    run = MlflowClient(server.uri).get_run(model.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["stopped_by"] == "callback:stop_after_epoch_two"
    assert run.data.tags["stopped_after_epoch"] == "2"
    assert "val_top_3_accuracy" in run.data.metrics and "val_auc" in run.data.metrics
    assert run.data.params["train.lr_schedule"] == "cosine"


def test_classification_metrics_equal_driver_references(scheduled, digits_split) -> None:  # type: ignore[no-untyped-def]
    model, _, _ = scheduled
    x, y = features_and_labels(digits_split[1])
    with torch.no_grad():
        logits = model.torch_module()(x)
    last = model.history[-1]  # validated with the weights the fit returned (stopped after this epoch)
    probs = torch.softmax(logits, 1).numpy()
    assert last["val_accuracy"] == pytest.approx(float((logits.argmax(1) == y).double().mean()), abs=1e-9)
    assert last["val_top_3_accuracy"] == pytest.approx(top_k_accuracy_score(y, probs, k=3, labels=range(10)),
                                                       abs=1e-9)
    assert last["val_perplexity"] == pytest.approx(float(torch.exp(F.cross_entropy(logits, y))), rel=1e-5)
    assert last["val_auc"] == pytest.approx(roc_auc_score(y, probs, multi_class="ovr", average="macro"), abs=1e-6)


def test_regression_metrics_equal_driver_references(spark, digits_split) -> None:  # type: ignore[no-untyped-def]
    train, test = (df.withColumn("label", df["label"].cast("double") / 9.0) for df in digits_split)
    model = TorchEstimator(model=lambda: nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 1)),
                           feature_cols=PIXELS, label_col="label", loss="mse", epochs=2, batch_size=64, lr=0.01,
                           metrics=["mae", "rmse"], validation_df=test, strategy="data_parallel", tracking=False,
                           **COMMON).fit(train)
    x, y = features_and_labels(test)
    with torch.no_grad():
        predicted = model.torch_module()(x).reshape(-1).double().numpy()
    last = model.history[-1]
    assert last["val_mae"] == pytest.approx(mean_absolute_error(y.numpy(), predicted), rel=1e-5)
    assert last["val_rmse"] == pytest.approx(np.sqrt(mean_squared_error(y.numpy(), predicted)), rel=1e-5)


def rising_validation_loss(spark):  # type: ignore[no-untyped-def]
    """(train, validation frames, the validation rows, feature columns): validation labels are the
    rule's opposite, so learning the rule makes the validation loss rise."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(256, 8))
    y = (x[:, 0] > 0).astype(int)
    rows = [(*map(float, r), int(t)) for r, t in zip(x, y)]
    cols = [f"f{i}" for i in range(8)]
    train = spark.createDataFrame(rows[:192], cols + ["label"]).repartition(2).cache()
    flipped = [(*r[:-1], 1 - r[-1]) for r in rows[192:]]
    return train, spark.createDataFrame(flipped, cols + ["label"]).cache(), flipped, cols


def test_early_stopping_on_a_rising_val_loss_restores_the_best_epoch_on_every_stage(spark) -> None:  # type: ignore[no-untyped-def]
    train, validation, flipped, cols = rising_validation_loss(spark)
    model = TorchEstimator(model=lambda: nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)),
                           feature_cols=cols, label_col="label", epochs=8, batch_size=16, lr=0.05, optimizer="sgd",
                           strategy="hybrid", stages=2, validation_df=validation, tracking=False,
                           early_stopping={"metric": "val_loss", "patience": 2}, **COMMON).fit(train)
    history = model.history
    assert [h["epoch"] for h in history] == [0, 1, 2]
    assert history[-1]["stopped_by"] == "early_stopping" and "val_loss did not improve" in history[-1]["stop_reason"]
    assert history[0]["val_loss"] < history[1]["val_loss"] < history[2]["val_loss"]
    assert history[-1]["best_epoch"] == 0
    vx = torch.tensor([r[:-1] for r in flipped], dtype=torch.float32)
    vy = torch.tensor([r[-1] for r in flipped])
    with torch.no_grad():  # both stages' weights are epoch 0's
        val_loss = float(F.cross_entropy(model.torch_module()(vx), vy))
    assert val_loss == pytest.approx(history[0]["val_loss"], rel=1e-5)


def test_diloco_takes_a_schedule_accumulation_and_early_stopping(spark, mlflow_server) -> None:  # type: ignore[no-untyped-def]
    """DiLoCo's inner optimizers follow the schedule (warm-up then cosine, as in the paper), stepped
    once per accumulation window; early stopping ends every rank at the same epoch on the best
    global model, with the MLflow tags."""
    import math

    from mlflow.tracking import MlflowClient

    train, validation, flipped, cols = rising_validation_loss(spark)
    epochs, accumulate = 10, 2
    model = TorchEstimator(model=lambda: nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)),
                           feature_cols=cols, label_col="label", epochs=epochs, batch_size=16, lr=0.05, optimizer="sgd",
                           strategy="data_parallel", sync="diloco", sync_every=4, accumulate_steps=accumulate, lr_schedule="cosine",
                           warmup_steps=6, min_lr=0.005, log_every=1, validation_df=validation,
                           early_stopping={"metric": "val_loss", "patience": 2, "restore_best": True},
                           tracking_uri=mlflow_server.uri, experiment="sparkdl-essentials", **COMMON).fit(train)
    history = model.history
    best = min(range(len(history)), key=lambda e: history[e]["val_loss"])
    assert len(history) < epochs and history[-1]["stopped_by"] == "early_stopping"
    assert history[-1]["epoch"] == best + 2 and history[-1]["best_epoch"] == best
    vx = torch.tensor([r[:-1] for r in flipped], dtype=torch.float32)
    vy = torch.tensor([r[-1] for r in flipped])
    with torch.no_grad():
        assert float(F.cross_entropy(model.torch_module()(vx), vy)) == pytest.approx(history[best]["val_loss"], rel=1e-5)

    client = MlflowClient(mlflow_server.uri)
    run = client.get_run(model.run_id)
    assert run.data.tags["stopped_by"] == "early_stopping" and run.data.tags["stopped_after_epoch"] == str(best + 2)
    # each rank's own peak RSS, as measured by the rank, is a run metric
    assert run.data.metrics["max_peak_rss_bytes_per_rank"] == max(history[-1]["peak_rss_bytes_by_rank"]) > 0
    assert {"peak_rss_bytes_rank_0", "peak_rss_bytes_rank_1"} <= set(run.data.metrics)
    steps = history[0]["steps"]
    per_epoch = math.ceil(steps / accumulate)
    curve = LrCurve("cosine", total_steps=epochs * per_epoch, warmup_steps=6, min_factor=0.1)
    points = {p.step: p.value for p in client.get_metric_history(model.run_id, "lr")}
    assert len(points) >= len(history) * steps - 1
    for step, lr in points.items():  # the inner lr after `step` loader steps: one optimizer step per window
        epoch, within = divmod(step - 1, steps)
        done = epoch * per_epoch + (per_epoch if within + 1 == steps else (within + 1) // accumulate)
        assert lr == pytest.approx(0.05 * curve(done), rel=1e-6, abs=1e-12), step


def test_training_options_are_checked_before_any_job(digits_df) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="no validation rows"):
        TorchEstimator(model=mlp, feature_cols=PIXELS, epochs=2, tracking=False, early_stopping={"patience": 1},
                       **COMMON).fit(digits_df)
    with pytest.raises(ConfigError, match="perplexity"):
        TorchEstimator(model=lambda: nn.Linear(64, 1), feature_cols=PIXELS, loss="mse", metrics=["perplexity"],
                       validation_fraction=0.2, tracking=False, **COMMON).fit(digits_df)
    with pytest.raises(ConfigError, match="precision='16' needs CUDA"):
        TorchEstimator(model=mlp, feature_cols=PIXELS, precision="16", tracking=False, **COMMON).fit(digits_df)
    with pytest.raises(ConfigError, match="computed on validation rows"):
        TorchEstimator(model=mlp, feature_cols=PIXELS, metrics=["accuracy"], tracking=False, **COMMON).fit(digits_df)
    with pytest.raises(ConfigError, match="built-in loop"):
        sparkdl.run(lambda ctx: None, df=digits_df, num_workers=2, callbacks=[stop_after_epoch_two])


def two_partitions(spark, rows: int = 128):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(7)
    x = rng.normal(size=(rows, 6))
    y = (x[:, 0] + x[:, 1] > 0).astype(int)
    w = rng.uniform(0.1, 3.0, size=rows)  # uneven weights: per-micro-batch means would differ from the window's
    data = [(*map(float, r), int(t), float(v)) for r, t, v in zip(x, y, w)]
    return spark.sparkContext.parallelize(data, 2).toDF([f"f{i}" for i in range(6)] + ["label", "w"]).cache()


@pytest.mark.parametrize("options", [{"strategy": "data_parallel"},
                                     {"strategy": "data_parallel", "weight_col": "w"},
                                     {"strategy": "hybrid", "stages": 2, "microbatches": 2},
                                     {"strategy": "hybrid", "stages": 2, "microbatches": 2, "weight_col": "w"}],
                         ids=["data_parallel", "data_parallel_weighted", "hybrid", "hybrid_weighted"])
def test_two_accumulated_micro_batches_equal_one_batch_twice_the_size(spark, options) -> None:  # type: ignore[no-untyped-def]
    df = two_partitions(spark)
    common = dict(model=lambda: nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2)),
                  feature_cols=[f"f{i}" for i in range(6)], label_col="label", epochs=2, optimizer="sgd", lr=0.2,
                  shuffle=False, seed=4, tracking=False, **COMMON, **options)
    accumulated = TorchEstimator(batch_size=16, accumulate_steps=2, **common).fit(df)
    whole = TorchEstimator(batch_size=32, **common).fit(df)
    got, want = accumulated.torch_module().state_dict(), whole.torch_module().state_dict()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0, msg=key)
    assert [h["steps"] for h in accumulated.history] == [2 * h["steps"] for h in whole.history]
    # the same optimizer steps send the same gradient bytes: accumulation communicates on the last only
    sent = [h["bytes_sent_all_ranks"] for h in accumulated.history]
    assert sent == pytest.approx([h["bytes_sent_all_ranks"] for h in whole.history], rel=0.02)


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(256, 10))


def test_bf16_training_of_a_cnn_is_as_accurate_as_fp32(spark) -> None:  # type: ignore[no-untyped-def]
    train_idx, test_idx = train_test_split_digits(seed=0)
    train = digits_images_dataframe(spark, indices=train_idx).cache()
    test = digits_images_dataframe(spark, indices=test_idx).cache()
    accuracy = {}
    for precision in ("32", "bf16"):
        model = TorchEstimator(model=cnn, input_cols=["pixels"], input_shapes={"pixels": [1, 8, 8]}, label_col="label",
                               epochs=6, batch_size=32, lr=3e-3, seed=0, precision=precision, tracking=False,
                               strategy="data_parallel", **COMMON).fit(train)
        rows = model.transform(test).select("prediction", "label").collect()
        accuracy[precision] = sum(r["prediction"] == r["label"] for r in rows) / len(rows)
    assert accuracy["32"] >= 0.9
    assert accuracy["bf16"] >= accuracy["32"] - 0.01, accuracy
    assert len(load_digits()[1]) == 1797


def test_hybrid_under_bf16_sends_bf16_activations_at_half_the_bytes(spark) -> None:  # type: ignore[no-untyped-def]
    df = two_partitions(spark)
    fits = {precision: TorchEstimator(model=lambda: nn.Sequential(nn.Linear(6, 256), nn.Tanh(), nn.Linear(256, 2)),
                                      feature_cols=[f"f{i}" for i in range(6)], label_col="label", epochs=1,
                                      batch_size=16, strategy="hybrid", stages=2, microbatches=2, precision=precision,
                                      tracking=False, **COMMON).fit(df)
            for precision in ("32", "bf16")}
    assert fits["bf16"].plan.layout.boundary_dtypes == ("bfloat16",)  # what the planner priced and the ranks send
    assert fits["32"].plan.layout.boundary_dtypes == ("float32",)
    sent = {p: m.history[0]["bytes_sent_all_ranks"] for p, m in fits.items()}
    assert 0.45 < sent["bf16"] / sent["32"] < 0.6, sent  # activations and their gradients halve
    assert np.isfinite(fits["bf16"].history[0]["loss"])
