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


# --- tensor columns: PNG digits and token sequences (the array builders; DataFrames in tests/spark) ---

from pathlib import Path  # noqa: E402

from sparkdl.datasets import decode_digit_png  # noqa: E402
from sparkdl.datasets.images_text import (  # noqa: E402
    digit_pngs,
    stdlib_source_paths,
    synthetic_token_arrays,
    text_token_arrays,
)


def test_digit_pngs_round_trip_through_decode_digit_png() -> None:
    counts, _ = load_digits()
    pngs = digit_pngs(counts[:20])
    assert len(pngs) == 20 and all(p.startswith(b"\x89PNG\r\n\x1a\n") for p in pngs)
    decoded = decode_digit_png({"png": pngs})["png"]
    assert decoded.shape == (20, 1, 8, 8) and decoded.dtype == np.float32
    expected = np.round(counts[:20].reshape(20, 1, 8, 8) * 255 / 16) / 255
    np.testing.assert_allclose(decoded, expected, atol=1e-6)
    assert decoded.min() == 0.0 and decoded.max() == 1.0
    assert np.abs(decoded - counts[:20].reshape(20, 1, 8, 8) / 16).max() <= 0.5 / 255 + 1e-6


def test_digit_pngs_are_8x8_grayscale_and_deterministic() -> None:
    import io

    from PIL import Image

    counts, _ = load_digits()
    first = digit_pngs(counts[:3])
    image = Image.open(io.BytesIO(first[0]))
    assert image.size == (8, 8) and image.mode == "L"
    assert np.asarray(image)[0].tolist() == [0, 0, 80, 207, 143, 16, 0, 0]  # round([0,0,5,13,9,1,0,0]*255/16)
    assert digit_pngs(counts[:3]) == first


def test_decode_digit_png_keeps_other_keys_and_accepts_bytearrays() -> None:
    counts, _ = load_digits()
    pngs = digit_pngs(counts[:2])
    other = np.arange(2)
    out = decode_digit_png({"png": [bytearray(pngs[0]), memoryview(pngs[1])], "label": other})
    assert out["label"] is other and out["png"].shape == (2, 1, 8, 8)
    empty = decode_digit_png({"png": []})["png"]
    assert empty.shape == (0, 1, 8, 8) and empty.dtype == np.float32


def test_synthetic_tokens_follow_an_affine_rule_and_shift_by_one() -> None:
    tokens, targets = synthetic_token_arrays(rows=64, seq_len=16, vocab=32, seed=3)
    assert tokens.shape == targets.shape == (64, 16) and tokens.dtype == np.int32
    assert tokens.min() >= 0 and tokens.max() < 32
    assert np.array_equal(tokens[:, 1:], targets[:, :-1])
    rules = set()
    for row_tokens, row_targets in zip(tokens, targets):
        seq = np.concatenate([row_tokens, row_targets[-1:]]).astype(np.int64)
        matches = [(a, b) for a in range(32) for b in range(32)
                   if np.array_equal((a * seq[:-1] + b) % 32, seq[1:])]
        assert matches, "each row follows one x[t+1] = (a x[t] + b) mod vocab"
        rules.add(matches[0])
    assert 2 <= len(rules) <= 8, "a small set of rules, more than one"
    again = synthetic_token_arrays(rows=64, seq_len=16, vocab=32, seed=3)
    assert np.array_equal(again[0], tokens) and np.array_equal(again[1], targets)
    assert not np.array_equal(synthetic_token_arrays(rows=64, seq_len=16, vocab=32, seed=4)[0], tokens)


@pytest.mark.parametrize("kwargs", [{"rows": 0}, {"seq_len": 0}, {"vocab": 1}, {"rows": True}, {"seq_len": 2.5}])
def test_synthetic_tokens_reject_bad_sizes(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        synthetic_token_arrays(**kwargs)


def test_text_tokens_are_non_overlapping_byte_windows(tmp_path: Path) -> None:
    (tmp_path / "b.py").write_bytes(bytes(range(10)))
    (tmp_path / "a.py").write_bytes(b"\xff" * 7)
    paths = [tmp_path / "a.py", tmp_path / "b.py"]
    tokens, targets = text_token_arrays(seq_len=4, max_rows=10, paths=paths)
    stream = np.frombuffer(b"\xff" * 7 + bytes(range(10)), dtype=np.uint8).astype(np.int32)
    assert tokens.shape == (3, 4) and tokens.dtype == np.int32  # 17 bytes // 5
    assert np.array_equal(tokens, stream[:15].reshape(3, 5)[:, :4])
    assert np.array_equal(targets, stream[:15].reshape(3, 5)[:, 1:])
    capped, _ = text_token_arrays(seq_len=4, max_rows=2, paths=paths)
    assert np.array_equal(capped, tokens[:2])
    with pytest.raises(ConfigError, match="window"):
        text_token_arrays(seq_len=100, max_rows=1, paths=paths)


def test_stdlib_source_paths_are_sorted_python_files_without_site_packages(tmp_path: Path) -> None:
    for rel in ("z.py", "a/b.py", "a.py", "notes.txt", "site-packages/pkg.py", "a/__pycache__/b.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    assert [p.relative_to(tmp_path).as_posix() for p in stdlib_source_paths(tmp_path)] == ["a.py", "a/b.py", "z.py"]


def test_text_tokens_of_the_stdlib_are_deterministic_bytes() -> None:
    tokens, targets = text_token_arrays(seq_len=32, max_rows=64)
    assert tokens.shape == (64, 32) and tokens.min() >= 0 and tokens.max() < 256
    assert np.array_equal(tokens[:, 1:], targets[:, :-1])
    first = stdlib_source_paths()[0].read_bytes()
    assert bytes(tokens[0].astype(np.uint8)) == first[:32]
    again, _ = text_token_arrays(seq_len=32, max_rows=64)
    assert np.array_equal(again, tokens)
