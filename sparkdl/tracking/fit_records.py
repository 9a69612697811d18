"""What a fit records in MLflow about its data: the run's params (every option, the dataset, where
its rows came from, the versions) and the model's input example. Split from api.py, which calls
them when it starts the run and logs the model."""
from __future__ import annotations

from typing import Any, Mapping

from sparkdl.config import DataConfig
from sparkdl.spark.session import facts
from sparkdl.tracking.json_types import json_typed


def run_params(options: Mapping[str, Any], data: DataConfig, num_workers: int, df: Any, prepared: Any) -> dict[str, Any]:
    """Every option (`options`: RunConfig.flat()), the dataset and the versions: what makes a run
    reproducible (credentials redacted)."""
    from sparkdl.tracking.mlflow_run import redact, versions

    params: dict[str, Any] = dict(options)
    used = list(prepared.layout.source_input_cols) + [c for c in (data.label_col, data.weight_col) if c]
    types = dict(df.dtypes)
    params.update({
        "dataset.rows": prepared.num_rows, "dataset.validation_rows": prepared.num_validation_rows,
        "dataset.columns": ", ".join(f"{c}:{types.get(c)}" for c in used),
        "dataset.num_features": prepared.layout.num_features, "dataset.source": _source(df),
        "dataset.inputs": "; ".join(f"{c.source}: {c.dtype}{list(c.shape)} ({c.kind})" for c in prepared.layout.inputs)
        or "-",
        "dataset.dropped_invalid_rows": prepared.dropped_rows,
        "dataset.delivery": f"parquet ({prepared.source.files} files)" if prepared.source is not None else
        prepared.delivery,
        "world.workers": num_workers, "world.master": facts(df.sparkSession).master(),
    })
    params.update(versions())
    return redact(params)


def _source(df: Any) -> str:
    try:
        files = df.inputFiles()
    except Exception:  # noqa: BLE001 - not every plan can list its files
        files = []
    return ", ".join(files[:5]) + (f" (+{len(files) - 5} more)" if len(files) > 5 else "") if files else "in-memory/derived"


def input_example(df: Any, layout: Any, rows: int = 5, sample: Any = None) -> Any:
    """A few rows of the user's input columns, in the types a JSON body carries (json_typed): the
    signature MLflow infers from it is then one every JSON client can satisfy (a float32 array
    column logged as Array(float) refuses JSON numbers, which arrive as float64; int32 ids refuse
    int64), and the pyfunc converts what arrives to the dtypes the model trained with
    (serving.arrays_from_columns). feature_cols and sparse_cols runs: a pandas frame of the columns
    (Decimal as double, Spark ML vectors as lists). input_cols runs: the probe rows, as a dict of
    numpy arrays per column when every column is fixed-shape (named tensor specs, whose JSON MLflow
    casts to the spec's type itself), else a frame (binary, string or variable-length columns)."""
    import pandas as pd

    if layout.tensor_inputs and not layout.sparse:
        from sparkdl.data.arrow_rows import incoming_arrays
        from sparkdl.data.layout import FIXED

        # The spool's own decoding: fixed columns as numpy in their element type (int32 tokens stay int32).
        inputs = layout.for_scoring()
        blocks = incoming_arrays(sample.combine_chunks().to_batches()[0], inputs)
        if all(c.kind == FIXED for c in layout.inputs):
            return {c.source: block for c, block in zip(inputs.inputs, blocks)}
        return json_typed(pd.DataFrame({c.source: list(block) if c.kind == FIXED and block.ndim > 1
                                        else block.to_pylist() if c.kind != FIXED else block
                                        for c, block in zip(inputs.inputs, blocks)}))
    from sparkdl.data.feed_sql import quoted

    # sparse_cols: the user's own columns (serving maps raw ids to rows as transform does);
    # feature_cols: each column as the user has it, concatenated by the pyfunc in the fit's order.
    names = list(layout.source_input_cols)
    return json_typed(df.select(*[quoted(c) for c in names]).limit(rows).toPandas())


def fit_extras(tracker: Any, model_uri: str | None, out_shape: tuple[int, ...], phases: Any, prepared: Any,
                parts: Any, load_model: bool) -> dict[str, Any]:
    """What the TorchModel carries besides the module: MLflow ids, the output shape, where the fit's
    time went, how the data came and how the model came back."""
    return {"mlflow_run_id": tracker.run_id, "model_uri": model_uri, "tracking_uri": tracker.tracking_uri,
            "output_shape": out_shape, "phases": phases.seconds,
            "delivery": prepared.delivery,
            "model_parts": None if load_model else parts, "model_transfer": dict(parts.via_by_rank),
            "model_bytes": parts.nbytes, "model_send_s": max(parts.seconds_by_rank.values(), default=0.0)}

