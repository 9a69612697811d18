"""A trained model as it scores: the module with the input layout, transform_fn and output kind it
was trained with, turning input columns into predictions. One object behind TorchModel.transform's
executors, the MLflow pyfunc model (`mlflow.pyfunc.load_model(uri).predict(frame)` and
`mlflow models serve`) and save/load, so that all three answer alike.

No pyspark and no mlflow at import: executors and scoring servers load it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NoReturn

import numpy as np
import pyarrow as pa

from sparkdl.data.arrow_rows import slice_rows
from sparkdl.data.layout import BINARY, FIXED, RAGGED, TEXT, FeedLayout, SparseFeature

if TYPE_CHECKING:
    import torch

PROBABILITIES = "probabilities"


@dataclass
class ServedModel:
    module: "torch.nn.Module | None"  # in eval mode; None in a saved skeleton (the weights travel apart)
    layout: FeedLayout
    output_kind: str
    transform_fn: Callable[[dict], dict] | None = None
    explicit_dtypes: frozenset[str] = frozenset()
    output_shape: tuple[int, ...] = ()  # per row, of the model's output (input_cols runs)
    prediction_col: str = "prediction"
    generation: Any = None  # output_kind "text": model/generation.Generation (max_new_tokens, sampling, seed)

    def __post_init__(self) -> None:
        scoring = getattr(self.transform_fn, "for_scoring", None)
        if scoring is not None:  # a tokenizer packing texts for training scores one output per row
            self.transform_fn = scoring()

    @property
    def input_layout(self) -> FeedLayout:
        return self.layout.for_scoring()

    def scores(self, arrays: tuple, device: Any = "cpu", batch_size: int = 1024) -> Any:
        """The model's output over one block of input rows (spool-like arrays), in chunks of batch_size."""
        import torch

        from sparkdl.data.assemble import assembler
        from sparkdl.model.calling import output_of
        from sparkdl.strategies.inputs import to_device

        layout = self.input_layout
        rows = len(arrays[0]) if arrays else 0
        assemble = assembler(layout, self.transform_fn, self.explicit_dtypes)
        outputs: list[Any] = []
        with torch.inference_mode():
            for index, start in enumerate(range(0, rows, batch_size)):
                chunk = tuple(slice_rows(a, start, min(rows, start + batch_size)) for a in arrays)
                inputs = to_device(assemble(chunk)[0], device)
                if self.output_kind == "text":
                    outputs.extend(self._generated(inputs, index))
                elif self.output_kind == "embedding":
                    from sparkdl.model.generation import pooled_embeddings

                    outputs.append(pooled_embeddings(self.module, inputs).detach().cpu())
                else:
                    outputs.append(output_of(self.module, inputs).detach().float().cpu())
        if self.output_kind == "text":
            return outputs
        return torch.cat(outputs) if outputs else None

    def _generated(self, inputs: Any, batch_index: int) -> list[str]:
        """output_kind "text": each row's prompt continued, decoded with the run's tokenizer."""
        from sparkdl.errors import ConfigError
        from sparkdl.model.generation import Generation, generate_ids

        tokenize = self.transform_fn
        if not hasattr(tokenize, "loaded") or not isinstance(inputs, dict):
            raise ConfigError("text output needs the model trained with data.tokenizer (it decodes the new tokens)",
                              hint="fit with tokenizer=..., or transform with the model's default output")
        new = generate_ids(self.module, inputs, self.generation or Generation(), tokenize.pad_id(), tokenize.eos_id(),
                           batch_index)
        tokenizer = tokenize.loaded()
        return [tokenizer.decode(ids, skip_special_tokens=True) for ids in new]

    def predict_columns(self, columns: dict[str, Any]) -> dict[str, Any]:
        """{input column: values} (numpy arrays, lists of arrays/bytes, pandas Series) -> the
        prediction (as transform writes it) and, for classes, the probabilities beside it."""
        if _rows(columns) == 0:
            return {self.prediction_col: []}
        out = self.scores(arrays_from_columns(self.input_layout, columns))
        if out is None:
            return {self.prediction_col: []}
        result: dict[str, Any] = {self.prediction_col: python_predictions(out, self.output_kind)}
        if self.output_kind in ("class", "classes"):
            result[PROBABILITIES] = out.softmax(dim=-1).reshape(out.shape[0], -1).numpy().tolist() \
                if self.output_kind == "classes" else out.softmax(dim=-1).numpy().tolist()
        elif self.output_kind == "binary":
            result[PROBABILITIES] = out.reshape(-1).sigmoid().numpy().tolist()
        return result


def _rows(columns: Any) -> int:
    if isinstance(columns, np.ndarray) or hasattr(columns, "shape"):
        return int(columns.shape[0])
    values = next(iter(columns.values()), None) if isinstance(columns, dict) else None
    return len(values) if values is not None else 0


