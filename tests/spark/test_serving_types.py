"""`mlflow models serve` answers JSON for every Spark column type sparkdl trains on, as
TorchModel.transform scores the same rows (issue 52). Three models, one scoring server each (a
server takes seconds to start), together every input kind:
- a recommender (sparse_cols): int ids, string ids, an array<int> of ids with array<float> weights,
  a double and a float dense feature;
- feature_cols of every kind: double, float, int and boolean scalars, a Spark ML vector, an
  array<float>;
- input_cols through a transform_fn: a string, bytes, a fixed array<float>, an int scalar, an
  array<int> of varying length.
Each fit logs its model with no MLflow warning (the input example validates against the signature),
and the server answers bodies as JavaScript writes them too (2.0 as 2). Regression models, so the
answers compared are the model's continuous outputs, not rounded classes."""
from __future__ import annotations

import base64
import logging
import os
import warnings
from typing import Any, Iterator

import numpy as np
import pytest
import torch
from pyspark.ml.linalg import Vectors
from served_model import ScoringServer, scoring_server
from torch import nn

from sparkdl import TorchEstimator
from sparkdl.embeddings import DLRM, TableSpec

COMMON = dict(num_workers=2, epochs=1, batch_size=16, progress=False, loss="mse")


@pytest.fixture
def mlflow_warnings() -> Iterator[list[str]]:
    """Warnings MLflow logs (its loggers do not propagate to the root, so caplog misses them)."""
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logger = logging.getLogger("mlflow")
    logger.addHandler(handler)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)


def fitted(df: Any, mlflow_server: Any, logged: list[str], **options: Any) -> Any:
    """The fitted model, its MLflow model logged with no warning from MLflow (logged or warned)."""
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        model = TorchEstimator(tracking_uri=mlflow_server.uri, experiment="sparkdl-serving-types", **COMMON,
                               **options).fit(df)
    assert model.model_uri is not None, "the model was not logged"
    from_mlflow = [str(w.message) for w in warned if f"{os.sep}mlflow{os.sep}" in w.filename]
    assert not logged and not from_mlflow, (logged, from_mlflow)
    return model


def local_copy(model: Any, mlflow_server: Any, tmp_path: Any) -> tuple[str, dict[str, str]]:
    """(the logged model's files here, its signature's input types by column: "long", "Array(long)")."""
    import mlflow

    mlflow.set_tracking_uri(mlflow_server.uri)
    try:
        local = mlflow.artifacts.download_artifacts(model.model_uri, dst_path=str(tmp_path / "served"))
        inputs = mlflow.models.get_model_info(model.model_uri).signature.inputs
    finally:
        mlflow.set_tracking_uri(None)
    return local, {c.name: getattr(c.type, "name", None) or str(c.type) for c in inputs.inputs}


def json_value(value: Any) -> Any:
    """A Spark row's value as a JSON client holds it: vectors and arrays as lists, bytes base64."""
    if hasattr(value, "toArray"):
        return value.toArray().tolist()
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(bytes(value)).decode()
    return list(value) if isinstance(value, tuple) else value


def as_javascript(value: Any) -> Any:
    """Numbers as JavaScript's JSON.stringify (and Go's encoding/json) write them: 2.0 -> 2."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return [as_javascript(v) for v in value] if isinstance(value, list) else value


def assert_answers_as_transform(server: ScoringServer, model: Any, sample: Any, columns: list[str]) -> None:
    """dataframe_split, dataframe_records and JavaScript-style numbers all answer transform's values."""
    expected = [r["prediction"] for r in model.transform(sample).collect()]
    rows = [[json_value(r[c]) for c in columns] for r in sample.collect()]
    bodies = {"split": {"dataframe_split": {"columns": columns, "data": rows}},
              "records": {"dataframe_records": [dict(zip(columns, r)) for r in rows]},
              "javascript": {"dataframe_split": {"columns": columns, "data": as_javascript(rows)}}}
    for name, body in bodies.items():
        answers = [a["prediction"] for a in server.predictions(body)]
        assert answers == pytest.approx(expected, rel=1e-5, abs=1e-6), name


