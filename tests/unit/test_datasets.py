"""sparkdl.datasets without Spark: the bundled digits and the deterministic split."""
from __future__ import annotations

import numpy as np
import pytest

from sparkdl.datasets import DIGITS_FEATURE_COLS, load_digits, train_test_split_digits
from sparkdl.errors import ConfigError


def test_load_digits_shapes_dtypes_and_ranges() -> None:
    features, labels = load_digits()
    assert features.shape == (1797, 64) and features.dtype == np.float32
    assert labels.shape == (1797,) and labels.dtype == np.int64
    assert features.min() == 0.0 and features.max() == 16.0
    assert np.array_equal(features, np.round(features)), "raw pixel counts are integers"
    assert set(np.unique(labels)) == set(range(10))
    counts = np.bincount(labels)
    assert counts.min() >= 170 and counts.max() <= 190, "about 180 images per digit"


def test_load_digits_matches_the_first_row_of_the_file() -> None:
    features, labels = load_digits()
    assert labels[0] == 0
    assert features[0, :8].tolist() == [0, 0, 5, 13, 9, 1, 0, 0]


def test_load_digits_returns_fresh_copies() -> None:
    features, labels = load_digits()
    features[0, 0] = 99.0
    labels[0] = 7
    again, again_labels = load_digits()
    assert again[0, 0] == 0.0 and again_labels[0] == 0


def test_feature_column_names() -> None:
    assert DIGITS_FEATURE_COLS == tuple(f"p{i}" for i in range(64))


def test_split_is_a_deterministic_partition() -> None:
    train, test = train_test_split_digits(seed=0, test_fraction=0.25)
    assert len(test) == round(1797 * 0.25) and len(train) + len(test) == 1797
    assert train.dtype.kind == "i" and test.dtype.kind == "i"
    assert np.array_equal(np.sort(np.concatenate([train, test])), np.arange(1797))
    again_train, again_test = train_test_split_digits(seed=0, test_fraction=0.25)
    assert np.array_equal(train, again_train) and np.array_equal(test, again_test)
    _, other_test = train_test_split_digits(seed=1, test_fraction=0.25)
    assert not np.array_equal(test, other_test)
    _, small_test = train_test_split_digits(seed=0, test_fraction=0.1)
    assert len(small_test) == round(1797 * 0.1)


@pytest.mark.parametrize("fraction", [0, 1, -0.5, 1.5, True, "0.25"])
def test_split_rejects_bad_fractions(fraction: object) -> None:
    with pytest.raises(ConfigError, match="test_fraction"):
        train_test_split_digits(test_fraction=fraction)  # type: ignore[arg-type]
