"""Client of tests/spark/test_shipping_connect.py, through a Spark Connect session only:

    python shipping_connect_client.py SC_URL SHARED_TARGET SHARED_NAME CLIENT_TARGET CLIENT_NAME OUT

SHARED_TARGET is on the server's executors' PYTHONPATH and put on this client's sys.path here;
CLIENT_TARGET only on this client's. For each library: what the executors import (the answer of
executors_can_import), what ship_by_value registers, and a one-epoch fit of a model built from it.
Writes what it saw to OUT as JSON (a step's error under "<step>_error")."""
from __future__ import annotations

import importlib
import json
import sys
import traceback
from typing import Any

import numpy as np
from torch import nn


def main(url: str, shared: str, shared_name: str, client: str, client_name: str, out: str) -> None:
    from pyspark import cloudpickle
    from pyspark.sql import SparkSession

    from sparkdl import TorchEstimator
    from sparkdl.driver.shipping import ship_by_value
    from sparkdl.spark.session import executors_can_import, is_connect

    sys.path[:0] = [shared, client]
    spark = SparkSession.builder.remote(url).getOrCreate()
    results: dict[str, Any] = {"connect": is_connect(spark)}
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    df = spark.createDataFrame([([float(v) for v in row], float(row.sum())) for row in x], "xs array<float>, y float")

    for step, name in (("shared", shared_name), ("client", client_name)):
        try:
            layers = importlib.import_module(f"{name}.layers")
            model = nn.Sequential(layers.Block(), nn.Linear(4, 1))
            answer = executors_can_import(spark, [(f"{name}.layers", ("Block",))])
            registered = ship_by_value(model, spark=spark)
            trained = TorchEstimator(model=model, loss="mse", optimizer="sgd", lr=0.05, feature_cols=["xs"],
                                     label_col="y", batch_size=16, epochs=1, num_workers=2, tracking=False,
                                     progress=False).fit(df)
            results[step] = {"executors_import": sorted(answer), "registered": registered,
                             "by_value": f"{name}.layers" in cloudpickle.list_registry_pickle_by_value(),
                             "epochs": len(trained.history)}
        except Exception:  # noqa: BLE001 - the test names the failed step with its traceback
            results[f"{step}_error"] = traceback.format_exc()
    spark.stop()
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:7])
