"""Every user-caused problem is a SparkdlError raised on the driver, naming the column and the fix."""
from __future__ import annotations

import time

import pytest
from torch import nn

import sparkdl
from sparkdl import SparkdlError, TorchEstimator
from sparkdl.errors import (
    ArrayLengthError,
    ColumnTypeError,
    ConfigError,
    EmptyDataError,
    InsufficientSlotsError,
    MissingColumnError,
    ModelError,
    NullValuesError,
    TrainingError,
)


def estimator(**options) -> TorchEstimator:  # type: ignore[no-untyped-def]
    defaults = dict(model=lambda: nn.Linear(2, 2), feature_cols=["a", "b"], label_col="label", epochs=1,
                    num_workers=2, slot_wait_s=2)
    defaults.update(options)
    return TorchEstimator(**defaults)


@pytest.fixture(scope="module")
def small_df(spark):  # type: ignore[no-untyped-def]
    return spark.createDataFrame([(float(i), float(i % 3), i % 2, f"s{i}") for i in range(20)],
                                 ["a", "b", "label", "name"])


def test_missing_column_is_named_with_the_available_ones(small_df) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(MissingColumnError) as info:
        estimator(feature_cols=["a", "nope"]).fit(small_df)
    assert "'nope'" in str(info.value) and "a, b, label, name" in str(info.value)
    assert isinstance(info.value, SparkdlError)


def test_non_numeric_column_is_named_with_its_type(small_df) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ColumnTypeError, match=r"'name' has type string"):
        estimator(feature_cols=["a", "name"]).fit(small_df)


def test_nulls_are_counted(spark) -> None:  # type: ignore[no-untyped-def]
    df = spark.createDataFrame([(1.0, None, 0), (2.0, 1.0, 1), (3.0, None, 0)], "a double, b double, label long")
    with pytest.raises(NullValuesError, match=r"'b' has 2 null value\(s\) in 3 rows"):
        estimator().fit(df)


def test_arrays_of_unequal_length(spark) -> None:  # type: ignore[no-untyped-def]
    df = spark.createDataFrame([([1.0, 2.0], 0), ([1.0], 1)], "xs array<double>, label long")
    with pytest.raises(ArrayLengthError, match=r"'xs' holds rows of different lengths \(from 1 to 2\)"):
        estimator(feature_cols=["xs"]).fit(df)


def test_empty_dataframe(small_df) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(EmptyDataError, match="no rows"):
        estimator().fit(small_df.limit(0))


def test_more_workers_than_slots_fails_fast_with_both_numbers(small_df) -> None:  # type: ignore[no-untyped-def]
    started = time.monotonic()
    with pytest.raises(InsufficientSlotsError) as info:
        estimator(num_workers=5).fit(small_df)
    assert time.monotonic() - started < 30
    assert "num_workers=5" in str(info.value) and "only 4 tasks" in str(info.value)
    assert "HINT" in str(info.value)


def test_unknown_option_suggests_the_right_name() -> None:
    with pytest.raises(ConfigError, match="did you mean 'batch_size'"):
        TorchEstimator(model=nn.Linear(2, 2), feature_cols=["a"], batchsize=3)


def test_model_that_does_not_fit_the_features(small_df) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ModelError, match="cannot take a batch of 2 features"):
        estimator(model=lambda: nn.Linear(5, 2)).fit(small_df)


def test_non_class_labels_for_cross_entropy(spark) -> None:  # type: ignore[no-untyped-def]
    df = spark.createDataFrame([(1.0, 2.0, 0.5), (2.0, 1.0, 1.0)], "a double, b double, label double")
    with pytest.raises(ColumnTypeError, match="class indices"):
        estimator().fit(df)


def test_a_failing_rank_gives_a_driver_side_error_naming_it(small_df) -> None:  # type: ignore[no-untyped-def]
    def train_fn(ctx):  # type: ignore[no-untyped-def]
        if ctx.rank == 1:
            raise ValueError("boom from the user loop")
        ctx.comm.barrier()

    with pytest.raises(TrainingError, match=r"rank 1: ValueError: boom from the user loop \(on host \S+\)"):
        sparkdl.run(train_fn, df=small_df.select("a", "b", "label"), num_workers=2, timeout_s=30,
                    peer_failure_delay_s=0.5)


