"""End-to-end training through the estimator on a real Spark session with two executors."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from sparkdl import TorchEstimator, TorchModel
from sparkdl.datasets import DIGITS_FEATURE_COLS, digits_dataframe, train_test_split_digits


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def accuracy(scored) -> float:  # type: ignore[no-untyped-def]
    rows = scored.select("label", "prediction").collect()
    return float(np.mean([r["label"] == r["prediction"] for r in rows]))


@pytest.fixture(scope="module")
def digits_model(spark):  # type: ignore[no-untyped-def]
    train_idx, test_idx = train_test_split_digits(seed=0)
    train = digits_dataframe(spark, indices=train_idx)
    test = digits_dataframe(spark, indices=test_idx)
    est = TorchEstimator(model=lambda: nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)),
                         loss="cross_entropy", optimizer="adam", lr=3e-3, feature_cols=DIGITS_FEATURE_COLS,
                         label_col="label", batch_size=32, epochs=15, num_workers=2, seed=0)
    return est.fit(train), test


def test_data_parallel_step_equals_single_process_step(spark) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 5)).astype(np.float64)
    y = rng.integers(0, 3, size=64)
    df = spark.createDataFrame([(*map(float, row), int(label)) for row, label in zip(x, y)],
                               ["a", "b", "c", "d", "e", "label"])

    def factory() -> nn.Module:
        return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))

    est = TorchEstimator(model=factory, loss="cross_entropy", optimizer="sgd", lr=0.5,
                         feature_cols=["a", "b", "c", "d", "e"], label_col="label",
                         batch_size=32, epochs=1, num_workers=2, shuffle=False, seed=7,
                         strategy="data_parallel")
    trained = est.fit(df).torch_module()
    assert trained is not None

    torch.manual_seed(7)
    reference = factory()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    loss = nn.functional.cross_entropy(reference(torch.tensor(x, dtype=torch.float32)), torch.tensor(y))
    loss.backward()
    optimizer.step()
    for (name, got), want in zip(trained.state_dict().items(), reference.state_dict().values()):
        assert torch.max(torch.abs(got - want)).item() < 1e-5, name


def test_digits_reach_accuracy_through_fit_and_transform(digits_model) -> None:  # type: ignore[no-untyped-def]
    model, test = digits_model
    scored = model.transform(test)
    # Spark ML's classifier columns: prediction a double, rawPrediction (logits) and probability vectors
    assert set(test.columns) | {"prediction", "rawPrediction", "probability"} == set(scored.columns)
    assert dict(scored.dtypes)["prediction"] == "double" and dict(scored.dtypes)["probability"] == "vector"
    assert accuracy(scored) >= 0.93
    history = model.history
    assert [h["epoch"] for h in history] == list(range(15))
    assert history[-1]["loss"] < history[0]["loss"]
    for key in ("loss", "samples_per_sec", "seconds", "bytes_sent", "steps"):
        assert key in history[0]
    assert history[0]["bytes_sent"] > 0
    # the data path: time to the first step (spooling included) once, the wait for batches every epoch
    assert history[0]["time_to_first_step_s"] >= history[0]["spool_seconds"] > 0
    assert all("time_to_first_step_s" not in h for h in history[1:])
    assert all(0 <= h["data_seconds"] < h["seconds"] for h in history)


def test_save_load_gives_identical_predictions(digits_model, tmp_path) -> None:  # type: ignore[no-untyped-def]
    model, test = digits_model
    path = str(tmp_path / "digits-model")
    model.setInferenceBatchSize(7)  # a ragged last chunk per Arrow batch; kept by save/load
    try:
        model.save(path)
    finally:
        model.setInferenceBatchSize(1024)
    loaded = TorchModel.load(path)
    assert (loaded.inference_batch_size, loaded.inference_gpus) == (7, 0.0)
    before = [r["prediction"] for r in model.transform(test).orderBy("label", *DIGITS_FEATURE_COLS[:8]).collect()]
    after = [r["prediction"] for r in loaded.transform(test).orderBy("label", *DIGITS_FEATURE_COLS[:8]).collect()]
    assert before == after
    assert loaded.history == model.history
    for a, b in zip(model.torch_module().state_dict().values(), loaded.torch_module().state_dict().values()):
        assert torch.equal(a, b)


def test_estimator_inside_a_pipeline_with_vector_features(spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.feature import VectorAssembler

    df = digits_dataframe(spark)
    pipeline = Pipeline(stages=[
        VectorAssembler(inputCols=DIGITS_FEATURE_COLS, outputCol="features"),
        TorchEstimator(model=mlp, feature_cols=["features"], label_col="label", epochs=2, num_workers=2,
                       batch_size=64),
    ])
    fitted = pipeline.fit(df)
    scored = fitted.transform(df)
    assert "prediction" in scored.columns and "features" in scored.columns
    assert scored.count() == df.count()
    path = str(tmp_path / "pipeline")
    fitted.save(path)
    reloaded = PipelineModel.load(path)
    assert isinstance(reloaded.stages[-1], TorchModel)
    got = [r["prediction"] for r in reloaded.transform(df).collect()]
    want = [r["prediction"] for r in scored.collect()]
    assert got == want


def test_regression_on_an_array_column_predicts_values(spark) -> None:  # type: ignore[no-untyped-def]
    from pyspark.sql import functions as F

    rng = np.random.default_rng(3)
    x = rng.normal(size=(400, 3))
    y = x @ np.array([1.5, -2.0, 0.5]) + 0.3
    df = spark.createDataFrame([([float(v) for v in row], float(t)) for row, t in zip(x, y)], ["xs", "target"])
    est = TorchEstimator(model=lambda: nn.Linear(3, 1), loss="mse", optimizer="adam", lr=0.05,
                         feature_cols=["xs"], label_col="target", batch_size=32, epochs=30, num_workers=2)
    model = est.fit(df)
    scored = model.transform(df)
    assert dict(scored.dtypes)["prediction"] == "double"
    mse = scored.select(F.avg((F.col("prediction") - F.col("target")) ** 2)).first()[0]
    assert mse < 0.05


def test_skewed_partitions_finish_with_equal_steps(spark) -> None:  # type: ignore[no-untyped-def]
    import sparkdl

    from pyspark.sql import functions as F

    # Hash-partition on a key held by 400 rows vs 40 rows: one partition ten times the other.
    base = spark.range(440).select((F.col("id") / 440.0).alias("x"), (F.col("id") % 2).alias("label"),
                                   F.when(F.col("id") < 400, F.lit(0)).otherwise(F.lit(None)).alias("k"))
    df = None
    for other in range(1, 20):
        candidate = base.withColumn("k", F.coalesce("k", F.lit(other))).repartition(2, "k").drop("k")
        sizes = sorted(candidate.groupBy(F.spark_partition_id()).count().collect(), key=lambda r: r[1])
        if [r[1] for r in sizes] == [40, 400]:
            df = candidate
            break
    assert df is not None
    assert df.rdd.getNumPartitions() == 2

    def count_steps(ctx):  # type: ignore[no-untyped-def]
        seen = [0, 0]
        for epoch in range(2):
            for features, labels in ctx.batches(epoch):
                seen[epoch] += 1
                assert features.shape[0] == labels.shape[0]
        totals = ctx.comm.allgather_object((ctx.rank, ctx.num_rows, seen))
        return sorted(totals)

    result = sparkdl.run(count_steps, df=df, num_workers=2, feature_cols=["x"], label_col="label", batch_size=16)
    (r0, n0, steps0), (r1, n1, steps1) = result
    assert sorted([n0, n1]) == [40, 400]
    assert steps0 == steps1 == [25, 25]

    # Named, not "auto": on a loaded host the planner may share batches by measured speed (fewer steps).
    model = TorchEstimator(model=lambda: nn.Linear(1, 2), feature_cols=["x"], label_col="label",
                           batch_size=16, epochs=1, num_workers=2, strategy="data_parallel").fit(df)
    assert model.history[0]["steps"] == 25


def test_a_union_of_dataframes_still_trains(spark) -> None:  # type: ignore[no-untyped-def]
    # A union in the last stage cannot run in barrier mode as is; sparkdl reshuffles it.
    a = spark.range(0, 60, numPartitions=1)
    b = spark.range(60, 100, numPartitions=1)
    df = a.union(b).selectExpr("cast(id as double) / 100 as x", "id % 2 as label")
    model = TorchEstimator(model=lambda: nn.Linear(1, 2), feature_cols=["x"], label_col="label",
                           batch_size=10, epochs=1, num_workers=2).fit(df)
    assert model.history[0]["samples"] == 100


def test_a_torch_model_saved_before_the_layout_move_loads_and_predicts_as_it_did(spark) -> None:  # type: ignore[no-untyped-def]
    """tests/fixtures/saved_0_1: TorchModel.save of sparkdl 0.1's flat layout (issue 41)."""
    import json
    from pathlib import Path

    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "saved_0_1"
    loaded = TorchModel.load(str(fixture / "torch_model"))
    rows = json.loads((fixture / "rows.json").read_text())
    df = spark.createDataFrame([[float(r[c]) for c in DIGITS_FEATURE_COLS] for r in rows], list(DIGITS_FEATURE_COLS))
    predicted = [r["prediction"] for r in loaded.transform(df.coalesce(1)).collect()]
    assert predicted == json.loads((fixture / "expected.json").read_text())["predictions"]
