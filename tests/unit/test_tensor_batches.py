"""The worker side of tensor columns without Spark: spool columns of every kind, batch assembly
with dtypes, shapes and transform_fn, the prefetch thread, weighted losses and the served model."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparkdl.config import DataConfig
from sparkdl.data.assemble import TensorAssembler, prefetched
from sparkdl.data.batches import Spool
from sparkdl.data.layout import BINARY, FIXED, RAGGED, FeedLayout, TensorColumn
from sparkdl.errors import ConfigError, ModelError
from sparkdl.model.losses import BuiltinLoss
from sparkdl.tracking.serving import ServedModel
from sparkdl.strategies.inputs import call_model, global_share, weighted_terms

N, L = 300, 6


def layout(keyword: bool = False, transformed: bool = False) -> FeedLayout:
    tokens = TensorColumn("tokens", "__sparkdl_in_0", FIXED, "int32", "int64", (2, 3), "tokens" if keyword else None)
    blob = TensorColumn("blob", "__sparkdl_in_1", BINARY, "", "", (), "blob" if keyword else None)
    ragged = TensorColumn("ragged", "__sparkdl_in_2", RAGGED, "float32", "", (), "ragged" if keyword else None)
    label = TensorColumn("y", "__sparkdl_label", FIXED, "int32", "int64", (L,))
    return FeedLayout(num_features=0, label_dtype="int64", inputs=(tokens, blob, ragged), keyword_inputs=keyword,
                      label=label, weight_column="__sparkdl_weight", transformed=transformed)


def record_batches(rows: int = N, batch: int = 70) -> list[pa.RecordBatch]:
    out = []
    for start in range(0, rows, batch):
        ids = np.arange(start, min(rows, start + batch))
        tokens = pa.array([list(range(i, i + L)) for i in ids], pa.list_(pa.int32()))
        blob = pa.array([int(i).to_bytes(4, "little") * (1 + i % 3) for i in ids], pa.binary())
        ragged = pa.array([[float(i)] * (1 + i % 4) for i in ids], pa.list_(pa.float32()))
        label = pa.array([[int(i) % 5] * L for i in ids], pa.list_(pa.int32()))
        weight = pa.array(ids.astype(np.float32) / rows)
        out.append(pa.record_batch([tokens, blob, ragged, label, weight],
                                   names=["__sparkdl_in_0", "__sparkdl_in_1", "__sparkdl_in_2", "__sparkdl_label",
                                          "__sparkdl_weight"]))
    return out


def decode(batch: dict) -> dict:
    ids = np.array([int.from_bytes(b[:4], "little") for b in batch["blob"]], np.int64)
    return {"tokens": batch["tokens"], "blob": ids.astype(np.float64),
            "ragged": np.array([len(r) for r in batch["ragged"]], np.float32)}


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 2000])  # one chunk, and many (binary straddles them)
@pytest.mark.parametrize("shuffle", [False, True])
def test_every_column_kind_survives_the_spool_paired_row_by_row(tmp_path: Path, chunk_bytes: int, shuffle: bool) -> None:
    with Spool.write(record_batches(), layout(transformed=True), tmp_path, chunk_bytes=chunk_bytes) as spool:
        assert spool.num_rows == N
        assemble = TensorAssembler(layout(transformed=True), decode)
        seen = []
        for inputs, label, weight in spool.batches(1, batch_size=32, steps=10, shuffle=shuffle, seed=3, rank=0,
                                                   drop_last=False, assemble=assemble):
            tokens, blob, ragged = inputs
            assert tokens.dtype == torch.int64 and tokens.shape[1:] == (2, 3)
            assert blob.dtype == torch.float32  # the transform's float64 becomes the model's float32
            ids = tokens[:, 0, 0]
            assert torch.equal(blob.long(), ids)  # bytes decoded for the same rows
            assert torch.equal(ragged.long(), ids % 4 + 1)
            assert torch.equal(label, (ids % 5).unsqueeze(1).expand(-1, L))
            torch.testing.assert_close(weight, ids.float() / N)
            seen += ids.tolist()
        assert assemble.transform_seconds > 0
    assert len(seen) == 10 * 32 and set(seen) <= set(range(N))
    assert (len(set(seen)) == N) if not shuffle else len(set(seen)) >= N - 20


def test_keyword_inputs_become_a_dict_and_input_dtypes_apply(tmp_path: Path) -> None:
    fixed_only = FeedLayout(num_features=0, label_dtype=None, keyword_inputs=True, inputs=(
        TensorColumn("tokens", "__sparkdl_in_0", FIXED, "int32", "bfloat16", (L,), "query"),))
    batch = pa.record_batch([pa.array([[1, 2, 3, 4, 5, 6]] * 4, pa.list_(pa.int32()))], names=["__sparkdl_in_0"])
    with Spool.write([batch], fixed_only, tmp_path) as spool:
        inputs, label, weight = next(spool.batches(0, batch_size=4, steps=1, shuffle=False, seed=0, rank=0,
                                                   drop_last=False))
    assert list(inputs) == ["query"] and inputs["query"].dtype == torch.bfloat16 and label is None and weight is None


def test_a_transform_fn_that_breaks_its_contract_is_named() -> None:
    spec = layout(transformed=True)
    from sparkdl.data.arrow_rows import incoming_arrays

    rows = incoming_arrays(record_batches(8)[0], spec)
    with pytest.raises(ModelError, match=r"returned no value for input column\(s\) \['ragged'\]"):
        TensorAssembler(spec, lambda b: {"tokens": b["tokens"], "blob": b["tokens"]})(rows)
    with pytest.raises(ModelError, match="returned 2 rows for input column 'blob', but the batch holds 8"):
        TensorAssembler(spec, lambda b: {**decode(b), "blob": np.zeros(2)})(rows)
    with pytest.raises(ModelError, match="transform_fn raised ZeroDivisionError"):
        TensorAssembler(spec, lambda b: 1 / 0)(rows)


def test_prefetch_keeps_order_hands_over_errors_and_stops_early() -> None:
    assert list(prefetched(iter(range(50)), 3)) == list(range(50))

    def failing():  # type: ignore[no-untyped-def]
        yield 1
        raise ValueError("bad batch")

    with pytest.raises(ValueError, match="bad batch"):
        list(prefetched(failing(), 2))
    produced = []

    def slow():  # type: ignore[no-untyped-def]
        for i in range(1000):
            produced.append(i)
            yield i

    first = prefetched(slow(), 2)
    assert next(first) == 0
    first.close()
    time.sleep(0.3)
    assert len(produced) < 10  # the thread stopped instead of decoding the rest


def test_cross_entropy_takes_per_position_logits_with_class_dim_last() -> None:
    logits, labels = torch.randn(3, 5, 7), torch.randint(0, 7, (3, 5))
    labels[0, 0] = -100
    loss = BuiltinLoss("cross_entropy")
    expected = F.cross_entropy(logits.reshape(-1, 7), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(loss(logits, labels), expected)
    weights = torch.tensor([1.0, 0.0, 2.0])
    numerator, denominator = weighted_terms(loss, logits, labels, weights)
    per_token = F.cross_entropy(logits.reshape(-1, 7), labels.reshape(-1), ignore_index=-100,
                                reduction="none").view(3, 5)
    counted = (labels != -100).float()
    torch.testing.assert_close(numerator, (per_token * weights[:, None]).sum())
    torch.testing.assert_close(denominator, (counted * weights[:, None]).sum())
    # A rank's share of the global weighted mean, averaged over 2 ranks, is that mean.
    total = denominator * 2
    torch.testing.assert_close((global_share(numerator, denominator, total, 2) * 2) / 2, numerator * 2 / total)


def test_a_callable_loss_taking_weight_gets_the_weights() -> None:
    def loss(output, label, weight=None):  # type: ignore[no-untyped-def]
        return (F.mse_loss(output.reshape(-1), label, reduction="none") * weight).mean()

    numerator, denominator = weighted_terms(loss, torch.ones(4, 1), torch.zeros(4), torch.tensor([1.0, 0, 0, 0]))
    assert float(numerator) == pytest.approx(0.25) and float(denominator) == 1.0


class KeywordNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 4)

    def forward(self, query: torch.Tensor) -> torch.Tensor:
        return self.linear(query.float())


def test_the_served_model_answers_from_user_columns() -> None:
    spec = FeedLayout(num_features=0, label_dtype="int64", keyword_inputs=True, inputs=(
        TensorColumn("q", "__sparkdl_in_0", FIXED, "float32", "float32", (3,), "query"),))
    torch.manual_seed(0)
    module = KeywordNet().eval()
    served = ServedModel(module, spec, "class")
    rows = [[0.1, 0.2, 0.3], [1.0, -1.0, 0.5]]
    answer = served.predict_columns({"q": rows})
    expected = call_model(module, {"query": torch.tensor(rows)})
    assert answer["prediction"] == expected.argmax(dim=1).tolist()
    np.testing.assert_allclose(answer["probabilities"], expected.softmax(dim=1).detach().numpy(), rtol=1e-5)


@pytest.mark.parametrize("options, message", [
    (dict(input_cols=["a"], feature_cols=("b",)), "feature_cols and data.input_cols are both set"),
    (dict(input_cols={"not a name": "a"}), "is not a Python argument name"),
    (dict(input_cols=["a", "a"]), "lists a column twice"),
    (dict(input_cols=["a"], label_col="a"), "label_col 'a' is also an input column"),
    (dict(input_cols=["a"], input_shapes={"b": [2]}), r"input_shapes names \['b'\]"),
    (dict(input_cols=["a"], input_shapes={"a": [-1, -1]}), "at most one -1"),
    (dict(input_cols=["a"], input_dtypes={"a": "complex64"}), "input_dtypes\\['a'\\] must be one of"),
    (dict(input_cols=["a"], transform_fn="decode"), "transform_fn must be a callable"),
    (dict(feature_cols=("a",), transform_fn=lambda b: b), "transform_fn applies to input_cols"),
    (dict(input_cols=["a"], label_shapes={"other": [3]}), "label_shapes names \\['other'\\]"),
])
def test_input_cols_options_are_checked_before_any_job(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DataConfig(**options).validate()


def test_layouts_round_trip_through_json() -> None:
    import json

    spec = layout(keyword=True, transformed=True)
    assert FeedLayout.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_a_sequential_hands_several_inputs_to_its_first_layer() -> None:
    from sparkdl.strategies.inputs import call_model, flat_inputs, input_spec, rebuilt_inputs

    class Pair(nn.Module):
        def forward(self, query: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
            return torch.cat([query, 2 * doc], dim=1)

    model = nn.Sequential(Pair(), nn.Flatten())
    q, d = torch.ones(3, 2), torch.zeros(3, 1, dtype=torch.int64)
    by_keyword = call_model(model, {"doc": d, "query": q})
    assert torch.equal(by_keyword, call_model(model, (q, d))) and by_keyword.shape == (3, 3)
    assert torch.equal(call_model(nn.Sequential(nn.Identity()), (q,)), q)  # one positional input: forward(x)
    for inputs in ({"query": q, "doc": d}, (q, d)):
        rebuilt = rebuilt_inputs(input_spec(inputs), flat_inputs(inputs))
        assert type(rebuilt) is type(inputs) and torch.equal(call_model(model, rebuilt), by_keyword)
    assert rebuilt_inputs(input_spec(q), flat_inputs(q)) is q
    assert input_spec({"query": q, "doc": d}) == (("query", (2,), "float32"), ("doc", (1,), "int64"))
