"""Driver script of tests/spark/test_multihost_elastic.py, on the multi-host bed's driver host: fits
across three worker hosts whose third is lost for good mid-run (its Spark Worker and executors
SIGKILLed, its link cut, by the test process's controller) and, where the scenario says, comes back.
Writes one JSON object per scenario to OUT; weights go to the shared directory.

    python bed_elastic.py MASTER OUT SCENARIOS --shared DIR --ask DIR

Scenarios: elastic-data_parallel (shrinks to 2), elastic-diloco (shrinks, the host returns, grows
back to 3), elastic-sharded (shrinks), steady-diloco and steady-sharded (3 hosts throughout).
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn

import bed_driver
from bed_driver import ASK, FEATURES, ask, said

LOSE = {"ask": "", "once": "", "calls": 0, "at": 12, "sleep": 0.0}


def losing_loss(output: Any, labels: Any) -> Any:
    """Cross-entropy; rank 0's LOSE["at"]-th call asks for worker host 3 to be lost for good (once
    per marker file) and trains on; LOSE["sleep"] slows every step (time for a replacement)."""
    LOSE["calls"] += 1
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if LOSE["ask"] and rank == 0 and LOSE["calls"] == LOSE["at"]:
        try:
            Path(LOSE["once"]).touch(exist_ok=False)
        except FileExistsError:
            pass
        else:
            ASK["dir"] = LOSE["ask"]
            ask({"do": "lose", "worker": 3, "from": socket.gethostname()}, wait=False)
            time.sleep(1.0)
    if LOSE["sleep"]:
        time.sleep(LOSE["sleep"])
    return nn.functional.cross_entropy(output, labels)


def slots(spark: Any) -> int:
    return spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() - 1  # noqa: SLF001 - executors only


def wait_for_slots(spark: Any, count: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while slots(spark) < count and time.monotonic() < deadline:
        time.sleep(0.5)


def run(spark: Any, df: Any, validation: Any, shared: Path, name: str) -> dict[str, Any]:
    from sparkdl import TorchEstimator

    kind, strategy = name.split("-", 1)
    options: dict[str, Any] = dict(model=bed_driver.net, feature_cols=FEATURES, label_col="label", batch_size=16,
                                   epochs=6, num_workers=3, optimizer="sgd", lr=0.05, momentum=0.9, seed=7,
                                   strategy=strategy, tracking=False, progress=False, loss=losing_loss,
                                   validation_df=validation, checkpoint_dir=str(shared / f"ckpt-{name}"),
                                   checkpoint_every=5, keep_checkpoints=50, timeout_s=30.0, peer_failure_delay_s=0.5)
    if strategy == "diloco":
        options.update(strategy="data_parallel", sync="diloco", sync_every=4, epochs=10)
    elastic = kind == "elastic"
    if elastic:
        options.update(min_workers=2, replacement_wait_s=5.0)
    grow = strategy == "diloco" and elastic
    if grow:
        options.update(grow_workers=True)
    LOSE.update(ask=ASK["dir"] if elastic else "", once=str(shared / f"lost-{name}"), calls=0,
                sleep=0.15 if grow else 0.0)
    shrunk = said("sparkdl: workers 3 -> 2")
    returned: dict[str, Any] = {}

    def bring_it_back() -> None:  # the replacement registers once the run went on with 2
        deadline = time.monotonic() + 300
        while not shrunk() and time.monotonic() < deadline:
            time.sleep(0.5)
        if shrunk():
            returned.update(ask({"do": "return", "worker": 3}))

    helper = threading.Thread(target=bring_it_back, daemon=True)
    if grow:
        helper.start()
    started = time.monotonic()
    try:
        model = TorchEstimator(**options).fit(df)
    finally:
        LOSE["ask"] = ""
        if grow:
            helper.join(120)
        if elastic and not returned:  # the next scenario starts on three hosts again
            returned.update(ask({"do": "return", "worker": 3}))
        wait_for_slots(spark, 3)
    history = model.history
    weights = shared / f"{name}.pt"
    torch.save({k: v.detach().clone() for k, v in model.torch_module().state_dict().items()}, weights)
    runs = [p.name for p in (shared / f"ckpt-{name}").iterdir() if p.is_dir()]
    return {"seconds": round(time.monotonic() - started, 1), "weights": str(weights), "runs": runs,
            "checkpoint_dir": str(shared / f"ckpt-{name}"), "lost": Path(LOSE["once"]).exists(),
            "workers": [r.get("workers") for r in history], "val_loss": float(history[-1]["val_loss"]),
            "membership": [r["membership"] for r in history if "membership" in r],
            "resized_from_step": [r.get("resumed_from_step") for r in history if "resized_from_workers" in r],
            "said": shrunk(), "accuracy": bed_driver.accuracy(model, df)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("master")
    parser.add_argument("out", type=Path)
    parser.add_argument("scenarios")
    parser.add_argument("--shared", type=Path, required=True)
    parser.add_argument("--ask", required=True)
    args = parser.parse_args()
    ASK["dir"] = args.ask
    from pyspark import cloudpickle
    from pyspark.sql import SparkSession

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the executors cannot import this file
    cloudpickle.register_pickle_by_value(bed_driver)
    spark = (SparkSession.builder.master(args.master).appName("sparkdl-bed-elastic")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.executor.cores", "1").config("spark.task.cpus", "1").config("spark.executor.memory", "1g")
             .config("spark.stage.maxConsecutiveAttempts", "8")
             .config("spark.scheduler.minRegisteredResourcesRatio", "1.0")
             .config("spark.scheduler.maxRegisteredResourcesWaitingTime", "120s").getOrCreate())
    results: dict[str, Any] = {}
    try:
        # Six fixed partitions: dealt over 3 or 2 ranks in a fixed order (elastic runs sort each shard).
        df = spark.sparkContext.parallelize(bed_driver.rows(), 6).toDF(FEATURES + ["label"]).cache()
        validation = spark.sparkContext.parallelize(bed_driver.rows(300, seed=9), 2).toDF(FEATURES + ["label"]).cache()
        df.count(), validation.count()
        for name in args.scenarios.split(","):
            try:
                results[name] = run(spark, df, validation, args.shared, name)
            except Exception as exc:  # noqa: BLE001 - reported to the test, the next scenario still runs
                results[name] = {"error": type(exc).__name__, "message": str(exc),
                                 "trace": traceback.format_exc()[-3000:]}
            args.out.write_text(json.dumps(results, indent=1))
            print(f"[bed-elastic] {name}: {json.dumps(results[name])[:600]}", file=sys.stderr, flush=True)
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
