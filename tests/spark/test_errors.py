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

    with pytest.raises(TrainingError, match=r"rank 1: ValueError: boom from the user loop"):
        sparkdl.run(train_fn, df=small_df.select("a", "b", "label"), num_workers=2, timeout_s=30)


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


def test_a_stalled_rank_ends_in_an_error_within_the_timeout(small_df) -> None:  # type: ignore[no-untyped-def]
    def train_fn(ctx):  # type: ignore[no-untyped-def]
        import time as clock

        import torch

        if ctx.rank == 1:
            clock.sleep(90)  # stalled: never joins the collective
        ctx.comm.allreduce(torch.ones(2))

    started = time.monotonic()
    with pytest.raises(TrainingError, match="rank 0"):
        sparkdl.run(train_fn, df=small_df.select("a", "b", "label"), num_workers=2, timeout_s=5)
    assert time.monotonic() - started < 120