# -- a recommender: ids, strings, lists with weights ------------------------------------------------

RECOMMENDER_SCHEMA = "f0 double, f1 float, user int, item string, tags array<int>, tag_w array<float>, y double"
RECOMMENDER_INPUTS = ["f0", "f1", "user", "item", "tags", "tag_w"]


def recommender() -> nn.Module:
    tables = (TableSpec("users", 40, 4), TableSpec("items", 30, 4), TableSpec("tags", 20, 4))
    return DLRM(2, tables, bottom=[8, 4], top=[8], features={"user": "users", "item": "items", "tags": "tags"})


def click_rows(count: int, seed: int) -> list[tuple]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        tags = [int(t) for t in rng.integers(0, 20, size=int(rng.integers(0, 4)))]
        rows.append((float(rng.normal()), float(rng.normal()), int(rng.integers(0, 60)), f"item-{rng.integers(0, 50)}",
                     tags, [float(w) for w in rng.uniform(0.5, 2.0, size=len(tags))], float(rng.normal())))
    return rows


def test_a_recommender_serves_ids_strings_and_weighted_lists(spark, mlflow_server, mlflow_warnings,  # type: ignore[no-untyped-def]
                                                             tmp_path) -> None:
    df = spark.createDataFrame(click_rows(96, 0), RECOMMENDER_SCHEMA).repartition(2)
    sparse = {"user": {"table": "users", "num_rows": 40}, "item": {"table": "items", "num_rows": 30},
              "tags": {"num_rows": 20, "weights_col": "tag_w"}}
    model = fitted(df, mlflow_server, mlflow_warnings, model=recommender, feature_cols=["f0", "f1"],
                   sparse_cols=sparse, label_col="y", strategy="embeddings")
    local, types = local_copy(model, mlflow_server, tmp_path)
    assert types["user"] == "long" and types["f1"] == "double" and types["tags"] == "Array(long)" \
        and types["tag_w"] == "Array(Any)", types  # any JSON numbers; the pyfunc makes them float32
    # Whole weights (2.0, 3.0) and an empty list among the rows scored; ids beyond the tables hash.
    sample = spark.createDataFrame([(0.5, 1.0, 3, "item-7", [1, 2], [2.0, 3.0], 0.0),
                                    (-1.0, 0.25, 10**6, "unseen", [], [], 0.0),
                                    *click_rows(3, 1)], RECOMMENDER_SCHEMA)
    with scoring_server(local) as server:
        assert_answers_as_transform(server, model, sample, RECOMMENDER_INPUTS)
        status, answer = server.ask({"dataframe_split": {"columns": RECOMMENDER_INPUTS,
                                                         "data": [[0.0, 0.0, 1, "a", [1, 2], [1.0]]]}})
        assert status == 400 and "does not hold one weight per id" in answer.get("stack_trace", ""), answer


# -- feature_cols of every kind ----------------------------------------------------------------------

FEATURE_SCHEMA = "a double, b float, c int, d boolean, v vector, arr array<float>, y double"
FEATURE_INPUTS = ["a", "b", "c", "d", "v", "arr"]


def feature_rows(count: int, seed: int) -> list[tuple]:
    rng = np.random.default_rng(seed)
    return [(float(rng.normal()), float(rng.normal()), int(rng.integers(-5, 5)), bool(rng.integers(0, 2)),
             Vectors.dense(rng.normal(size=3).tolist()), rng.normal(size=2).tolist(), float(rng.normal()))
            for _ in range(count)]


def feature_net() -> nn.Module:
    return nn.Sequential(nn.Linear(9, 8), nn.Tanh(), nn.Linear(8, 1))  # 3 scalars + a boolean + 3 + 2


