"""Validation metrics (sparkdl/model/metrics.py) against independent references (sklearn, torch) on the same
predictions, and exactness across ranks: partials summed and gathered parts concatenated over uneven
chunks give the value of the whole set."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import (accuracy_score, mean_absolute_error, mean_squared_error, roc_auc_score,
                             top_k_accuracy_score)

from sparkdl.errors import ConfigError
from sparkdl.model.metrics import GatheredMetric, batch_partials, build_metrics, metric_values, total_size

CUTS = (0, 7, 8, 40)  # three uneven "ranks" of a 40-row set: 7, 1 and 32 rows


def values(specs, output, label):
    metrics = build_metrics(specs)
    gathered = {m.name: [m.collect(output, label)] for m in metrics if isinstance(m, GatheredMetric)}
    return metric_values(metrics, batch_partials(metrics, output, label), gathered)


def split_values(specs, output, label, cuts=CUTS):
    """What the trainer computes: partials summed over chunks, gathered parts concatenated."""
    metrics = build_metrics(specs)
    totals = torch.zeros(total_size(metrics), dtype=torch.float64)
    gathered = {m.name: [] for m in metrics if isinstance(m, GatheredMetric)}
    for start, end in zip(cuts, cuts[1:]):
        totals += batch_partials(metrics, output[start:end], label[start:end])
        for m in metrics:
            if isinstance(m, GatheredMetric):
                gathered[m.name].append(m.collect(output[start:end], label[start:end]))
    return metric_values(metrics, totals, gathered)


@pytest.fixture
def classes():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(40, 6, generator=gen), torch.randint(0, 6, (40,), generator=gen)


def test_class_metrics_match_references(classes):
    output, label = classes
    got = values(["accuracy", "top_k_accuracy", "top_3_accuracy", "perplexity", "auc"], output, label)
    y, scores = label.numpy(), output.numpy()
    assert got["val_accuracy"] == pytest.approx(accuracy_score(y, scores.argmax(1)), abs=1e-12)
    assert got["val_top_k_accuracy"] == pytest.approx(top_k_accuracy_score(y, scores, k=5, labels=range(6)))
    assert got["val_top_3_accuracy"] == pytest.approx(top_k_accuracy_score(y, scores, k=3, labels=range(6)))
    assert got["val_perplexity"] == pytest.approx(math.exp(F.cross_entropy(output, label).item()), rel=1e-6)
    probs = torch.softmax(output.double(), 1).numpy()
    assert got["val_auc"] == pytest.approx(roc_auc_score(y, probs, multi_class="ovr", average="macro"), abs=1e-12)


def test_top_k_above_class_count_is_one():
    output, label = torch.randn(10, 3), torch.randint(0, 3, (10,))
    assert values(["top_k_accuracy"], output, label) == {"val_top_k_accuracy": 1.0}


@pytest.mark.parametrize("specs", [["accuracy", "top_2_accuracy", "perplexity", "auc"]])
def test_class_metrics_exact_across_ranks(classes, specs):
    output, label = classes
    label = label.clone()
    label[[1, 7, 20]] = -100
    whole, split = values(specs, output, label), split_values(specs, output, label)
    assert whole.keys() == split.keys() == {f"val_{s}" for s in specs}
    for key in whole:
        assert split[key] == pytest.approx(whole[key], abs=1e-9)
    metrics = build_metrics(specs)
    parts = [batch_partials(metrics, output[a:b], label[a:b]) for a, b in zip(CUTS, CUTS[1:])]
    assert torch.allclose(sum(parts), batch_partials(metrics, output, label), rtol=0, atol=1e-9)


def test_language_model_positions_ignore_minus_100():
    gen = torch.Generator().manual_seed(1)
    output, label = torch.randn(5, 8, 11, generator=gen), torch.randint(0, 11, (5, 8), generator=gen)
    label[:, :3] = -100
    label[2] = -100
    keep = label.reshape(-1) != -100
    flat_out, flat_y = output.reshape(-1, 11)[keep], label.reshape(-1)[keep]
    specs = ["accuracy", "top_3_accuracy", "perplexity"]
    got = values(specs, output, label)
    assert got["val_accuracy"] == pytest.approx(accuracy_score(flat_y, flat_out.argmax(1)), abs=1e-12)
    assert got["val_top_3_accuracy"] == pytest.approx(top_k_accuracy_score(flat_y, flat_out, k=3, labels=range(11)))
    reference = F.cross_entropy(output.reshape(-1, 11), label.reshape(-1), ignore_index=-100)
    assert got["val_perplexity"] == pytest.approx(math.exp(reference.item()), rel=1e-6)
    split = split_values(specs, output, label, cuts=(0, 1, 3, 5))
    for key in got:
        assert split[key] == pytest.approx(got[key], abs=1e-9)


def test_int32_labels_count_like_int64(classes):
    output, label = classes
    specs = ["accuracy", "top_2_accuracy", "perplexity", "auc"]
    assert values(specs, output, label.int()) == pytest.approx(values(specs, output, label), abs=1e-12)


def test_everything_ignored_gives_no_value():
    output, label = torch.randn(4, 3), torch.full((4,), -100)
    assert values(["accuracy", "perplexity", "auc"], output, label) == {}


@pytest.mark.parametrize("shape", [(40,), (40, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_binary_single_logit(shape, dtype):
    gen = torch.Generator().manual_seed(2)
    output, label = torch.randn(shape, generator=gen), torch.randint(0, 2, (40,), generator=gen).to(dtype)
    got = values(["accuracy", "auc"], output, label)
    scores = output.reshape(-1).numpy()
    assert got["val_accuracy"] == pytest.approx(accuracy_score(label.numpy() > 0.5, scores > 0), abs=1e-12)
    assert got["val_auc"] == pytest.approx(roc_auc_score(label.numpy(), scores), abs=1e-12)
    assert split_values(["accuracy", "auc"], output, label) == pytest.approx(got, abs=1e-9)


def test_two_class_logits_auc_is_binary():
    gen = torch.Generator().manual_seed(3)
    output, label = torch.randn(40, 2, generator=gen), torch.randint(0, 2, (40,), generator=gen)
    probs = torch.softmax(output.double(), 1)[:, 1].numpy()
    assert values(["auc"], output, label)["val_auc"] == pytest.approx(roc_auc_score(label.numpy(), probs), abs=1e-12)


def test_multi_label_accuracy_and_auc():
    gen = torch.Generator().manual_seed(4)
    output, label = torch.randn(40, 4, generator=gen), torch.randint(0, 2, (40, 4), generator=gen).float()
    got = values(["accuracy", "auc"], output, label)
    assert got["val_accuracy"] == pytest.approx(((output > 0) == (label > 0.5)).double().mean().item(), abs=1e-12)
    assert got["val_auc"] == pytest.approx(roc_auc_score(label.numpy(), output.numpy(), average="macro"), abs=1e-12)
    assert split_values(["accuracy", "auc"], output, label) == pytest.approx(got, abs=1e-9)


def test_auc_with_ties_matches_sklearn():
    gen = torch.Generator().manual_seed(5)
    output = torch.randint(-2, 3, (40,), generator=gen).float()  # five distinct scores: many ties
    label = torch.randint(0, 2, (40,), generator=gen).float()
    expected = roc_auc_score(label.numpy(), output.numpy())
    assert values(["auc"], output, label)["val_auc"] == pytest.approx(expected, abs=1e-12)
    assert split_values(["auc"], output, label)["val_auc"] == pytest.approx(expected, abs=1e-12)
    assert values(["auc"], torch.zeros(6), torch.tensor([0., 1, 0, 1, 1, 0]))["val_auc"] == 0.5


def test_auc_single_class_is_left_out():
    assert values(["auc", "accuracy"], torch.randn(8), torch.ones(8)).keys() == {"val_accuracy"}
    metric = build_metrics(["auc"])[0]
    assert metric.value_of([]) is None


def test_auc_multiclass_skips_classes_without_both_sides():
    output, label = torch.randn(30, 4), torch.randint(0, 3, (30,))  # class 3 never occurs
    probs = torch.softmax(output.double(), 1).numpy()
    expected = np.mean([roc_auc_score(label.numpy() == c, probs[:, c]) for c in range(3)])
    assert values(["auc"], output, label)["val_auc"] == pytest.approx(expected, abs=1e-12)


def test_regression_metrics():
    gen = torch.Generator().manual_seed(6)
    output, label = torch.randn(40, 1, generator=gen), torch.randn(40, generator=gen)
    got = values(["mae", "rmse"], output, label)
    o, y = output.reshape(-1).double().numpy(), label.double().numpy()
    assert got["val_mae"] == pytest.approx(mean_absolute_error(y, o), abs=1e-12)
    assert got["val_rmse"] == pytest.approx(math.sqrt(mean_squared_error(y, o)), abs=1e-12)
    assert split_values(["mae", "rmse"], output, label) == pytest.approx(got, abs=1e-9)


def test_bf16_outputs_are_widened(classes):
    output, label = classes
    low = output.to(torch.bfloat16).requires_grad_()
    specs = ["accuracy", "top_2_accuracy", "perplexity", "auc"]
    metrics = build_metrics(specs)
    partials = batch_partials(metrics, low, label)
    assert partials.dtype == torch.float64 and partials.device.type == "cpu" and not partials.requires_grad
    assert values(specs, low, label) == pytest.approx(values(specs, low.detach().float(), label), abs=1e-12)
    reg = torch.randn(40, dtype=torch.bfloat16)
    target = torch.randn(40)
    assert values(["mae"], reg, target) == pytest.approx(values(["mae"], reg.float(), target), abs=1e-12)


def test_callable_metric():
    def abs_error(output, label):
        return (output.reshape(-1).double() - label).abs().sum(), torch.tensor(label.numel())  # float64: exact sums

    def hits(output, label):
        return int((output.argmax(1) == 0).sum()), 0 if label.sum() < 0 else 3

    hits.metric_name = "first_class"
    output, label = torch.randn(40, 1), torch.randn(40)
    got = values([abs_error], output, label)
    assert got["val_abs_error"] == pytest.approx(mean_absolute_error(label.numpy(), output.reshape(-1).numpy()))
    assert split_values([abs_error], output, label) == pytest.approx(got, abs=1e-9)
    metrics = build_metrics([hits, "accuracy"])
    assert [m.name for m in metrics] == ["first_class", "accuracy"] and total_size(metrics) == 4
    assert values([hits], torch.randn(4, 3), -torch.ones(4)) == {}  # count 0: no value


def test_callable_must_return_pair():
    def bad(output, label):
        return 1.0

    with pytest.raises(ValueError, match="bad"):
        values([bad], torch.randn(4), torch.randn(4))


@pytest.mark.parametrize("spec,output,label,match", [
    ("top_k_accuracy", torch.randn(8), torch.randint(0, 2, (8,)).float(), "class logits"),
    ("perplexity", torch.randn(8, 1), torch.randn(8), "class logits"),
    ("perplexity", torch.randn(8, 3), torch.rand(8, 3), "class logits"),
    ("mae", torch.randn(8, 3), torch.randn(8), "shape"),
    ("accuracy", torch.randn(8, 3), torch.rand(8), "shape"),
    ("auc", torch.randn(8, 3), torch.rand(8), "shape"),
])
def test_shape_errors(spec, output, label, match):
    with pytest.raises(ValueError, match=match):
        values([spec], output, label)


@pytest.mark.parametrize("specs", [["acuracy"], ["top_0_accuracy"], ["accuracy", "accuracy"], [lambda o, y: (0, 1)],
                                   "accuracy"])
def test_bad_specs(specs):
    with pytest.raises(ConfigError):
        build_metrics(specs)


def test_totals_length_is_checked():
    metrics = build_metrics(["accuracy", "auc", "mae"])
    assert total_size(metrics) == 4
    with pytest.raises(ValueError, match="totals"):
        metric_values(metrics, torch.zeros(3, dtype=torch.float64), {})
