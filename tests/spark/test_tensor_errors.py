"""Every driver-side error of input_cols runs: raised before any barrier job, naming the column and
the fix."""
from __future__ import annotations

import pytest
import torch
from pyspark.sql import functions as F
from torch import nn

from sparkdl import TorchEstimator
from sparkdl.errors import ArrayLengthError, ColumnTypeError, ConfigError, ModelError, NullValuesError

COMMON = dict(num_workers=2, tracking=False, progress=False, epochs=1, batch_size=8)


class Flat(nn.Module):
    def __init__(self, width: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.linear = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.float().reshape(x.shape[0], -1))


class PerPosition(nn.Module):
    """(B, T) int tokens -> (B, T, 3) logits."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed(x)


@pytest.fixture(scope="module")
def frame(spark):  # type: ignore[no-untyped-def]
    rows = [([float(i), 1.0, 2.0, 3.0], [i % 10, 1, 2, 3], i % 3, f"s{i}", [1.0] * (1 + i % 2), 1.0)
            for i in range(40)]
    return spark.createDataFrame(rows, "vec array<double>, ids array<int>, label long, text string, "
                                       "ragged array<double>, w double").cache()


def fit(df, model=Flat, **options):  # type: ignore[no-untyped-def]
    return TorchEstimator(model=model, **{**COMMON, **options}).fit(df)


def test_feature_cols_and_input_cols_together_are_refused() -> None:
    with pytest.raises(ConfigError, match="feature_cols and data.input_cols are both set"):
        TorchEstimator(model=Flat, feature_cols=["a"], input_cols=["vec"]).config.validate()


def test_a_string_column_without_transform_fn_names_the_column(frame) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ColumnTypeError, match=r"(?s)input column 'text' holds string.*transform_fn"):
        fit(frame, input_cols=["text"])


def test_an_unsupported_type_names_the_column(frame) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ColumnTypeError, match="input column 'm' has type map<string,int>"):
        fit(frame.withColumn("m", F.create_map(F.lit("a"), F.lit(1))), input_cols=["m"])


def test_nulls_inside_arrays_name_the_column(frame) -> None:  # type: ignore[no-untyped-def]
    bad = frame.withColumn("vec", F.when(F.col("label") == 1, F.array(F.lit(1.0), F.lit(None).cast("double"),
                                                                      F.lit(1.0), F.lit(1.0))).otherwise(F.col("vec")))
    with pytest.raises(NullValuesError, match="array column 'vec' has 13 row"):
        fit(bad, input_cols=["vec"])


def test_null_rows_name_the_column(frame) -> None:  # type: ignore[no-untyped-def]
    bad = frame.withColumn("vec", F.when(F.col("label") == 1, F.lit(None)).otherwise(F.col("vec")))
    with pytest.raises(NullValuesError, match="input column 'vec' has 13 null value"):
        fit(bad, input_cols=["vec"])


def test_arrays_of_unequal_length_need_transform_fn(frame) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ArrayLengthError, match=r"(?s)'ragged' holds arrays of different lengths \(from 1 to 2\).*transform_fn"):
        fit(frame, input_cols=["ragged"])


def test_input_shapes_whose_product_differs_give_both_numbers(frame) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ArrayLengthError, match=r"input_shapes\['vec'\]=\[3, 2\] holds 6 values per row, but column "
                                               r"'vec' holds 4"):
        fit(frame, input_cols=["vec"], input_shapes={"vec": [3, 2]})


def test_nan_in_a_float_input_is_an_error_or_skipped(frame, caplog) -> None:  # type: ignore[no-untyped-def]
    bad = frame.withColumn("vec", F.when(F.col("label") == 2, F.array(F.lit(float("nan")), F.lit(1.0), F.lit(1.0),
                                                                      F.lit(1.0))).otherwise(F.col("vec")))
    with pytest.raises(NullValuesError, match="(?s)input column 'vec' has 13 row.*NaN or infinite.*on_invalid='skip'"):
        fit(bad, input_cols=["vec"])
    import logging

    with caplog.at_level(logging.WARNING, logger="sparkdl"):
        fit(bad, input_cols=["vec"], on_invalid="skip")
    assert "dropped 13 of 40 rows" in caplog.text


def test_an_int_label_array_beyond_the_models_classes(frame) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ModelError, match="needs one logit per class.*'ids_label' holds 10 classes but the model outputs 3"):
        fit(frame.withColumn("ids_label", F.col("ids")), model=PerPosition, input_cols=["ids"], label_col="ids_label")


def test_negative_label_positions_other_than_ignore_index_are_refused(frame) -> None:  # type: ignore[no-untyped-def]
    bad = frame.withColumn("y", F.array(F.lit(-3), F.lit(0), F.lit(1), F.lit(2)))
    with pytest.raises(ColumnTypeError, match="'y' must hold class indices.*-100 marks positions to ignore"):
        fit(bad, model=PerPosition, input_cols=["ids"], label_col="y")


def test_a_model_that_cannot_take_the_inputs_names_them(frame) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ModelError, match=r"cannot take a batch of input_cols \['vec'\] \(vec: float32 \[4, 4\]"):
        fit(frame, model=lambda: Flat(width=5), input_cols=["vec"])


def test_a_loss_that_cannot_compare_output_and_label(frame) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ModelError, match=r"loss 'cross_entropy' cannot compare the model's output \(float32 \[4, 3\]\)"
                                         r" with label column 'y' \(int64 \[4, 4\]\)"):
        fit(frame.withColumn("y", F.array(F.lit(0), F.lit(1), F.lit(2), F.lit(0))), input_cols=["vec"], label_col="y")


def test_transform_fn_must_return_every_input(frame) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ModelError, match=r"transform_fn returned no value for input column\(s\) \['text'\]"):
        fit(frame, input_cols=["text"], transform_fn=lambda batch: {"other": batch["text"]})


def test_negative_weights_are_refused(frame) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ColumnTypeError, match="weight column 'w' has 1 negative"):
        fit(frame.withColumn("w", F.when(F.col("vec")[0] == 0.0, -1.0).otherwise(1.0)), input_cols=["vec"],
            weight_col="w")


def test_ist_refuses_tensor_columns(frame) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="strategy='ist' trains MLPs on one float feature vector"):
        fit(frame, model=lambda: nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 3)), input_cols=["vec"],
            strategy="ist")


# --- what each column type becomes (positive cases, one custom-loop job each) -----------------------

def test_every_column_type_becomes_its_tensor(spark) -> None:  # type: ignore[no-untyped-def]
    import sparkdl
    from pyspark.ml.functions import array_to_vector

    df = spark.createDataFrame(
        [(i, float(i), i % 2 == 0, [i, i + 1, i + 2, i + 3, i + 4, i + 5], [0.5] * 3, i % 3) for i in range(16)],
        "n int, x double, flag boolean, ids array<int>, v array<double>, label long")
    df = df.withColumn("dec", F.col("x").cast("decimal(8,2)")).withColumn("vec", array_to_vector("v"))

    def train_fn(ctx):  # type: ignore[no-untyped-def]
        inputs, label, weight = next(iter(ctx.batches(0)))
        return [(str(t.dtype).replace("torch.", ""), tuple(t.shape)) for t in inputs], str(label.dtype), weight

    got, label, weight = sparkdl.run(train_fn, df=df.withColumn("ids2", F.col("ids")),
                                     input_cols=["n", "x", "flag", "ids", "vec", "dec", "ids2"],
                                     input_shapes={"ids2": [2, -1]}, input_dtypes={"x": "bfloat16"},
                                     batch_size=4, progress=False)
    assert got == [("int64", (4,)), ("bfloat16", (4,)), ("bool", (4,)), ("int64", (4, 6)), ("float32", (4, 3)),
                   ("float32", (4,)), ("int64", (4, 2, 3))]
    assert label == "torch.int64" and weight is None


def _pad(batch: dict) -> dict:
    import numpy as np

    return {"ragged": np.stack([np.pad(r, (0, 2 - len(r))) for r in batch["ragged"]]).astype(np.float32),
            "text": np.array([[len(s), 1.0] for s in batch["text"]], np.float32)}


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, ragged: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.cat([ragged, text], dim=1))


def test_variable_length_arrays_and_strings_train_through_transform_fn(frame) -> None:  # type: ignore[no-untyped-def]
    model = fit(frame, model=TwoInputs, input_cols=["ragged", "text"], transform_fn=_pad, epochs=2)
    assert model.history[-1]["transform_seconds"] > 0
    rows = model.transform(frame.limit(5)).select("prediction").collect()
    assert all(r["prediction"] in (0, 1, 2) for r in rows)


class PerRowMatrix(nn.Module):
    """(B, 4) -> (B, 2, 3) regression outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).view(-1, 2, 3)


def test_multi_target_regression_writes_flat_arrays_with_their_shape(frame) -> None:  # type: ignore[no-untyped-def]
    targets = frame.withColumn("t", F.array(*[F.col("vec")[i % 4] * (i + 1) for i in range(6)]))
    model = fit(targets, model=PerRowMatrix, input_cols=["vec"], label_col="t", label_shapes=[2, 3], loss="mse",
                epochs=2)
    scored = model.transform(targets.limit(3))
    field = scored.schema["prediction"]
    assert field.dataType.simpleString() == "array<float>" and field.metadata["sparkdl.output_shape"] == [2, 3]
    assert all(len(r["prediction"]) == 6 for r in scored.collect())
