"""datasets: small bundled data sets for demos, examples and tests (may import: errors only).

`digits.csv.gz` is the test set of the UCI Machine Learning Repository's "Optical Recognition of
Handwritten Digits" data set (E. Alpaydin and C. Kaynak, 1998), licensed CC BY 4.0 (attribution
required), copied unchanged from the file scikit-learn ships as
`sklearn/datasets/data/digits.csv.gz`. Each of its 1797 lines holds the 64 pixel counts of an 8x8
image (integers 0..16) followed by the digit (0..9).

Reading it needs numpy only; `digits_dataframe` additionally needs pyspark and pyarrow, which are
imported when it is called, so `import sparkdl.datasets` stays cheap.

Tensor columns (`images_text`): `digits_images_dataframe` (array<float> `pixels` and PNG `png` columns,
with `decode_digit_png` as a transform_fn), `synthetic_tokens_dataframe` and `text_tokens_dataframe`
(array<int> `tokens` / `targets` for language models; the text is this Python's own standard library).
"""
from __future__ import annotations

import gzip
from functools import lru_cache
from importlib import resources
from typing import TYPE_CHECKING

import numpy as np

from sparkdl.datasets.images_text import (
    decode_digit_png,
    digits_images_dataframe,
    synthetic_tokens_dataframe,
    text_tokens_dataframe,
)
from sparkdl.errors import ConfigError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["DIGITS_FEATURE_COLS", "load_digits", "digits_dataframe", "train_test_split_digits",
           "digits_images_dataframe", "decode_digit_png", "synthetic_tokens_dataframe", "text_tokens_dataframe"]

_DIGITS_FILE = "digits.csv.gz"
_NUM_PIXELS = 64
_PIXEL_MAX = 16.0
DIGITS_FEATURE_COLS: tuple[str, ...] = tuple(f"p{i}" for i in range(_NUM_PIXELS))


@lru_cache(maxsize=1)
def _read_digits() -> tuple[np.ndarray, np.ndarray]:
    with resources.files(__name__).joinpath(_DIGITS_FILE).open("rb") as raw, gzip.open(raw, "rt") as text:
        table = np.loadtxt(text, delimiter=",", dtype=np.float64, ndmin=2)
    if table.shape[1] != _NUM_PIXELS + 1:
        raise ValueError(f"{_DIGITS_FILE} has {table.shape[1]} columns per row, expected {_NUM_PIXELS + 1}")
    features = table[:, :_NUM_PIXELS].astype(np.float32)
    labels = table[:, _NUM_PIXELS].astype(np.int64)
    features.setflags(write=False)
    labels.setflags(write=False)
    return features, labels


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The 8x8 digits as `(features, labels)`: float32 of shape (1797, 64) holding raw pixel
    counts 0..16 (not scaled), and int64 labels 0..9 of shape (1797,). Fresh, writable copies."""
    features, labels = _read_digits()
    return features.copy(), labels.copy()


def train_test_split_digits(seed: int = 0, test_fraction: float = 0.25) -> tuple[np.ndarray, np.ndarray]:
    """Row indices `(train_idx, test_idx)` of a random split of the digits, sorted, disjoint and
    covering every row; the same seed always gives the same split."""
    if isinstance(test_fraction, bool) or not isinstance(test_fraction, (int, float)) \
            or not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"test_fraction must be a number strictly between 0 and 1, got {test_fraction!r}",
                          hint="for example test_fraction=0.25")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ConfigError(f"seed must be an integer, got {seed!r}")
    num_rows = len(_read_digits()[1])
    num_test = min(num_rows - 1, max(1, round(num_rows * test_fraction)))
    order = np.random.default_rng(int(seed)).permutation(num_rows)
    return np.sort(order[num_test:]), np.sort(order[:num_test])


def digits_dataframe(spark: "SparkSession", *, scale: bool = True,
                     indices: np.ndarray | None = None) -> "DataFrame":
    """The digits as a Spark DataFrame with double columns `p0`..`p63` (divided by 16, i.e. in
    [0, 1], when `scale`) and a long column `label`. `indices` (e.g. one half of
    `train_test_split_digits()`) keeps only those rows, in that order.

    Built from an Arrow table (`spark.createDataFrame(pyarrow.Table)`, PySpark >= 4.0): no pandas,
    no per-row Python objects. PySpark 3.5 gets a list of tuples (1797 rows: cheap).
    """
    import pyspark
    from pyspark.sql.types import DoubleType, LongType, StructField, StructType

    features, labels = _read_digits()
    if indices is not None:
        idx = np.asarray(indices)
        if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
            raise ConfigError(f"indices must be a 1-d array of integer row numbers, got dtype {idx.dtype} "
                              f"and shape {idx.shape}", hint="pass one of the arrays train_test_split_digits() returns")
        if idx.size and (idx.min() < 0 or idx.max() >= len(labels)):
            raise ConfigError(f"indices must lie in 0..{len(labels) - 1}, got values from {idx.min()} to {idx.max()}")
        features, labels = features[idx], labels[idx]
    pixels = features.astype(np.float64)
    if scale:
        pixels /= _PIXEL_MAX
    schema = StructType([StructField(name, DoubleType(), nullable=False) for name in DIGITS_FEATURE_COLS]
                        + [StructField("label", LongType(), nullable=False)])
    if int(pyspark.__version__.split(".")[0]) < 4:
        rows = [(*row, label) for row, label in zip(pixels.tolist(), labels.tolist())]
        return spark.createDataFrame(rows, schema=schema)
    import pyarrow as pa

    columns = [pa.array(pixels[:, i]) for i in range(_NUM_PIXELS)] + [pa.array(labels, type=pa.int64())]
    table = pa.Table.from_arrays(columns, names=[*DIGITS_FEATURE_COLS, "label"])
    return spark.createDataFrame(table, schema=schema)
