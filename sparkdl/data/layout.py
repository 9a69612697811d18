"""FeedLayout: how the prepared Arrow batches are laid out; shared by the driver and the workers.

Stdlib only, so both sides (and the picklable TrainSpec) can hold it without importing Spark.

Two layouts exist. `feature_cols` (the MLP path): one `array<float>` features column of fixed width
and one scalar label. `input_cols` (tensor columns): one prepared column per model input, each a
`TensorColumn` saying how its rows become one tensor with the batch as dim 0, plus an optional label
tensor column and a per-row weight.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

FEATURES_COLUMN = "__sparkdl_features"
LABEL_COLUMN = "__sparkdl_label"
WEIGHT_COLUMN = "__sparkdl_weight"
SPLIT_COLUMN = "__sparkdl_split"  # 0: training row, 1: validation row
INPUT_PREFIX = "__sparkdl_in_"
DENSE_SOURCE = "__sparkdl_dense"  # sparse_cols runs: the source name of the dense features' column

# How a column's rows are stored: "fixed" (a number or a fixed-length array per row: one contiguous
# block), "binary" (bytes per row), "ragged" (arrays of varying length) or "text" (a string per row).
# Only "fixed" becomes a tensor by itself; the others need transform_fn.
FIXED, BINARY, RAGGED, TEXT = "fixed", "binary", "ragged", "text"



@dataclass(frozen=True)
class TensorColumn:
    """One prepared column and the tensor its rows become: `(B, *shape)` of `dtype`."""

    source: str  # the user's DataFrame column
    column: str  # its name in the prepared DataFrame and the spool
    kind: str  # FIXED, BINARY, RAGGED or TEXT
    storage: str  # element type as delivered and spooled ("int32", "float32", "bool", ...); "" for bytes/text
    dtype: str  # torch dtype of the batch tensor (one of TORCH_DTYPES)
    shape: tuple[int, ...] = ()  # per row: () for a scalar column, (L,) or input_shapes[col] for arrays
    key: str | None = None  # the forward() keyword when input_cols is a dict; None: positional

    @property
    def width(self) -> int:
        """Values per row in the spool (fixed columns)."""
        return math.prod(self.shape) if self.shape else 1

    @property
    def scalar(self) -> bool:
        return self.kind == FIXED and not self.shape


@dataclass(frozen=True)
class SparseFeature:
    """One categorical input (data.sparse_cols) as the prepared rows hold it: its table rows (int64,
    one per row, or a RAGGED list for multi-hot) and, where weighted, one float per id. The driver
    maps the user's ids to rows in Spark SQL (data/sparse_inputs.py); scoring from pandas maps them
    the same way in numpy (data/sparse_hash.py), hence the source's id kind and the range rule."""

    source: str  # the user's categorical column; the batch's {source: Bag} key
    table: str  # the embedding table its ids are rows of
    num_rows: int
    id_kind: str  # "integer" or "string": what the source column holds
    multi_hot: bool
    out_of_range: str = "hash"
    source_weights: str | None = None  # the user's weights column (multi-hot only)
    dim: int | None = None  # the table's width as sparse_cols declares it (None: the model's)


@dataclass(frozen=True)
class FeedLayout:
    """The prepared DataFrame's columns. `feature_cols` runs: one `array<float>` features column of
    `num_features` values and, when training, one scalar label column (int64 for classification,
    float32 for regression). `input_cols` runs: `inputs`, `label` and `weight_column` instead."""

    num_features: int
    label_dtype: str | None  # "int64", "float32" or None (no label: inference or custom loops)
    feature_column: str = FEATURES_COLUMN
    label_column: str = LABEL_COLUMN
    source_feature_cols: tuple[str, ...] = ()
    source_label_col: str | None = None
    num_classes: int | None = None  # classification only: max label + 1 seen on the driver
    split_column: str | None = None  # set when validation rows travel with the training rows
    inputs: tuple[TensorColumn, ...] = ()  # input_cols runs: one per model input, in forward() order
    keyword_inputs: bool = False  # input_cols was a dict: inputs are passed as forward(**{key: tensor})
    label: TensorColumn | None = None  # input_cols runs: the label tensor (scalar or per-position)
    weight_column: str | None = None  # prepared float32 per-row weight column (weight_col)
    source_weight_col: str | None = None
    transformed: bool = False  # transform_fn builds the model inputs from the columns on the executors
    label_ignores: bool = False  # per-position labels hold -100 somewhere: losses count positions exactly
    label_keyword: str | None = None  # loss="model": the label also goes to forward() under this keyword
    # sparse_cols runs: `inputs` are the dense features (one FIXED float32 column of num_features
    # values, absent when num_features is 0), then per feature its ids column (source = the feature's
    # column) and, when weighted, its weights column (RAGGED float32); batches are (dense, {source: Bag}).
    sparse: tuple[SparseFeature, ...] = ()

    @property
    def tensor_inputs(self) -> bool:
        """An input_cols layout (tensors per column) rather than one concatenated feature vector."""
        return bool(self.inputs)

    @property
    def source_input_cols(self) -> tuple[str, ...]:
        if self.sparse:
            return self.source_feature_cols + tuple(
                c for f in self.sparse for c in (f.source, f.source_weights) if c is not None)
        return tuple(c.source for c in self.inputs) if self.inputs else self.source_feature_cols

    @property
    def dense_inputs(self) -> tuple[TensorColumn, ...]:
        """sparse_cols runs: the dense features' column (none without feature_cols)."""
        return self.inputs[:1] if self.sparse and self.num_features else ()

    def for_scoring(self) -> "FeedLayout":
        """This layout without label, weight and split: what scoring (transform, MLflow) receives."""
        return replace(self, label=None, weight_column=None, label_dtype=None, split_column=None, label_keyword=None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "FeedLayout":
        """The inverse of to_dict (JSON lists become tuples again); keys of older saves are optional."""
        values = dict(data)
        values["source_feature_cols"] = tuple(values.get("source_feature_cols", ()))
        values["inputs"] = tuple(_column(c) for c in values.get("inputs", ()))
        if values.get("label") is not None:
            values["label"] = _column(values["label"])
        values["sparse"] = tuple(SparseFeature(**f) for f in values.get("sparse", ()))
        return cls(**values)


def _column(data: dict[str, Any]) -> TensorColumn:
    return TensorColumn(**{**data, "shape": tuple(data.get("shape", ()))})
