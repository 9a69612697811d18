"""GPU check for one NVIDIA machine (issue 9): sparkdl on a GPU against a bare torch loop, same run.

    .venv/bin/python benchmarks/gpu_check.py [--rows 200000] [--epochs 3] [--repeats 3]

Needs Java >= 17 (Spark), a CUDA build of torch and one GPU; finishes in a few minutes on an H200.
1. sparkdl: a Spark session local[1] whose task owns GPU "0" (a discovery script written here, task
   GPU amount 1), data parallel with world size 1 on the GPU (NCCL backend with one rank), the
   trained model's transform() scored on the GPU too; samples/s of the last epoch.
2. bare torch: the same MLP, rows, batch size, optimizer and epochs, a plain loop over tensors
   already in host memory, copied batch by batch to the GPU; samples/s of the last epoch.
   Target: sparkdl >= 0.9 x bare.
3. host-to-device input throughput: pinned-memory batches of the same shape copied to the GPU
   (GB/s), the ceiling of any input pipeline here.
4. train.precision: step time "32" vs "bf16" vs "16" (GradScaler) of a CNN and a token transformer
   (benchmarks/precision.py on cuda), and the sparkdl fit above with precision="bf16".
Prints one JSON object as the last line of stdout (or {"error": ...} when a prerequisite is missing).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

FEATURES, CLASSES, BATCH = 256, 16, 1024


def mlp() -> Any:
    from torch import nn

    return nn.Sequential(nn.Linear(FEATURES, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                         nn.Linear(2048, CLASSES))


def bare_torch(x: Any, y: Any, epochs: int) -> float:
    import torch

    torch.manual_seed(0)
    model = mlp().cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    rate = 0.0
    for _ in range(epochs):
        order = torch.randperm(len(x))
        torch.cuda.synchronize()
        started = time.perf_counter()
        for start in range(0, len(x), BATCH):
            index = order[start: start + BATCH]
            features, labels = x[index].cuda(non_blocking=True), y[index].cuda(non_blocking=True)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(features), labels).backward()
            optimizer.step()
        torch.cuda.synchronize()
        rate = len(x) / (time.perf_counter() - started)
    return rate


def host_to_device_gbs(repeats: int = 50) -> float:
    import torch

    batch = torch.randn(BATCH, FEATURES).pin_memory()
    batch.cuda()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        batch.cuda(non_blocking=True)
    torch.cuda.synchronize()
    return repeats * batch.numel() * 4 / (time.perf_counter() - started) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import torch

    missing = [what for what, ok in (("java (Spark needs Java >= 17)", shutil.which("java") is not None),
                                     ("a CUDA build of torch with a GPU", torch.cuda.is_available())) if not ok]
    if missing:
        print(json.dumps({"benchmark": "gpu_check", "error": "missing: " + ", ".join(missing)}))
        return
    os.environ["PYSPARK_PYTHON"] = sys.executable
    import numpy as np
    from pyspark.sql import SparkSession

    from sparkdl import TorchEstimator

    work = Path(tempfile.mkdtemp(prefix="sparkdl-gpu-"))
    discover = work / "gpus.sh"
    discover.write_text('#!/usr/bin/env bash\necho \'{"name": "gpu", "addresses": ["0"]}\'\n')
    discover.chmod(0o755)
    spark = (SparkSession.builder.master("local[1]").appName("sparkdl-gpu-check")
             .config("spark.driver.resource.gpu.amount", "1")
             .config("spark.driver.resource.gpu.discoveryScript", str(discover))
             .config("spark.executor.resource.gpu.amount", "1")
             .config("spark.executor.resource.gpu.discoveryScript", str(discover))
             .config("spark.task.resource.gpu.amount", "1").config("spark.ui.enabled", "false").getOrCreate())
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.rows, FEATURES)).astype(np.float32)
    y = (x[:, :CLASSES] + 0.1 * rng.normal(size=(args.rows, CLASSES))).argmax(axis=1)
    df = spark.createDataFrame([(row.tolist(), int(label)) for row, label in zip(x, y)],
                               "features array<float>, label long").repartition(1).cache()
    df.count()
    sparkdl_rates, bare_rates, fit_s, transform_s = [], [], [], []
    for _ in range(args.repeats):
        started = time.perf_counter()
        model = TorchEstimator(model=mlp, feature_cols=["features"], label_col="label", batch_size=BATCH,
                               epochs=args.epochs, num_workers=1, strategy="data_parallel", optimizer="adam",
                               lr=1e-3, tracking=False, progress=False).fit(df)
        fit_s.append(time.perf_counter() - started)
        sparkdl_rates.append(model.history[-1]["samples_per_sec"])
        started = time.perf_counter()
        model.transform(df).select("prediction").count()
        transform_s.append(time.perf_counter() - started)
        bare_rates.append(bare_torch(torch.from_numpy(x), torch.from_numpy(y), args.epochs))
    bf16_model = TorchEstimator(model=mlp, feature_cols=["features"], label_col="label", batch_size=BATCH,
                                epochs=args.epochs, num_workers=1, strategy="data_parallel", precision="bf16",
                                lr=1e-3, tracking=False, progress=False).fit(df)
    from precision import measure as precision_step_times

    device = torch.cuda.get_device_name(0)
    ratio = statistics.median(sparkdl_rates) / statistics.median(bare_rates)
    result = {"benchmark": "gpu_check", "device": device, "torch": torch.__version__, "rows": args.rows,
              "batch": BATCH, "epochs": args.epochs, "repeats": args.repeats,
              "model": f"MLP {FEATURES}-2048-2048-{CLASSES}",
              "sparkdl_samples_per_s": statistics.median(sparkdl_rates),
              "bare_torch_samples_per_s": statistics.median(bare_rates),
              "sparkdl_over_bare": round(ratio, 3), "target": 0.9, "met": ratio >= 0.9,
              "fit_s": statistics.median(fit_s), "transform_s": statistics.median(transform_s),
              "host_to_device_gbs": round(host_to_device_gbs(), 2),
              "sparkdl_bf16_samples_per_s": bf16_model.history[-1]["samples_per_sec"],
              "precision_step_times": precision_step_times("cuda", 20, 3),
              "runs": {"sparkdl": sparkdl_rates, "bare": bare_rates}}
    spark.stop()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