def test_feature_columns_of_every_kind_serve(spark, mlflow_server, mlflow_warnings, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import types as T

    schema = T.StructType([T.StructField("a", T.DoubleType()), T.StructField("b", T.FloatType()),
                           T.StructField("c", T.IntegerType()), T.StructField("d", T.BooleanType()),
                           T.StructField("v", VectorUDT()), T.StructField("arr", T.ArrayType(T.FloatType())),
                           T.StructField("y", T.DoubleType())])
    df = spark.createDataFrame(feature_rows(96, 0), schema).repartition(2)
    model = fitted(df, mlflow_server, mlflow_warnings, model=feature_net, feature_cols=FEATURE_INPUTS, label_col="y",
                   strategy="data_parallel")
    local, types = local_copy(model, mlflow_server, tmp_path)
    assert list(types) == FEATURE_INPUTS  # the user's columns, not one matrix
    sample = spark.createDataFrame([(2.0, 1.0, 3, True, Vectors.sparse(3, [1], [4.0]), [1.0, -2.0], 0.0),
                                    *feature_rows(3, 1)], schema)
    with scoring_server(local) as server:
        assert_answers_as_transform(server, model, sample, FEATURE_INPUTS)
        status, answer = server.ask({"dataframe_split": {"columns": FEATURE_INPUTS,
                                                         "data": [[1.0, 1.0, 1, True, [1.0, "x", 2.0], [1.0, 2.0]]]}})
        assert status == 400 and "input column 'v' holds list values" in answer.get("stack_trace", ""), answer


# -- input_cols: strings, bytes, fixed arrays, int scalars, ragged arrays ----------------------------

MIXED_SCHEMA = "text string, raw binary, x array<float>, n int, tags array<int>, y double"
MIXED_INPUTS = ["text", "raw", "x", "n", "tags"]


def encode(batch: dict) -> dict:
    """Strings, bytes and ragged ids into fixed float features (what the model's first layer takes)."""
    return {"text": np.array([[len(s), sum(map(ord, s)) % 97 / 97] for s in batch["text"]], np.float32),
            "raw": np.array([[len(b), (b[0] if b else 0) / 255] for b in batch["raw"]], np.float32),
            "x": batch["x"], "n": np.asarray(batch["n"], np.float32).reshape(-1, 1),
            "tags": np.array([[len(t), float(np.sum(t))] for t in batch["tags"]], np.float32)}


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(10, 1)

    def forward(self, text: torch.Tensor, raw: torch.Tensor, x: torch.Tensor, n: torch.Tensor,
                tags: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([text, raw, x, n, tags], dim=1))


def mixed_rows(count: int, seed: int) -> list[tuple]:
    rng = np.random.default_rng(seed)
    words = ["good", "bad plot", "a fine film", "meh", ""]
    return [(str(words[int(rng.integers(0, 5))]), bytes(rng.integers(0, 256, size=int(rng.integers(0, 4))).tolist()),
             rng.normal(size=3).tolist(), int(rng.integers(0, 9)),
             [int(t) for t in rng.integers(0, 50, size=int(rng.integers(0, 4)))], float(rng.normal()))
            for _ in range(count)]


def test_strings_bytes_and_arrays_through_a_transform_fn_serve(spark, mlflow_server, mlflow_warnings,  # type: ignore[no-untyped-def]
                                                              tmp_path) -> None:
    df = spark.createDataFrame(mixed_rows(96, 0), MIXED_SCHEMA).repartition(2)
    model = fitted(df, mlflow_server, mlflow_warnings, model=Mixed, input_cols=MIXED_INPUTS, transform_fn=encode,
                   label_col="y", strategy="data_parallel")
    local, types = local_copy(model, mlflow_server, tmp_path)
    assert types["n"] == "long" and types["text"] == "string" and types["raw"] == "binary", types
    sample = spark.createDataFrame([("a fine film", b"\x01\x02", [1.0, 2.0, 3.0], 4, [7, 8], 0.0),
                                    *mixed_rows(3, 1)], MIXED_SCHEMA)
    with scoring_server(local) as server:
        assert_answers_as_transform(server, model, sample, MIXED_INPUTS)
        status, answer = server.ask({"dataframe_split": {"columns": MIXED_INPUTS,
                                                         "data": [["x", "AQI=", [1.0, 2.0], 1, []]]}})
        assert status == 400 and "column 'x' holds 2 values per row, but the model was trained on 3" \
            in answer.get("stack_trace", ""), answer
