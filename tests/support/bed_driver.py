"""Driver script of the multi-host bed's tests (tests/support/multihost.py), run on the bed's
driver host against its standalone master. One process runs several scenarios on one
SparkSession (a session start costs tens of seconds on the bed) and writes one JSON object per
scenario to OUT: what it measured, or the error's type and text.

    python bed_driver.py MASTER OUT SCENARIO[,SCENARIO...] [--workers N] [--checkpoint-dir DIR]

Scenarios: fit-<strategy> (data_parallel, diloco, hybrid, ist, sharded), fit-horovod, plan, calibrate,
fit-checkpoint-local (checkpoint_dir under this host's /tmp), fit-checkpoint-shared (under --shared).
--conf KEY=VALUE sets Spark options of the session (repeatable).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

FEATURES = [f"f{i}" for i in range(8)]


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))


def rows(count: int = 1200, seed: int = 3) -> list[tuple[Any, ...]]:
    """Three separable classes: every strategy reaches a high accuracy in a few epochs."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(count, 8))
    y = (x[:, 0] > 0.4).astype(int) + (x[:, 1] + x[:, 2] > 0.8).astype(int)
    return [(*map(float, r), int(t)) for r, t in zip(x, y)]


def frame(spark: Any, workers: int) -> Any:
    # Fixed partitions (no shuffle): each rank's rows and their order are the same on every master.
    return spark.sparkContext.parallelize(rows(), workers).toDF(FEATURES + ["label"]).cache()


def accuracy(model: Any, df: Any) -> float:
    scored = model.transform(df).select("label", "prediction").collect()
    return sum(int(r["label"]) == int(r["prediction"]) for r in scored) / len(scored)


def fit(spark: Any, df: Any, workers: int, strategy: str, backend: str = "torch", **extra: Any) -> dict[str, Any]:
    from sparkdl import TorchEstimator

    options: dict[str, Any] = dict(model=net, feature_cols=FEATURES, label_col="label", batch_size=32, epochs=6,
                                   num_workers=workers, optimizer="adam", lr=0.01, seed=7, strategy=strategy,
                                   backend=backend, tracking=False, progress=False)
    if strategy == "diloco":
        options.update(strategy="data_parallel", sync="diloco", sync_every=2, epochs=10)
    if strategy == "hybrid":
        options.update(stages=2)
    options.update(extra)
    started = time.monotonic()
    model = TorchEstimator(**options).fit(df)
    return {"accuracy": accuracy(model, df), "seconds": round(time.monotonic() - started, 1),
            "history": model.history[-1] if model.history else None}


CUT = {"marker": "", "calls": 0}


def marking_loss(output: Any, labels: Any) -> Any:
    """Cross-entropy; rank 0's 40th call asks the test to cut a link (a marker file in the shared
    directory) and pauses a second, so that the cut lands while the ranks still train."""
    CUT["calls"] += 1
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if CUT["marker"] and rank == 0 and CUT["calls"] == 40:
        Path(CUT["marker"]).touch()
        time.sleep(1.0)
    return nn.functional.cross_entropy(output, labels)


def weights_of(spark: Any, df: Any, workers: int, marker: str, **extra: Any) -> dict[str, Any]:
    from sparkdl import TorchEstimator

    CUT.update(marker=marker, calls=0)
    model = TorchEstimator(model=net, feature_cols=FEATURES, label_col="label", batch_size=16, epochs=4,
                           num_workers=workers, optimizer="sgd", lr=0.05, seed=7, tracking=False, progress=False,
                           loss=marking_loss, **extra).fit(df)
    return {k: v.detach().clone() for k, v in model.torch_module().state_dict().items()}


def cut_short(spark: Any, df: Any, workers: int, shared: Path) -> dict[str, Any]:
    """The same fit twice: untouched, then with a link cut shorter than launch.timeout_s mid-run
    (the test cuts it when the marker appears): training goes on, to the same weights."""
    reference = weights_of(spark, df, workers, "")
    started = time.monotonic()
    cut = weights_of(spark, df, workers, str(shared / "cut-now"), timeout_s=60)
    same = all(torch.equal(reference[k], cut[k]) for k in reference)
    return {"same_weights": same, "seconds": round(time.monotonic() - started, 1),
            "cut_seen": (shared / "cut-done").exists()}


