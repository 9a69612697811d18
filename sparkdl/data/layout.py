"""FeedLayout: how the prepared Arrow batches are laid out; shared by the driver and the workers.

Stdlib only, so both sides (and the picklable TrainSpec) can hold it without importing Spark.
"""
from __future__ import annotations

from dataclasses import dataclass

FEATURES_COLUMN = "__sparkdl_features"
LABEL_COLUMN = "__sparkdl_label"
SPLIT_COLUMN = "__sparkdl_split"  # 0: training row, 1: validation row


@dataclass(frozen=True)
class FeedLayout:
    """The prepared DataFrame has one `array<float>` features column of fixed width and, when
    training, one scalar label column (int64 for classification, float32 for regression)."""

    num_features: int
    label_dtype: str | None  # "int64", "float32" or None (no label: inference or custom loops)
    feature_column: str = FEATURES_COLUMN
    label_column: str = LABEL_COLUMN
    source_feature_cols: tuple[str, ...] = ()
    source_label_col: str | None = None
    num_classes: int | None = None  # classification only: max label + 1 seen on the driver
    split_column: str | None = None  # set when validation rows travel with the training rows
