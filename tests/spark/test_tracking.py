"""Every fit is one complete MLflow run owned by the driver, checked through a real tracking server."""
from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest
from torch import nn

from sparkdl import TorchEstimator
from sparkdl.datasets import DIGITS_FEATURE_COLS, digits_dataframe


def small_net() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


MLFLOW_NOISE: dict[str, list[str]] = {}  # what MLflow said during the tracked fit, filled by the fixture


@pytest.fixture(scope="module")
def tracked(spark, mlflow_server):  # type: ignore[no-untyped-def]
    df = digits_dataframe(spark)
    estimator = TorchEstimator(model=small_net, feature_cols=DIGITS_FEATURE_COLS, epochs=3, batch_size=32,
                               lr=3e-3, num_workers=2, validation_fraction=0.2, log_every=5,
                               tracking_uri=mlflow_server.uri, experiment="sparkdl-tests", progress=False)
    handler = _Records()
    logging.getLogger("mlflow").addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = estimator.fit(df)
    finally:
        logging.getLogger("mlflow").removeHandler(handler)
    MLFLOW_NOISE["warnings"] = [f"{w.category.__name__}: {w.message} ({w.filename})" for w in caught
                                if "mlflow" in w.filename or "mlflow" in str(w.message).lower()]
    MLFLOW_NOISE["log"] = [f"{r.name}: {r.getMessage()}" for r in handler.records]
    return model, df, mlflow_server


def test_a_tracked_fit_draws_no_warning_from_mlflow(tracked) -> None:  # type: ignore[no-untyped-def]
    """Neither Python warnings raised in MLflow's code or naming it (type hints of predict, the
    integer-column hint, ...) nor WARNING records of its loggers (the CloudPickle caution)."""
    model, _, _ = tracked
    assert model.model_uri
    assert MLFLOW_NOISE == {"warnings": [], "log": []}


def test_one_run_with_params_dataset_world_and_versions(tracked) -> None:  # type: ignore[no-untyped-def]
    from mlflow import MlflowClient

    model, _, server = tracked
    client = MlflowClient(tracking_uri=server.uri)
    experiment = client.get_experiment_by_name("sparkdl-tests")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [model.run_id]  # exactly one run for the one fit
    run = runs[0]
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["train.epochs"] == "3" and params["launch.num_workers"] == "2"
    assert params["data.batch_size"] == "32" and params["data.validation_fraction"] == "0.2"
    assert int(params["dataset.rows"]) + int(params["dataset.validation_rows"]) == 1797
    assert "p0:double" in params["dataset.columns"] and params["dataset.num_features"] == "64"
    for key in ("version.sparkdl", "version.torch", "version.pyspark", "version.python", "world.master",
                "world.hosts", "world.device"):
        assert params[key]
    assert params["world.size"] == "2" and params["world.gpus_rank0"] == "none"


def test_metric_histories_have_increasing_steps(tracked) -> None:  # type: ignore[no-untyped-def]
    from mlflow import MlflowClient

    model, _, server = tracked
    client = MlflowClient(tracking_uri=server.uri)
    for name in ("loss", "lr", "samples_per_sec", "step_time_s"):
        steps = [m.step for m in client.get_metric_history(model.run_id, name)]
        assert len(steps) >= 3 and steps == sorted(steps) and len(set(steps)) == len(steps), name
    for name in ("epoch_loss", "epoch_val_loss", "epoch_val_accuracy", "epoch_samples_per_sec", "epoch_bytes_sent",
                 "epoch_data_seconds"):
        history = client.get_metric_history(model.run_id, name)
        assert [m.step for m in history] == [0, 1, 2], name
    for name in ("time_to_first_step_s", "spool_seconds"):  # once per run, from the first epoch
        assert [(m.step, m.value) for m in client.get_metric_history(model.run_id, name)] == [(0, model.history[0][name])]
    assert [h["val_accuracy"] for h in model.history][-1] > 0.5
    assert client.get_metric_history(model.run_id, "epoch_loss")[-1].value == pytest.approx(model.history[-1]["loss"])