def test_fewer_rows_than_workers(spark) -> None:  # type: ignore[no-untyped-def]
    df = spark.createDataFrame([(1.0, 2.0, 0)], "a double, b double, label long")
    with pytest.raises(ConfigError, match=r"1 row\(s\), fewer than num_workers=2"):
        estimator().fit(df)


def test_drop_last_with_too_few_rows(small_df) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="drop_last=True with batch_size=64"):
        estimator(drop_last=True, batch_size=64).fit(small_df)


def test_nan_labels_are_refused(spark) -> None:  # type: ignore[no-untyped-def]
    df = spark.createDataFrame([(1.0, 2.0, float("nan")), (2.0, 1.0, 1.0)], "a double, b double, label double")
    with pytest.raises(NullValuesError, match="'label' has 1 NaN or infinite"):
        estimator(loss="mse", model=lambda: nn.Linear(2, 1)).fit(df)


def test_output_width_must_fit_the_loss(small_df) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ModelError, match="one logit per class"):
        estimator(model=lambda: nn.Linear(2, 1)).fit(small_df)
    with pytest.raises(ModelError, match="loss 'mse' compares one output"):
        estimator(model=lambda: nn.Linear(2, 3), loss="mse").fit(small_df)


def test_an_unpicklable_train_fn_is_named(small_df) -> None:  # type: ignore[no-untyped-def]
    import threading

    lock = threading.Lock()

    def train_fn(ctx):  # type: ignore[no-untyped-def]
        with lock:
            return ctx.rank

    with pytest.raises(ModelError, match="train_fn cannot be sent to the executors"):
        sparkdl.run(train_fn, df=small_df.select("a", "b", "label"), num_workers=2)


def test_a_failing_model_factory_is_named(small_df) -> None:  # type: ignore[no-untyped-def]
    def broken() -> nn.Module:
        raise KeyError("no such layer")

    with pytest.raises(ModelError, match="the model factory 'broken' raised KeyError"):
        estimator(model=broken).fit(small_df)


