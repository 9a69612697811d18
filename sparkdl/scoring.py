"""Driver side of TorchModel.transform / sparkdl.predict: check the options, ship the module in a
broadcast, and append the prediction column through mapInArrow, optionally under a task
ResourceProfile that gives scoring tasks (fractions of) GPUs. The executor side is inference.py."""
from __future__ import annotations

import uuid
from typing import Any

from sparkdl.errors import ConfigError, SchemaError
from sparkdl.launch.shipping import ship_by_value


def predict(df: Any, module: Any, layout: Any, kind: str, prediction_col: str = "prediction",
            batch_size: int = 1024, gpus_per_task: float = 0.0) -> Any:
    """Append `prediction_col` computed on the executors through mapInArrow; every input column kept.

    `gpus_per_task` > 0 runs the scoring stage under a task ResourceProfile with that many GPUs, so a
    CPU-default application scores on GPUs; a fraction (0.25) lets 1/amount tasks share one GPU."""
    from pyspark.sql import types as T

    from sparkdl.data.feed import check_columns, features_expression
    from sparkdl.data.layout import FEATURES_COLUMN
    from sparkdl.inference import make_predict_fn
    from sparkdl.launch.driver import gpu_task_profile
    from sparkdl.launch.worker import _dumps_any

    check_gpus_per_task(gpus_per_task)
    check_inference_batch_size(batch_size)
    cols = list(layout.source_feature_cols)
    check_columns(df, cols)
    if prediction_col in df.columns:
        raise SchemaError(f"the DataFrame already has a column named {prediction_col!r}",
                          hint="drop it first or pass another prediction column name")
    prediction_type = {"class": T.LongType(), "binary": T.LongType(), "value": T.DoubleType(),
                       "values": T.ArrayType(T.FloatType())}[kind]
    out_schema = T.StructType(df.schema.fields + [T.StructField(prediction_col, prediction_type, True)])
    spark = df.sparkSession
    ship_by_value(module)
    module_bytes = spark.sparkContext.broadcast(_dumps_any(module))
    fn = make_predict_fn(module_bytes, uuid.uuid4().hex, FEATURES_COLUMN, layout.num_features, kind, prediction_col, batch_size)
    profile = gpu_task_profile(spark, gpus_per_task) if gpus_per_task else None
    return df.withColumn(FEATURES_COLUMN, features_expression(df, cols)).mapInArrow(fn, out_schema, profile=profile)


def check_gpus_per_task(amount: float) -> None:
    """Spark's rule for task resource amounts: a whole number, or a fraction of one GPU."""
    import math

    if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not math.isfinite(amount) \
            or amount < 0 or (amount > 1 and float(amount) != int(amount)):
        raise ConfigError(f"inference GPUs per task must be 0 (CPU), a fraction <= 1 or a whole number; "
                          f"got {amount!r}",
                          hint="e.g. setInferenceGpus(0.25) lets 4 scoring tasks share each GPU")


def check_inference_batch_size(batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"the inference batch size must be a positive integer; got {batch_size!r}",
                           hint="setInferenceBatchSize(1024)")