def test_the_logged_model_predicts_like_transform(tracked) -> None:  # type: ignore[no-untyped-def]
    import mlflow.pyfunc

    model, df, server = tracked
    mlflow.set_tracking_uri(server.uri)
    try:
        loaded = mlflow.pyfunc.load_model(model.model_uri)
        assert loaded.metadata.signature is not None
        # Materialised once: a limit evaluated twice may keep other rows, or order them otherwise,
        # when Spark gathers the partitions' first rows in another order (it did under load).
        sample = df.limit(20).coalesce(1).cache()
        sample.count()
        rows = sample.toPandas()
        served = loaded.predict(rows[list(DIGITS_FEATURE_COLS)])
    finally:
        mlflow.set_tracking_uri(None)
    predicted = [r["prediction"] for r in model.transform(sample).collect()]
    # The served model answers what transform writes (the class index), probabilities beside it.
    assert served["prediction"].tolist() == predicted
    probabilities = np.asarray(served["probabilities"].tolist())
    assert probabilities.shape == (20, 10) and np.allclose(probabilities.sum(axis=1), 1.0, atol=1e-5)
    assert (probabilities.argmax(axis=1) == np.asarray(predicted)).all()


def test_a_model_never_loaded_on_the_driver_is_logged_from_the_files_and_loads_on_first_use(
        spark, mlflow_server) -> None:  # type: ignore[no-untyped-def]
    import mlflow.pyfunc
    import torch

    df = digits_dataframe(spark)
    model = TorchEstimator(model=small_net, feature_cols=DIGITS_FEATURE_COLS, epochs=1, batch_size=64, num_workers=2,
                           tracking_uri=mlflow_server.uri, progress=False, load_model=False).fit(df)
    assert not model.loaded and model.model_uri
    # Fixed rows: a limit evaluated twice may keep other rows (it did under load).
    sample = spark.createDataFrame(df.limit(20).collect(), df.schema)
    mlflow.set_tracking_uri(mlflow_server.uri)
    try:
        served = mlflow.pyfunc.load_model(model.model_uri).predict(sample.toPandas()[list(DIGITS_FEATURE_COLS)])
    finally:
        mlflow.set_tracking_uri(None)
    assert not model.loaded  # logging and serving never needed the weights in this process
    predicted = [r.prediction for r in model.transform(sample).collect()]
    assert model.loaded and list(served["prediction"]) == predicted
    assert all(not t.is_meta for t in model.torch_module().state_dict().values())
    assert isinstance(model.torch_module()[0].weight, torch.nn.Parameter)