def plan(spark: Any, df: Any, workers: int) -> dict[str, Any]:
    import sparkdl

    started = time.monotonic()
    resolved = sparkdl.plan(net, df, feature_cols=FEATURES, label_col="label", batch_size=32, epochs=6,
                            num_workers=workers, tracking=False, strategy="auto")
    auto = resolved.auto
    return {"strategy": resolved.strategy, "settings": [list(map(str, kv)) for kv in resolved.settings],
            "links": [[a, b, latency, bandwidth] for a, b, latency, bandwidth in (auto.executor_links if auto else ())],
            "seconds": round(time.monotonic() - started, 1)}


def calibration(spark: Any, workers: int) -> dict[str, Any]:
    """Two fresh calibration probes (the first on fresh Python workers): the second's seconds and
    measured pair bandwidths keyed by executor address, and the executors the cache is keyed by."""
    from sparkdl.planning import calibrate, session_facts

    first = calibrate(spark, workers, refresh=True)  # also starts the Python workers and imports torch
    info = calibrate(spark, workers, refresh=True)
    links, best = {}, {}
    for i in range(info.workers):
        for j in range(i + 1, info.workers):
            links[f"{info.rank_executors[i]}-{info.rank_executors[j]}"] = info.bandwidth_Bps[i][j]
            best[f"{info.rank_executors[i]}-{info.rank_executors[j]}"] = info.best_bandwidth_Bps[i][j]
    return {"probe_s": info.probe_s, "first_probe_s": first.probe_s, "links_Bps": links, "best_links_Bps": best, "rank_executors": list(info.rank_executors),
            "cache_executors": list(session_facts(spark, workers).executors),
            "driver_host": spark.conf.get("spark.driver.host")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("master")
    parser.add_argument("out", type=Path)
    parser.add_argument("scenarios")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--shared", type=Path, help="a directory every host shares")
    parser.add_argument("--conf", action="append", default=[])
    args = parser.parse_args()
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(args.master).appName("sparkdl-bed")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false").config("spark.executor.cores", "1")
             .config("spark.task.cpus", "1").config("spark.executor.memory", "1g")
             .config("spark.scheduler.minRegisteredResourcesRatio", "1.0")
             .config("spark.scheduler.maxRegisteredResourcesWaitingTime", "120s"))
    for item in args.conf:
        key, value = item.split("=", 1)
        spark = spark.config(key, value)
    spark = spark.getOrCreate()
    results: dict[str, Any] = {}
    try:
        df = frame(spark, args.workers)
        df.count()
        for scenario in args.scenarios.split(","):
            started = time.monotonic()
            try:
                if scenario == "fit-cut-short":
                    results[scenario] = cut_short(spark, df, args.workers, args.shared)
                elif scenario == "calibrate":
                    results[scenario] = calibration(spark, args.workers)
                elif scenario == "plan":
                    results[scenario] = plan(spark, df, args.workers)
                elif scenario == "fit-checkpoint-local":
                    results[scenario] = fit(spark, df, args.workers, "data_parallel", checkpoint_dir="/tmp/sparkdl-ckpt",
                                            checkpoint_every=5)
                elif scenario == "fit-checkpoint-shared":
                    results[scenario] = fit(spark, df, args.workers, "data_parallel",
                                            checkpoint_dir=str(args.shared / "ckpt"), checkpoint_every=5)
                elif scenario == "fit-horovod":
                    results[scenario] = fit(spark, df, args.workers, "data_parallel", backend="horovod")
                elif scenario.startswith("fit-"):
                    results[scenario] = fit(spark, df, args.workers, scenario[4:])
                else:
                    raise ValueError(f"unknown scenario {scenario!r}")
            except Exception as exc:  # noqa: BLE001 - reported to the test, the next scenario still runs
                results[scenario] = {"error": type(exc).__name__, "message": str(exc),
                                     "trace": traceback.format_exc()[-3000:]}
            results[scenario]["wall_s"] = round(time.monotonic() - started, 1)
            args.out.write_text(json.dumps(results, indent=1))
            print(f"[bed] {scenario}: {json.dumps(results[scenario])[:400]}", file=sys.stderr, flush=True)
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
