"""A trained model as it scores: the module with the input layout, transform_fn and output kind it
was trained with, turning input columns into predictions. One object behind TorchModel.transform's
executors, the MLflow pyfunc model (`mlflow.pyfunc.load_model(uri).predict(frame)` and
`mlflow models serve`) and save/load, so that all three answer alike.

No pyspark and no mlflow at import: executors and scoring servers load it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import pyarrow as pa

from sparkdl.data.arrow_rows import slice_rows
from sparkdl.data.layout import BINARY, FIXED, RAGGED, TEXT, FeedLayout

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

    @property
    def input_layout(self) -> FeedLayout:
        return self.layout.for_scoring()

    def scores(self, arrays: tuple, device: Any = "cpu", batch_size: int = 1024) -> Any:
        """The model's output over one block of input rows (spool-like arrays), in chunks of batch_size."""
        import torch

        from sparkdl.data.assemble import assembler
        from sparkdl.strategies.inputs import call_model, to_device

        layout = self.input_layout
        rows = len(arrays[0]) if arrays else 0
        assemble = assembler(layout, self.transform_fn, self.explicit_dtypes)
        outputs = []
        with torch.inference_mode():
            for start in range(0, rows, batch_size):
                chunk = tuple(slice_rows(a, start, min(rows, start + batch_size)) for a in arrays)
                inputs = assemble(chunk)[0]
                outputs.append(call_model(self.module, to_device(inputs, device)).detach().float().cpu())
        return torch.cat(outputs) if outputs else None

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


def arrays_from_columns(layout: FeedLayout, columns: Any) -> tuple:
    """Spool-like arrays (arrow_rows.py) from user-facing columns: a dict, a pandas DataFrame, or
    (feature_cols layouts) a 2-d array of features."""
    if not layout.tensor_inputs:
        if isinstance(columns, np.ndarray):
            matrix = columns
        else:
            matrix = np.column_stack([np.stack([np.asarray(v, np.float32).reshape(-1) for v in _values(columns[c])])
                                      for c in layout.source_feature_cols])
        return (np.ascontiguousarray(np.asarray(matrix, np.float32).reshape(len(matrix), -1)),)
    arrays = []
    for column in layout.inputs:
        if column.source not in columns:
            from sparkdl.errors import MissingColumnError

            raise MissingColumnError(f"input column {column.source!r} is missing", hint="pass every input column")
        values = _values(columns[column.source])
        if column.kind == FIXED:
            stacked = np.asarray(values) if isinstance(values, np.ndarray) and values.dtype != object else \
                np.stack([np.asarray(v) for v in values])
            block = stacked.astype(column.storage, copy=False).reshape(len(stacked), -1)
            arrays.append(block.reshape(-1) if column.scalar else block)
        elif column.kind == BINARY:
            arrays.append(pa.array([bytes(v) for v in values], pa.large_binary()))
        elif column.kind == TEXT:
            arrays.append(pa.array([str(v) for v in values], pa.large_string()))
        elif column.kind == RAGGED:
            arrays.append(pa.array([np.asarray(v, column.storage) for v in values],
                                   pa.large_list(pa.from_numpy_dtype(np.dtype(column.storage)))))
    return tuple(arrays)
