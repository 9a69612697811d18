"""Client script of the Spark Connect tests: everything a user does, through a Connect session only.
Writes what it saw to OUT as JSON; tests/spark/test_connect.py asserts on it and on the MLflow runs.

    python connect_client.py SC_URL MLFLOW_URI WORKDIR OUT

Steps (each recorded under its name, or its error under "<name>_error"):
fit (the digits, as the classic test) + transform accuracy, save/load, sparkdl.run, sparkdl.plan,
the parquet file the test's `sparkdl train --remote` reads, a fit whose executors cannot reach this client's channel,
three concurrent fits from three threads, the slot probe, and `sparkdl train --remote` once the
client's own session is stopped.
"""
from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

FEATURES: list[str] = []
EXPERIMENT = "sparkdl-connect"


def digits_net() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def small_net() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))


def predictions(model: Any, df: Any) -> list[int]:
    return [r["prediction"] for r in model.transform(df).orderBy("label", *FEATURES[:8]).collect()]


def custom_loop(ctx: Any) -> dict[str, Any]:
    total = torch.tensor([float(ctx.rank + 1)])
    ctx.comm.allreduce(total)
    return {"rank": ctx.rank, "size": ctx.world_size, "sum": total.item()}


def main(url: str, mlflow_uri: str, workdir: str, out: str) -> None:
    from pyspark.sql import SparkSession

    import sparkdl
    from sparkdl import TorchEstimator, TorchModel, cli
    from sparkdl.datasets import DIGITS_FEATURE_COLS, digits_dataframe, train_test_split_digits
    from sparkdl.spark.session import facts, is_connect

    FEATURES.extend(DIGITS_FEATURE_COLS)
    spark = SparkSession.builder.remote(url).getOrCreate()
    results: dict[str, Any] = {"connect": is_connect(spark)}

    def step(name: str, action: Callable[[], Any]) -> None:
        started = time.perf_counter()
        try:
            results[name] = action()
        except Exception:  # noqa: BLE001 - the test names the failed step with its traceback
            results[f"{name}_error"] = traceback.format_exc()
        results.setdefault("seconds", {})[name] = round(time.perf_counter() - started, 1)
        with open(out, "w") as f:
            json.dump(results, f, indent=1)

    train_idx, test_idx = train_test_split_digits(seed=0)
    train, test = digits_dataframe(spark, indices=train_idx), digits_dataframe(spark, indices=test_idx)
    tracked = {"tracking_uri": mlflow_uri, "experiment": EXPERIMENT, "progress": False}
    fitted: dict[str, Any] = {}

    def fit() -> dict[str, Any]:
        model = TorchEstimator(model=digits_net, loss="cross_entropy", optimizer="adam", lr=3e-3,
                               feature_cols=DIGITS_FEATURE_COLS, label_col="label", batch_size=32, epochs=15,
                               num_workers=2, seed=0, strategy="data_parallel", run_name="digits",
                               **tracked).fit(train)
        fitted["model"] = model
        scored = model.transform(test)
        rows = scored.select("label", "prediction").collect()
        return {"accuracy": float(np.mean([r["label"] == r["prediction"] for r in rows])),
                "columns": sorted(scored.columns), "epochs": [h["epoch"] for h in model.history],
                "run_id": model.run_id}

    def save_load() -> dict[str, Any]:
        model, path = fitted["model"], f"{workdir}/digits-model"
        model.save(path)
        loaded = TorchModel.load(path)
        same_weights = all(torch.equal(a, b) for a, b in zip(model.torch_module().state_dict().values(),
                                                             loaded.torch_module().state_dict().values()))
        return {"same_predictions": predictions(model, test) == predictions(loaded, test),
                "same_weights": same_weights, "same_history": loaded.history == model.history}

    def plan() -> dict[str, Any]:
        resolved = sparkdl.plan(digits_net, train, feature_cols=DIGITS_FEATURE_COLS, label_col="label",
                                loss="cross_entropy", num_workers=2, batch_size=32)
        return {"strategy": resolved.strategy, "explained": bool(resolved.explain())}

    def write_parquet() -> str:  # the input of the test's `sparkdl train --remote`
        parquet = f"{workdir}/digits.parquet"
        digits_dataframe(spark).write.mode("overwrite").parquet(parquet)
        return parquet

    def unreachable_channel() -> dict[str, Any]:
        # TEST-NET-3 (RFC 5737) routes nowhere: the executors' connects fail, the fit must not
        model = TorchEstimator(model=small_net, feature_cols=DIGITS_FEATURE_COLS, label_col="label", epochs=3,
                               num_workers=2, strategy="data_parallel", channel="203.0.113.1",
                               run_name="no-channel", **tracked).fit(train)
        return {"run_id": model.run_id, "epochs": len(model.history)}

    def concurrent() -> list[str]:
        small = train.limit(400).cache()
        runs: dict[int, Any] = {}

        def one(index: int) -> None:
            try:
                runs[index] = TorchEstimator(model=small_net, feature_cols=DIGITS_FEATURE_COLS, epochs=1,
                                             batch_size=32, num_workers=2, strategy="data_parallel", seed=index,
                                             run_name=f"concurrent-{index}", **tracked).fit(small).run_id
            except Exception:  # noqa: BLE001 - reported by the test
                runs[index] = "error: " + traceback.format_exc()

        threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(600)
        return [runs.get(i, "error: did not finish") for i in range(3)]

    step("fit", fit)
    if "model" in fitted:
        step("save_load", save_load)
    step("run", lambda: sparkdl.run(custom_loop, num_workers=2))
    step("plan", plan)
    step("parquet", write_parquet)
    step("unreachable_channel", unreachable_channel)
    step("concurrent", concurrent)
    step("probe_slots", lambda: [facts(spark).probe_slots(2), facts(spark).probe_slots(6)])
    spark.stop()
    # no session left: `sparkdl train --remote` makes its own (and stops it)
    step("cli_train", lambda: cli.main(["train", "--remote", url, "--conf", "conf/examples/digits.toml",
                                        "--set", f"input.path={results['parquet']}",
                                        "--set", f"output.model_path={workdir}/cli-model",
                                        "--set", "train.epochs=2", "--set", "tracking.tracking=false"]))


if __name__ == "__main__":
    main(*sys.argv[1:5])
