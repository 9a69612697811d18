"""A driver process of its own (spark.driver.memory cannot change inside a running JVM): trains a
model of 63M parameters (252 MB fp32) given as one factory per layer, sharded on 4 ranks of
local-cluster[2,2,1024], with a 512m driver JVM and spark.driver.maxResultSize=16m, one SGD step;
then checks the model that came back against the same step taken here on the same rows. Prints one
JSON line: the largest difference, how each rank's part came back, the driver's peak RSS."""
from __future__ import annotations

import json
import os
import resource
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

WIDTH, INPUTS, CLASSES, ROWS = 2048, 32, 4, 32


def wide_on_meta() -> nn.Module:
    with torch.device("meta"):
        return nn.Linear(WIDTH, WIDTH)


LAYERS = [lambda: nn.Linear(INPUTS, WIDTH), nn.Tanh] + [wide_on_meta] * 15 + [lambda: nn.Linear(WIDTH, CLASSES)]


def main() -> None:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    from sparkdl import TorchEstimator
    from sparkdl.model.layer_factories import LayerFactories

    spark = (SparkSession.builder.master("local-cluster[2,2,1024]").appName("sparkdl-big-model-transfer")
             .config("spark.driver.memory", "512m").config("spark.driver.maxResultSize", "16m")
             .config("spark.executor.memory", "1g").config("spark.ui.enabled", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(ROWS, INPUTS)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=ROWS)
    columns = [f"x{i}" for i in range(INPUTS)]
    df = spark.createDataFrame([tuple(map(float, r)) + (int(t),) for r, t in zip(x, y)], columns + ["label"])
    df = df.repartition(4).cache()
    model = TorchEstimator(model=LAYERS, feature_cols=columns, label_col="label", epochs=1, batch_size=ROWS // 4,
                           num_workers=4, optimizer="sgd", lr=0.05, strategy="sharded", shuffle=False, seed=7,
                           tracking=False, progress=False).fit(df)
    trained = model.torch_module().state_dict()
    # The same step here: SGD on the mean loss over all rows equals sharded data parallel's step.
    table = df.toArrow()
    inputs = torch.tensor(np.stack([table.column(c).to_numpy() for c in columns], axis=1), dtype=torch.float32)
    labels = torch.tensor(table.column("label").to_numpy())
    reference = LayerFactories.of(LAYERS).build(seed=7)
    F.cross_entropy(reference(inputs), labels).backward()
    torch.optim.SGD(reference.parameters(), lr=0.05).step()
    worst = max(float((trained[k] - v).abs().max()) for k, v in reference.state_dict().items())
    print(json.dumps({"parameters": sum(p.numel() for p in reference.parameters()), "max_abs_diff": worst,
                      "keys_equal": sorted(trained) == sorted(reference.state_dict()),
                      "via": {str(k): v for k, v in model.model_transfer.items()},
                      "driver_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10}), flush=True)
    spark.stop()


if __name__ == "__main__":
    main()