def test_the_logged_model_lists_what_serving_needs(tracked, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """sparkdl says the pip requirements itself (MLflow's inference loads the model in a subprocess)."""
    import mlflow
    import torch

    model, _, server = tracked
    mlflow.set_tracking_uri(server.uri)  # a models:/ URI resolves through the global tracking URI
    try:
        local = mlflow.artifacts.download_artifacts(model.model_uri, dst_path=str(tmp_path))
    finally:
        mlflow.set_tracking_uri(None)
    lines = open(f"{local}/requirements.txt").read().split()
    assert f"torch=={torch.__version__.split('+')[0]}" in lines
    assert {ln.split("==")[0] for ln in lines} >= {"sparkdl-torch", "mlflow", "pandas", "numpy", "pyarrow", "cloudpickle"}


def test_the_loss_curve_png_is_an_artifact(tracked, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from mlflow import MlflowClient

    model, _, server = tracked
    client = MlflowClient(tracking_uri=server.uri)
    assert "loss_curve.png" in [a.path for a in client.list_artifacts(model.run_id)]
    local = client.download_artifacts(model.run_id, "loss_curve.png", str(tmp_path))
    with open(local, "rb") as stream:
        assert stream.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_failed_run_is_marked_failed_with_the_log_tail(spark, mlflow_server) -> None:  # type: ignore[no-untyped-def]
    from mlflow import MlflowClient

    from sparkdl.errors import TrainingError

    class Exploding(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(64, 10)
            self.calls = 0

        def forward(self, x):  # type: ignore[no-untyped-def]
            self.calls += 1
            if self.training and self.calls > 3:
                print("about to fail on purpose; password=hunter2")
                raise ArithmeticError("exploded at step 3 reading s3://AKIAX:p@ss@bucket/x?sig=SAS123&p=1")
            return self.layer(x)

    estimator = TorchEstimator(model=Exploding, feature_cols=DIGITS_FEATURE_COLS, epochs=1, batch_size=64,
                               num_workers=2, tracking_uri=mlflow_server.uri, experiment="sparkdl-failures",
                               progress=False, timeout_s=30, peer_failure_delay_s=0.5)
    # strategy="auto" profiles the model on the driver first, where it explodes too: the planner
    # steps aside (data parallel, with a warning) and the ranks report the failure as before.
    with pytest.raises(TrainingError, match="ArithmeticError: exploded at step 3"), \
            pytest.warns(UserWarning, match="could not profile the model"):
        estimator.fit(digits_dataframe(spark))
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    experiment = client.get_experiment_by_name("sparkdl-failures")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FAILED"
    report = client.download_artifacts(run.info.run_id, "failure.txt")
    text = open(report).read()
    assert "exploded at step 3" in text and "about to fail on purpose" in text
    # error texts echo URIs: their passwords, credential query parameters and secret=... are masked
    assert "s3://AKIAX:***@bucket/x?sig=***&p=1" in text and "password=***" in text
    assert not any(secret in text for secret in ("p@ss", "SAS123", "hunter2"))


def test_training_goes_on_when_the_server_dies_mid_run(spark, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from mlflow_server import FAST_FAIL_CLIENT_ENV, MlflowServer

    from sparkdl.driver.monitor import RunMonitor

    for name, value in FAST_FAIL_CLIENT_ENV.items():
        monkeypatch.setenv(name, value)
    server = MlflowServer(tmp_path / "doomed").start()
    original = RunMonitor._on_start

    def kill_then_start(self, message):  # type: ignore[no-untyped-def]
        server.kill()  # the run exists; everything after this point meets a dead server
        original(self, message)

    monkeypatch.setattr(RunMonitor, "_on_start", kill_then_start)
    try:
        with pytest.warns(RuntimeWarning, match="MLflow tracking failed"):
            model = TorchEstimator(model=small_net, feature_cols=DIGITS_FEATURE_COLS, epochs=2, batch_size=64,
                                   num_workers=2, tracking_uri=server.uri, progress=False).fit(digits_dataframe(spark))
    finally:
        server.stop()
    assert [h["epoch"] for h in model.history] == [0, 1]
    assert model.torch_module() is not None


def test_tracking_can_be_turned_off(spark) -> None:  # type: ignore[no-untyped-def]
    model = TorchEstimator(model=small_net, feature_cols=DIGITS_FEATURE_COLS, epochs=1, num_workers=2,
                           tracking=False, progress=False).fit(digits_dataframe(spark).limit(200))
    assert model.run_id is None and model.model_uri is None and len(model.history) == 1


def test_a_fit_inside_an_active_run_is_nested_under_it(spark, mlflow_server) -> None:  # type: ignore[no-untyped-def]
    import mlflow
    from mlflow import MlflowClient

    mlflow.set_tracking_uri(mlflow_server.uri)
    try:
        with mlflow.start_run(run_name="parent") as parent:
            model = TorchEstimator(model=small_net, feature_cols=DIGITS_FEATURE_COLS, epochs=1, num_workers=2,
                                   tracking_uri=mlflow_server.uri, progress=False).fit(digits_dataframe(spark).limit(300))
    finally:
        mlflow.set_tracking_uri(None)
    child = MlflowClient(tracking_uri=mlflow_server.uri).get_run(model.run_id)
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert child.info.experiment_id == parent.info.experiment_id


def test_validation_df_gives_per_epoch_validation_metrics(spark) -> None:  # type: ignore[no-untyped-def]
    from sparkdl.datasets import train_test_split_digits

    train_idx, test_idx = train_test_split_digits(seed=1)
    model = TorchEstimator(model=small_net, feature_cols=DIGITS_FEATURE_COLS, epochs=2, num_workers=2, lr=3e-3,
                           batch_size=32, tracking=False, progress=False,
                           validation_df=digits_dataframe(spark, indices=test_idx)).fit(
        digits_dataframe(spark, indices=train_idx))
    assert all({"val_loss", "val_accuracy"} <= set(h) for h in model.history)
    assert model.history[-1]["val_loss"] < model.history[0]["val_loss"]
    assert sum(h["samples"] for h in model.history[:1]) >= len(train_idx)


def test_no_credentials_or_environment_reach_mlflow(spark, mlflow_server, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from mlflow import MlflowClient

    monkeypatch.setenv("SPARKDL_TEST_API_TOKEN", "tok-98765-secret")
    uri = mlflow_server.uri.replace("http://", "http://bob:pw-s3cret@")
    model = TorchEstimator(model=small_net, feature_cols=DIGITS_FEATURE_COLS, epochs=1, batch_size=64, num_workers=2,
                           tracking_uri=uri, experiment="sparkdl-secrets", progress=False,
                           strategy="data_parallel").fit(digits_dataframe(spark).limit(256))
    run = MlflowClient(tracking_uri=mlflow_server.uri).get_run(model.run_id)
    logged = " ".join(f"{k}={v}" for k, v in {**run.data.params, **run.data.tags}.items())
    assert "pw-s3cret" not in logged and "tok-98765" not in logged
    assert run.data.params["tracking.tracking_uri"] == mlflow_server.uri.replace("http://", "http://bob:***@")


def test_a_decimal_feature_column_logs_a_model_that_serves(spark, mlflow_server) -> None:  # type: ignore[no-untyped-def]
    import mlflow.pyfunc
    from pyspark.sql import functions as F

    df = digits_dataframe(spark).select(*[F.col(c).cast("decimal(10,2)").alias(c) if c == "p10" else F.col(c)
                                          for c in [*DIGITS_FEATURE_COLS, "label"]])
    model = TorchEstimator(model=small_net, feature_cols=DIGITS_FEATURE_COLS, epochs=1, batch_size=64, num_workers=2,
                           tracking_uri=mlflow_server.uri, experiment="sparkdl-decimal", progress=False).fit(df)
    assert model.model_uri is not None, "the model was not logged (the input example must serialise)"
    mlflow.set_tracking_uri(mlflow_server.uri)
    try:
        loaded = mlflow.pyfunc.load_model(model.model_uri)
        rows = df.limit(5).toPandas()[list(DIGITS_FEATURE_COLS)]
        rows["p10"] = rows["p10"].astype(float)  # as the example was logged
        served = loaded.predict(rows)
        assert len(served) == 5 and set(served["prediction"]) <= set(range(10))
    finally:
        mlflow.set_tracking_uri(None)


def test_a_token_model_logged_to_mlflow_serves_per_position_predictions(spark, mlflow_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Tensor specs in the signature; pyfunc predict on a frame with array columns and MLflow's own
    scoring server (REST /invocations) both answer what transform writes."""
    import mlflow.pyfunc
    from served_model import served_answers

    from sparkdl.datasets import synthetic_tokens_dataframe
    from sparkdl_test_models import TOKEN_LEN as T, tiny_gpt as gpt  # noqa: N811

    df = synthetic_tokens_dataframe(spark, rows=256, seq_len=T, vocab=16, seed=0).repartition(2)
    model = TorchEstimator(model=gpt, input_cols=["tokens"], label_col="targets", epochs=1, batch_size=32,
                           num_workers=2, tracking_uri=mlflow_server.uri, experiment="sparkdl-tokens",
                           progress=False).fit(df)
    assert model.model_uri is not None
    rows = df.limit(3).collect()  # fixed rows: limit() over a repartition may pick others each time
    sample = spark.createDataFrame(rows, df.schema)
    expected = [r["prediction"] for r in model.transform(sample).collect()]
    frame = sample.select("tokens").toPandas()
    mlflow.set_tracking_uri(mlflow_server.uri)
    try:
        loaded = mlflow.pyfunc.load_model(model.model_uri)
        inputs = loaded.metadata.signature.inputs
        assert not inputs.is_tensor_spec() or inputs.inputs[0].type == np.dtype("int32")
        assert [list(p) for p in loaded.predict(frame)["prediction"]] == expected
        local = mlflow.artifacts.download_artifacts(model.model_uri, dst_path=str(tmp_path / "served"))
    finally:
        mlflow.set_tracking_uri(None)
    answer = served_answers(local, {"columns": ["tokens"], "data": [[r] for r in frame["tokens"].map(list)]})
    assert [row["prediction"] for row in answer] == expected


def test_a_png_model_serves_bytes_through_its_transform_fn(spark, mlflow_server) -> None:  # type: ignore[no-untyped-def]
    """Binary inputs: a column-based signature, and the logged pyfunc decodes with the fit's transform_fn."""
    import mlflow.pyfunc
    import torch

    from sparkdl.datasets import decode_digit_png, digits_images_dataframe

    def cnn() -> nn.Module:
        return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(512, 10))

    df = digits_images_dataframe(spark).repartition(2)
    model = TorchEstimator(model=cnn, input_cols=["png"], transform_fn=decode_digit_png, label_col="label", epochs=1,
                           batch_size=64, num_workers=2, tracking_uri=mlflow_server.uri, experiment="sparkdl-png",
                           progress=False).fit(df)
    assert model.model_uri is not None
    rows = df.limit(6).collect()
    sample = spark.createDataFrame(rows, df.schema)
    expected = [r["prediction"] for r in model.transform(sample).collect()]
    mlflow.set_tracking_uri(mlflow_server.uri)
    try:
        loaded = mlflow.pyfunc.load_model(model.model_uri)
        assert not loaded.metadata.signature.inputs.is_tensor_spec()
        served = loaded.predict(sample.select("png").toPandas())
    finally:
        mlflow.set_tracking_uri(None)
    assert served["prediction"].tolist() == expected
    assert torch.tensor(served["probabilities"].tolist()).shape == (6, 10)


def test_three_concurrent_fits_from_three_threads_each_get_their_own_run(spark, mlflow_server) -> None:  # type: ignore[no-untyped-def]
    """Two notebook cells (or threads) fitting at once: three 2-rank fits on 4 slots all finish, the
    third waiting for slots, each with its own FINISHED MLflow run and its own metrics."""
    import threading

    from mlflow import MlflowClient

    df = digits_dataframe(spark).limit(400).cache()
    df.count()
    results: dict[int, object] = {}

    def fit(index: int) -> None:
        try:
            results[index] = TorchEstimator(model=small_net, feature_cols=DIGITS_FEATURE_COLS, epochs=1, batch_size=32,
                                            num_workers=2, strategy="data_parallel", seed=index,
                                            tracking_uri=mlflow_server.uri, experiment="sparkdl-concurrent",
                                            run_name=f"fit-{index}", progress=False).fit(df)
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            results[index] = exc

    threads = [threading.Thread(target=fit, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    assert all(not isinstance(r, Exception) for r in results.values()), results
    assert sorted(results) == [0, 1, 2]
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    runs = {r.info.run_id: r for r in client.search_runs([client.get_experiment_by_name("sparkdl-concurrent")
                                                          .experiment_id])}
    assert sorted(runs) == sorted(m.run_id for m in results.values())  # type: ignore[union-attr]
    for model in results.values():
        run = runs[model.run_id]  # type: ignore[union-attr]
        assert run.info.status == "FINISHED" and run.data.metrics["epoch_loss"] > 0
        assert run.data.tags["mlflow.runName"] == f"fit-{model.options['train.seed']}"  # type: ignore[union-attr]


def chatty_cross_entropy(output, labels):  # type: ignore[no-untyped-def]
    import torch

    print(f"loss on a batch of {len(labels)}")
    return torch.nn.functional.cross_entropy(output, labels)


def test_without_a_channel_epoch_metrics_and_rank_zeros_output_still_reach_the_run(spark, mlflow_server,  # type: ignore[no-untyped-def]
                                                                                   tmp_path) -> None:
    """launch.channel="off" (executors that cannot reach the driver): the epoch records and the tail
    of rank 0's output come back with the job's result and are logged to the run afterwards."""
    from mlflow import MlflowClient

    df = digits_dataframe(spark).limit(256)
    model = TorchEstimator(model=small_net, feature_cols=DIGITS_FEATURE_COLS, epochs=2, batch_size=64, num_workers=2,
                           strategy="data_parallel", loss=chatty_cross_entropy, channel="off",
                           tracking_uri=mlflow_server.uri, experiment="sparkdl-no-channel", progress=False).fit(df)
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    run = client.get_run(model.run_id)
    assert run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(model.run_id, "epoch_loss")) == [0, 1]
    assert "loss" not in run.data.metrics  # step metrics need the live channel
    output = open(client.download_artifacts(model.run_id, "rank0_output.txt", str(tmp_path))).read()
    assert output.count("loss on a batch of") == len(model.history) * model.history[0]["steps"]


def test_where_the_fit_time_went_is_on_the_model_and_the_run(tracked) -> None:  # type: ignore[no-untyped-def]
    from mlflow import MlflowClient

    model, _, server = tracked
    phases = model.fit_seconds
    assert list(phases) == ["slots", "prepare", "checks", "plan", "tracking", "job", "load_model", "log_model"]
    assert all(s >= 0 for s in phases.values()) and phases["job"] > 0
    metrics = MlflowClient(tracking_uri=server.uri).get_run(model.run_id).data.metrics
    assert metrics["fit_job_s"] == pytest.approx(phases["job"])
    assert metrics["fit_total_s"] == pytest.approx(sum(phases.values()))