def python_predictions(out: Any, kind: str) -> list:
    """The predictions transform writes, as Python values (inference.to_predictions' rule)."""
    from sparkdl.tracking.inference import to_predictions

    return to_predictions(out, kind).to_pylist()


def _values(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") and not isinstance(value, np.ndarray) else value


def _dense_block(layout: FeedLayout, columns: Any) -> np.ndarray:
    """(rows, num_features) float32 from the feature columns, in source_feature_cols order: numbers,
    booleans, lists and vectors (JSON sends them as lists of doubles) all become float32, as the
    fit's Spark expression made them."""
    _require(columns, layout.source_feature_cols, layout)
    return np.column_stack([np.stack([_floats(c, v) for v in _values(columns[c])]) for c in layout.source_feature_cols])


def _floats(name: str, value: Any) -> np.ndarray:
    """One row of a numeric column (features, weights) as float32 values, refused naming the column
    when not numeric (a null, a string)."""
    from sparkdl.errors import ColumnTypeError

    if hasattr(value, "toArray"):  # a pyspark.ml.linalg vector handed in from Python
        value = value.toArray()
    try:
        return np.asarray(value, np.float32).reshape(-1)
    except (TypeError, ValueError):
        raise ColumnTypeError(f"input column {name!r} holds {type(value).__name__} values, which are not numbers",
                              hint="send numbers, or lists of numbers for array and vector columns") from None


def _require(columns: Any, names: Any, layout: FeedLayout) -> None:
    from sparkdl.errors import MissingColumnError

    for name in names:
        if name is not None and name not in columns:
            raise MissingColumnError(f"input column {name!r} is missing", hint="pass every column the model was "
                                     f"trained on: {list(layout.source_input_cols)}")


def _fixed_block(column: Any, values: Any) -> np.ndarray:
    """A fixed-shape column as the spool holds it: (rows, width) in its storage type (rows, for a
    scalar column). JSON numbers arrive as int64/float64: they are narrowed to the trained type,
    refused when that would change a value (a fraction for an integer column) or the width differs."""
    from sparkdl.errors import ArrayLengthError, ColumnTypeError

    try:
        stacked = np.asarray(values) if isinstance(values, np.ndarray) and values.dtype != object else \
            np.stack([np.asarray(v) for v in values])
    except ValueError:
        raise ArrayLengthError(f"input column {column.source!r} holds arrays of different lengths",
                               hint=f"send {column.width} numbers per row, as in training") from None
    block = stacked.reshape(len(stacked), -1)
    if block.dtype.kind not in "iufb":
        raise ColumnTypeError(f"input column {column.source!r} holds {block.dtype} values, but the model was trained "
                              f"on {column.storage} values", hint=f"send numbers for {column.source!r}")
    if block.shape[1] != column.width:
        raise ArrayLengthError(f"input column {column.source!r} holds {block.shape[1]} values per row, but the model "
                               f"was trained on {column.width}", hint=f"send {column.width} numbers per row, as in training")
    storage = np.dtype(column.storage)
    if storage.kind in "iub" and block.dtype.kind == "f" and not np.array_equal(block, np.round(block)):
        raise ColumnTypeError(f"input column {column.source!r} holds fractions, but the model was trained on "
                              f"{column.storage} values", hint=f"send whole numbers for {column.source!r}")
    if storage.kind in "iu" and block.dtype.kind in "iuf" and block.size and \
            (block.min() < np.iinfo(storage).min or block.max() > np.iinfo(storage).max):
        raise ColumnTypeError(f"input column {column.source!r} holds values outside {column.storage}'s range, "
                              f"which the model was trained on", hint=f"send {column.storage} values, as in training")
    block = block.astype(storage, copy=False)
    return block.reshape(-1) if column.scalar else block


def arrays_from_columns(layout: FeedLayout, columns: Any) -> tuple:
    """Spool-like arrays (arrow_rows.py) from user-facing columns: a dict, a pandas DataFrame, or
    (feature_cols layouts) a 2-d array of features."""
    if layout.sparse:
        return _sparse_arrays(layout, columns)
    if not layout.tensor_inputs:
        matrix = columns if isinstance(columns, np.ndarray) else _dense_block(layout, columns)
        return (np.ascontiguousarray(np.asarray(matrix, np.float32).reshape(len(matrix), -1)),)
    arrays = []
    _require(columns, layout.source_input_cols, layout)
    for column in layout.inputs:
        values = _values(columns[column.source])
        if column.kind == FIXED:
            arrays.append(_fixed_block(column, values))
        elif column.kind == BINARY:
            arrays.append(pa.array([bytes(v) for v in values], pa.large_binary()))
        elif column.kind == TEXT:
            arrays.append(pa.array([str(v) for v in values], pa.large_string()))
        elif column.kind == RAGGED:
            arrays.append(pa.array([np.asarray(v, column.storage) for v in values],
                                   pa.large_list(pa.from_numpy_dtype(np.dtype(column.storage)))))
    return tuple(arrays)


def _sparse_arrays(layout: FeedLayout, columns: Any) -> tuple:
    """sparse_cols layouts, in layout.inputs order: the dense block (with feature_cols), then per
    categorical input its table rows (int64 per row, or large_list<int64> for multi-hot) and its
    weights (large_list<float32>). Ids map to rows by data/sparse_hash.py's rule, the one the
    prepared Spark columns follow, so serving scores the rows training looked up."""
    from sparkdl.errors import ArrayLengthError, NullValuesError

    _require(columns, layout.source_input_cols, layout)
    arrays: list[Any] = []
    if layout.num_features:
        arrays.append(np.ascontiguousarray(np.asarray(_dense_block(layout, columns), np.float32)))
    for feature in layout.sparse:
        values = _values(columns[feature.source])
        if not feature.multi_hot:
            arrays.append(_id_rows(feature, values))
            continue
        if any(_missing(v) for v in values):
            _refuse_nulls(feature)
        lengths = np.fromiter((len(v) for v in values), np.int64, len(values))
        rows = _id_rows(feature, [x for v in values for x in v])
        offsets = np.concatenate([np.zeros(1, np.int64), np.cumsum(lengths)])
        arrays.append(pa.LargeListArray.from_arrays(pa.array(offsets, pa.int64()), pa.array(rows, pa.int64())))
        if feature.source_weights is not None:
            given = _values(columns[feature.source_weights])
            if any(_missing(w) for w in given):
                raise NullValuesError(f"weights column {feature.source_weights!r} of sparse column "
                                      f"{feature.source!r} holds a null", hint="give every id a weight (1.0 = unweighted)")
            weights = [_floats(feature.source_weights, w) for w in given]
            if any(not np.isfinite(w).all() for w in weights):
                raise NullValuesError(f"weights column {feature.source_weights!r} of sparse column "
                                      f"{feature.source!r} holds NaN or infinite weights",
                                      hint="give every id a finite weight (1.0 = unweighted)")
            if [len(w) for w in weights] != lengths.tolist():
                raise ArrayLengthError(f"weights column {feature.source_weights!r} does not hold one weight per id "
                                       f"of sparse column {feature.source!r} in every row",
                                       hint="weights need one number per id, in the same order")
            arrays.append(pa.array(weights, pa.large_list(pa.float32())))
    return tuple(arrays)


def _id_rows(feature: SparseFeature, ids: Any) -> np.ndarray:
    """Table rows (int64) of one flat list of a SparseFeature's ids, refused naming the column when
    they are not of the kind training saw (or null), or out of range under "refuse"."""
    from sparkdl.data.sparse_hash import SparseIdError, table_rows
    from sparkdl.errors import ColumnTypeError

    values = ids if isinstance(ids, np.ndarray) else np.asarray(ids)
    if values.size == 0:
        return np.zeros(0, np.int64)
    if values.ndim != 1:
        raise ColumnTypeError(f"sparse column {feature.source!r} holds lists, but the model was trained on one id "
                              "per row", hint="pass one id per row, as in training")
    strings = values.dtype.kind == "U" or (values.dtype.kind == "O" and all(isinstance(v, str) for v in values.flat))
    if not (values.dtype.kind in "iu" if feature.id_kind == "integer" else strings):
        if any(_missing(v) for v in values.flat):
            _refuse_nulls(feature)
        raise ColumnTypeError(f"sparse column {feature.source!r} holds {values.dtype} values, but the model was "
                              f"trained on {feature.id_kind} ids", hint=f"pass {feature.id_kind} ids, as in training")
    try:
        return table_rows(values, feature.num_rows, feature.out_of_range)
    except SparseIdError as err:
        raise SparseIdError(f"sparse column {feature.source!r} (table {feature.table!r}): {err.message}",
                            hint=err.hint) from None


def _missing(value: Any) -> bool:
    """None, NaN, or pandas' NA/NaT (what a null becomes in a frame), never a list of ids."""
    if value is None or (isinstance(value, float) and value != value):
        return True
    return type(value).__name__ in ("NAType", "NaTType")


def _refuse_nulls(feature: SparseFeature) -> NoReturn:
    from sparkdl.errors import NullValuesError

    raise NullValuesError(f"sparse column {feature.source!r} holds null ids", hint="fill or drop them before scoring")