def test_loading_a_missing_model_is_a_clear_error(spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from sparkdl import TorchModel

    with pytest.raises(SparkdlError, match="is not a saved TorchModel"):
        TorchModel.load(str(tmp_path / "nothing-here"))


def test_a_stalled_rank_ends_in_an_error_within_the_timeout(small_df, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import os
    import signal

    pid_file = str(tmp_path / "stopped.pid")

    def train_fn(ctx):  # type: ignore[no-untyped-def]
        import os as system
        import signal as signals

        import torch

        if ctx.rank == 1:
            with open(pid_file, "w") as out:
                out.write(str(system.getpid()))
            system.kill(system.getpid(), signals.SIGSTOP)  # stalled: never joins the collective
        ctx.comm.allreduce(torch.ones(2))

    started = time.monotonic()
    try:
        with pytest.raises(TrainingError, match=r"rank\(s\) \[1\] stopped responding.*rank\(s\) \[0\] timed out"):
            sparkdl.run(train_fn, df=small_df.select("a", "b", "label"), num_workers=2, timeout_s=5)
        assert time.monotonic() - started < 60
    finally:
        if os.path.exists(pid_file):
            try:
                os.kill(int(open(pid_file).read()), signal.SIGKILL)  # never leave a stopped worker behind
            except ProcessLookupError:
                pass


def invalid_rows_df(spark):  # type: ignore[no-untyped-def]
    inf, nan = float("inf"), float("nan")
    rows = [([float(i), float(i % 3)], float(i % 2), i % 2) for i in range(40)]
    rows[3] = ([nan, 1.0], 1.0, 1)  # NaN inside the array feature
    rows[7] = ([1.0, 2.0], -inf, 0)  # infinite scalar feature
    rows[11] = ([1.0, 2.0], 1.0, 1)
    df = spark.createDataFrame(rows, "v array<double>, c double, label long")
    return df


def test_nan_and_inf_features_are_named_with_their_count(spark) -> None:  # type: ignore[no-untyped-def]
    df = invalid_rows_df(spark)
    with pytest.raises(NullValuesError, match="feature column 'v' has 1 row\\(s\\) with NaN or infinite") as info:
        estimator(model=lambda: nn.Linear(3, 2), feature_cols=["v", "c"]).fit(df)
    assert "on_invalid='skip'" in str(info.value)
    with pytest.raises(NullValuesError, match="feature column 'c' has 1 row"):
        estimator(model=lambda: nn.Linear(3, 2), feature_cols=["v", "c"]).fit(df.filter("label >= 0").limit(40)
                                                                             .where("not isnan(v[0])"))


def test_on_invalid_skip_drops_and_counts_the_rows(spark) -> None:  # type: ignore[no-untyped-def]
    from sparkdl.data.feed import prepare

    df = invalid_rows_df(spark)
    nan_label = spark.createDataFrame([([1.0, 1.0], 1.0, None)], "v array<double>, c double, label long")
    prepared = prepare(df, ["v", "c"], "label", classification=True, num_workers=2, on_invalid="skip")
    assert (prepared.num_rows, prepared.dropped_rows) == (38, 2)
    model = estimator(model=lambda: nn.Linear(3, 2), feature_cols=["v", "c"], on_invalid="skip",
                      tracking=False, progress=False).fit(df)
    assert model.history[0]["steps"] > 0 and model.history[0]["loss"] == model.history[0]["loss"]  # not NaN
    # nulls stay an error: "skip" is for values no loss can use, not for missing ones
    with pytest.raises(NullValuesError, match="null"):
        estimator(model=lambda: nn.Linear(3, 2), feature_cols=["v", "c"], on_invalid="skip").fit(df.union(nan_label))


def test_on_invalid_skip_drops_class_indices_the_model_has_no_logit_for(spark) -> None:  # type: ignore[no-untyped-def]
    rows = [(float(i), float(i % 5), i % 3) for i in range(30)] + [(1.0, 1.0, 7)]
    df = spark.createDataFrame(rows, "a double, b double, label long")
    with pytest.raises(ModelError, match="holds 8 classes but the model outputs 3"):
        estimator(model=lambda: nn.Linear(2, 3)).fit(df)
    model = estimator(model=lambda: nn.Linear(2, 3), on_invalid="skip", tracking=False, progress=False).fit(df)
    assert model.history[0]["steps"] > 0


def test_every_row_invalid_is_an_empty_data_error(spark) -> None:  # type: ignore[no-untyped-def]
    df = spark.createDataFrame([(float("nan"), 1.0, 1), (float("inf"), 2.0, 0)], "a double, b double, label long")
    with pytest.raises(EmptyDataError, match="every row of the DataFrame is invalid"):
        estimator(on_invalid="skip").fit(df)


def test_an_empty_partition_is_rebalanced_not_a_failing_rank(spark) -> None:  # type: ignore[no-untyped-def]
    rows = [(float(i), float(i % 3), i % 2) for i in range(20)]
    # two partitions, the second empty: kept as they are, rank 1 would have no rows
    df = spark.sparkContext.parallelize(rows, 1).toDF(["a", "b", "label"]).union(
        spark.createDataFrame([], "a double, b double, label long"))
    df = df.coalesce(2) if df.rdd.getNumPartitions() > 2 else df
    assert df.rdd.getNumPartitions() == 2 and min(len(p) for p in df.rdd.glom().collect()) == 0
    model = estimator(tracking=False, progress=False).fit(df)
    assert model.history[0]["steps"] > 0


@pytest.mark.parametrize("options", [
    {"lr": float("nan")}, {"timeout_s": float("nan")}, {"slot_wait_s": float("inf")}, {"grad_clip": float("nan")},
    {"weight_decay": float("nan")}, {"emulate_network": {"latency_ms": 1.0, "gbps": float("inf")}},
    {"early_stopping": {"metric": "val_loss", "min_delta": float("nan")}}])
def test_a_non_finite_option_is_refused_before_any_spark_job(spark, small_df, options) -> None:  # type: ignore[no-untyped-def]
    small_df.count()  # the frame's own jobs, if any, before counting
    jobs_before = spark.sparkContext._jsc.sc().dagScheduler().nextJobId()
    name = next(iter(options))
    with pytest.raises(ConfigError, match=rf"\.{name}(\.\w+)? must be a finite number"):
        estimator(**options).fit(small_df)
    assert spark.sparkContext._jsc.sc().dagScheduler().nextJobId() == jobs_before


def _next_job_id(spark) -> int:  # type: ignore[no-untyped-def]
    return spark.sparkContext._jsc.sc().dagScheduler().nextJobId()


def _noop(ctx) -> None:  # type: ignore[no-untyped-def]
    return None


@pytest.mark.parametrize("options", [
    {"timeout_s": float("nan")}, {"lr": float("inf")}, {"grad_clip": float("nan")}, {"slot_wait_s": float("inf")},
    {"peer_failure_delay_s": float("nan")}, {"outer_lr": float("inf")}])
def test_run_without_a_dataframe_refuses_a_non_finite_option_before_any_job(spark, options) -> None:  # type: ignore[no-untyped-def]
    # sparkdl.run without a DataFrame checked only two sections' own rules, not finiteness (issue 52):
    # timeout_s=nan reached rank 0 as "cannot convert float NaN to integer".
    jobs_before = _next_job_id(spark)
    name = next(iter(options))
    with pytest.raises(ConfigError, match=rf"(train|launch)\.{name} must be a finite number"):
        sparkdl.run(_noop, num_workers=2, **options)
    assert _next_job_id(spark) == jobs_before


@pytest.mark.parametrize("channel", ["0.0", "0", "::", "[::]", "0:0:0:0:0:0:0:0", "0x0", "::ffff:0.0.0.0"])
def test_every_spelling_of_the_unspecified_address_is_refused_as_channel(spark, small_df, channel) -> None:  # type: ignore[no-untyped-def]
    # "0.0" resolves to 0.0.0.0: the channel listened on every interface, executors dialled themselves.
    jobs_before = _next_job_id(spark)
    with pytest.raises(ConfigError, match=r"launch.channel=.* is a wildcard address") as info:
        sparkdl.run(_noop, num_workers=2, channel=channel)
    assert 'launch.channel="auto"' in str(info.value)  # the fix
    with pytest.raises(ConfigError, match=r"launch.channel=.* is a wildcard address"):
        estimator(channel=channel).fit(small_df)
    assert _next_job_id(spark) == jobs_before


@pytest.mark.parametrize("command", ["train", "plan"])
@pytest.mark.parametrize("override, option", [
    ('launch.channel="0.0"', "launch.channel"), ("launch.timeout_s=nan", "launch.timeout_s"),
    ("train.lr=inf", "train.lr"), ("launch.slot_wait_s=inf", "launch.slot_wait_s")])
def test_the_cli_refuses_the_same_options_before_any_job(spark, repo_root, tmp_path, capsys, command, override,  # type: ignore[no-untyped-def]
                                                         option) -> None:
    from sparkdl import cli

    data = tmp_path / "rows.parquet"
    spark.createDataFrame([(1.0, 0)], "p0 double, label long").write.parquet(str(data))
    jobs_before = _next_job_id(spark)
    rc = cli.main([command, "--conf", str(repo_root / "conf" / "examples" / "digits.toml"),
                   "--set", f"input.path={data}", "--set", override])
    assert rc == 2
    assert f"error: {option}" in capsys.readouterr().err
    assert _next_job_id(spark) == jobs_before


def test_a_training_error_masks_credentials_in_the_users_error(spark) -> None:  # type: ignore[no-untyped-def]
    # The MLflow copies of a failure were masked, the TrainingError's own text was not (issue 52).
    def train_fn(ctx):  # type: ignore[no-untyped-def]
        if ctx.rank == 1:
            raise OSError("cannot open s3://AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMI/K7MDENG@bucket/data "
                          "with token=ghp_abcdefghijklmnopqrstuvwxyz0123456789")
        ctx.comm.barrier()

    with pytest.raises(TrainingError) as info:
        sparkdl.run(train_fn, num_workers=2, timeout_s=30, peer_failure_delay_s=0.5)
    text = str(info.value)
    assert "rank 1: OSError: cannot open s3://" in text and "@bucket/data" in text
    for secret in ("wJalrXUtnFEMI", "K7MDENG", "AKIAIOSFODNN7EXAMPLE", "ghp_abcdefghij"):
        assert secret not in text and secret not in info.value.message


@pytest.mark.parametrize("options", [{"timeout_s": float("nan")}, {"slot_wait_s": float("inf")},
                                     {"channel": "0.0"}])
def test_the_compat_layer_refuses_the_same_options_before_any_job(spark, options) -> None:  # type: ignore[no-untyped-def]
    from sparkdl.compat import TorchDistributor

    jobs_before = _next_job_id(spark)
    with pytest.raises(ConfigError, match=rf"launch\.{next(iter(options))}"):
        TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, **options).run(_noop, None)
    assert _next_job_id(spark) == jobs_before
