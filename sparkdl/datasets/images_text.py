"""Tensor-column data sets: the digits as arrays and PNG images, and token sequences for language models.

- `digits_images_dataframe`: the bundled digits with an array<float> column `pixels` (64 values, row-major
  8x8, divided by 16) and a binary column `png` (the same image as an 8x8 8-bit grayscale PNG), for
  `input_shapes={"pixels": [1, 8, 8]}` or `transform_fn=decode_digit_png`.
- `synthetic_tokens_dataframe`: sequences of a tiny learnable language (affine recurrences mod vocab).
- `text_tokens_dataframe`: byte-level windows (vocab 256) of this Python's own standard library sources.

The array builders (`digit_pngs`, `synthetic_token_arrays`, `text_token_arrays`) need numpy only (PIL for
the PNGs, imported when called); the DataFrame builders also need pyspark and pyarrow, imported when called.
"""
from __future__ import annotations

import io
import os
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import numpy as np

from sparkdl.errors import ConfigError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["digits_images_dataframe", "decode_digit_png", "digit_pngs", "synthetic_tokens_dataframe",
           "synthetic_token_arrays", "text_tokens_dataframe", "text_token_arrays", "stdlib_source_paths"]

_PIXEL_MAX = 16.0
_SIDE = 8
# (a, b) of x[t+1] = (a * x[t] + b) mod vocab: a few "grammars"; odd a keeps the map a bijection mod 2^k.
_AFFINE_RULES: tuple[tuple[int, int], ...] = ((1, 1), (1, 3), (3, 1), (5, 2), (7, 5), (1, 7))
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def _positive_int(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def digit_pngs(counts: np.ndarray) -> list[bytes]:
    """One 8x8 8-bit grayscale PNG per row of `counts` (N, 64) raw pixel counts 0..16, row-major;
    pixel value = round(count * 255 / 16). Encoded with PIL."""
    from PIL import Image

    grid = np.asarray(counts, dtype=np.float64).reshape(-1, _SIDE, _SIDE)
    values = np.clip(np.rint(grid * 255.0 / _PIXEL_MAX), 0, 255).astype(np.uint8)
    out = []
    for image in values:
        buffer = io.BytesIO()
        Image.fromarray(image, mode="L").save(buffer, format="PNG")
        out.append(buffer.getvalue())
    return out


def decode_digit_png(batch: Mapping[str, Any]) -> dict[str, Any]:
    """A `transform_fn`: `batch["png"]` (a list of PNG bytes) -> `{"png": float32 (B, 1, H, W) in [0, 1]}`
    (grayscale, /255); the other keys of `batch` pass through unchanged."""
    from PIL import Image

    images = [np.asarray(Image.open(io.BytesIO(bytes(data))).convert("L"), dtype=np.float32)
              for data in batch["png"]]
    if images:
        decoded = np.stack(images)[:, None, :, :] / np.float32(255.0)
    else:
        decoded = np.zeros((0, 1, _SIDE, _SIDE), dtype=np.float32)
    return {**batch, "png": decoded.astype(np.float32, copy=False)}


def _select_rows(indices: np.ndarray | None, num_rows: int) -> np.ndarray:
    if indices is None:
        return np.arange(num_rows)
    idx = np.asarray(indices)
    if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
        raise ConfigError(f"indices must be a 1-d array of integer row numbers, got dtype {idx.dtype} "
                          f"and shape {idx.shape}", hint="pass one of the arrays train_test_split_digits() returns")
    if idx.size and (idx.min() < 0 or idx.max() >= num_rows):
        raise ConfigError(f"indices must lie in 0..{num_rows - 1}, got values from {idx.min()} to {idx.max()}")
    return idx


def _list_array(values: np.ndarray, value_type: Any) -> Any:
    import pyarrow as pa

    rows, width = values.shape
    offsets = pa.array(np.arange(0, (rows + 1) * width, width, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(values.reshape(-1), type=value_type))


def _dataframe(spark: "SparkSession", columns: dict[str, Any], schema: Any) -> "DataFrame":
    """A DataFrame from numpy/bytes columns via an Arrow table (PySpark >= 4), tuples on PySpark 3.5."""
    import pyspark

    if int(pyspark.__version__.split(".")[0]) < 4:
        lists = [c.tolist() if isinstance(c, np.ndarray) else list(c) for c in columns.values()]
        return spark.createDataFrame(list(zip(*lists)), schema=schema)
    import pyarrow as pa

    arrays = []
    for value in columns.values():
        if isinstance(value, np.ndarray) and value.ndim == 2:
            arrays.append(_list_array(value, pa.from_numpy_dtype(value.dtype)))
        elif isinstance(value, np.ndarray):
            arrays.append(pa.array(value))
        else:
            arrays.append(pa.array(value, type=pa.binary()))
    return spark.createDataFrame(pa.Table.from_arrays(arrays, names=list(columns)), schema=schema)


def digits_images_dataframe(spark: "SparkSession", *, indices: np.ndarray | None = None) -> "DataFrame":
    """The digits with `pixels` array<float> (64 values, counts / 16, row-major 8x8), `png` binary (8x8
    grayscale PNG, value round(count * 255 / 16)) and `label` long. `indices` (e.g. one half of
    `train_test_split_digits()`) keeps only those rows, in that order."""
    from pyspark.sql.types import ArrayType, BinaryType, FloatType, LongType, StructField, StructType

    from sparkdl.datasets import load_digits

    counts, labels = load_digits()
    idx = _select_rows(indices, len(labels))
    counts, labels = counts[idx], labels[idx]
    schema = StructType([StructField("pixels", ArrayType(FloatType(), containsNull=False), nullable=False),
                         StructField("png", BinaryType(), nullable=False),
                         StructField("label", LongType(), nullable=False)])
    pixels = (counts / np.float32(_PIXEL_MAX)).astype(np.float32)
    return _dataframe(spark, {"pixels": pixels, "png": digit_pngs(counts), "label": labels.astype(np.int64)}, schema)


def synthetic_token_arrays(rows: int = 2048, seq_len: int = 32, vocab: int = 32,
                           seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """`(tokens, targets)`, int32 (rows, seq_len): each row follows x[t+1] = (a * x[t] + b) mod vocab from
    a random start, with (a, b) drawn per row from a small fixed set; targets are tokens shifted left by
    one (the last target is the sequence's next token). Deterministic in `seed`."""
    rows, seq_len = _positive_int("rows", rows), _positive_int("seq_len", seq_len)
    vocab = _positive_int("vocab", vocab, minimum=2)
    rng = np.random.default_rng(int(seed))
    rules = np.array(_AFFINE_RULES, dtype=np.int64)[rng.integers(0, len(_AFFINE_RULES), size=rows)]
    seq = np.empty((rows, seq_len + 1), dtype=np.int64)
    seq[:, 0] = rng.integers(0, vocab, size=rows)
    for t in range(seq_len):
        seq[:, t + 1] = (rules[:, 0] * seq[:, t] + rules[:, 1]) % vocab
    seq = seq.astype(np.int32)
    return np.ascontiguousarray(seq[:, :-1]), np.ascontiguousarray(seq[:, 1:])


def stdlib_source_paths(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """The `.py` files under the standard library (`sysconfig.get_paths()["stdlib"]` unless `root`),
    sorted by their path relative to it; installed packages (site-packages) and caches left out."""
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    found = []
    for directory, dirs, files in os.walk(base):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        found += [Path(directory, f).relative_to(base) for f in files if f.endswith(".py")]
    return [base / p for p in sorted(found, key=lambda p: p.as_posix())]


def _byte_stream(paths: Iterable[Path], limit: int) -> bytes:
    chunks, total = [], 0
    for path in paths:
        if total >= limit:
            break
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
    return b"".join(chunks)[:limit]


def text_token_arrays(seq_len: int = 64, max_rows: int = 4096,
                      paths: Iterable[Path] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`(tokens, targets)`, int32 (rows, seq_len), byte values 0..255: the bytes of `paths` (default
    `stdlib_source_paths()`) concatenated in order and cut into non-overlapping windows of seq_len + 1;
    tokens are a window's first seq_len bytes, targets its last seq_len. At most `max_rows` windows."""
    seq_len, max_rows = _positive_int("seq_len", seq_len), _positive_int("max_rows", max_rows)
    window = seq_len + 1
    data = _byte_stream(stdlib_source_paths() if paths is None else paths, window * max_rows)
    rows = len(data) // window
    if rows == 0:
        raise ConfigError(f"the text holds {len(data)} bytes, fewer than one window of {window}",
                          hint="pass a smaller seq_len")
    windows = np.frombuffer(data, dtype=np.uint8, count=rows * window).reshape(rows, window).astype(np.int32)
    return np.ascontiguousarray(windows[:, :-1]), np.ascontiguousarray(windows[:, 1:])


def _tokens_dataframe(spark: "SparkSession", tokens: np.ndarray, targets: np.ndarray) -> "DataFrame":
    from pyspark.sql.types import ArrayType, IntegerType, StructField, StructType

    schema = StructType([StructField(name, ArrayType(IntegerType(), containsNull=False), nullable=False)
                         for name in ("tokens", "targets")])
    return _dataframe(spark, {"tokens": tokens, "targets": targets}, schema)


def synthetic_tokens_dataframe(spark: "SparkSession", *, rows: int = 2048, seq_len: int = 32, vocab: int = 32,
                               seed: int = 0) -> "DataFrame":
    """`tokens` and `targets` array<int> columns of `synthetic_token_arrays` (a causal model reaches a loss
    far below log(vocab))."""
    return _tokens_dataframe(spark, *synthetic_token_arrays(rows, seq_len, vocab, seed))


def text_tokens_dataframe(spark: "SparkSession", *, seq_len: int = 64, max_rows: int = 4096,
                          seed: int | None = 0) -> "DataFrame":
    """`tokens` and `targets` array<int> columns of `text_token_arrays` (vocab 256), the windows in an
    order shuffled by `seed` (None: corpus order), so that any split of the rows mixes files."""
    tokens, targets = text_token_arrays(seq_len, max_rows)
    if seed is not None:
        order = np.random.default_rng(int(seed)).permutation(len(tokens))
        tokens, targets = tokens[order], targets[order]
    return _tokens_dataframe(spark, tokens, targets)
