"""The driver side of benchmarks/elastic.py: runs on the multi-host bed's driver host. Each row is
one TorchEstimator fit of the same GPT on the same byte tokens (DiLoCo across the worker hosts,
checkpoints in the shared directory); a chaos thread asks the benchmark process (which owns the
hosts) to lose a worker host for good every --every seconds and to bring a replacement back
--back-after seconds later.

Rows: "steady" (no failures), "elastic" (launch.min_workers=2, grow_workers: goes on with the hosts
left, grows back at an epoch end), "resubmit_wait" (today's behaviour before spot-safe runs: the
failed job is resubmitted and waits in launch.slot_wait_s until the replacement registers).
Figures per row: the fit's wall seconds, the training seconds its history keeps (work redone after
a failure counts once), goodput = those / wall, the eval loss, every change of workers.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "examples"), str(HERE.parent / "tests" / "support")]

import bed_driver  # noqa: E402 - the bed's ask() (tests/support)
import language_model  # noqa: E402 - the GPT of examples/language_model.py

SEQ_LEN, LR = 64, 3e-3


def _model_factory() -> Any:
    return language_model.gpt(128, 2, 4, SEQ_LEN)


class Chaos:
    """Loses worker host 1, 2, 3, ... in turn every `every` seconds, each back after `back_after`,
    at most `losses` times (a run resubmitted after every loss must still end)."""

    def __init__(self, every: float, back_after: float, workers: int, losses: int) -> None:
        self.every, self.back_after, self.workers, self.losses = every, back_after, workers, losses
        self.events: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._started = 0.0

    def __enter__(self) -> "Chaos":
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(self.back_after + 120)

    def _run(self) -> None:
        victim = 0
        while victim < self.losses and not self._stop.wait(self.every):
            worker = victim % self.workers + 1
            victim += 1
            lost = bed_driver.ask({"do": "lose", "worker": worker})
            self.events.append({"lost": lost["host"], "at_s": round(time.monotonic() - self._started, 1)})
            self._stop.wait(self.back_after)  # the replacement comes back even once the fit ended
            back = bed_driver.ask({"do": "return", "worker": worker})
            self.events.append({"returned": back["host"], "at_s": round(time.monotonic() - self._started, 1)})


def fit_row(name: str, train: Any, evaluation: Any, args: argparse.Namespace, shared: Path) -> dict[str, Any]:
    from sparkdl import TorchEstimator

    elastic = {"min_workers": 2, "grow_workers": True, "replacement_wait_s": 10.0} if name == "elastic" else {}
    estimator = TorchEstimator(
        model=_model_factory, validation_df=evaluation, input_cols=["tokens"], label_col="targets",
        loss="cross_entropy", optimizer="adamw", lr=LR, lr_schedule="cosine", warmup_steps=20, min_lr=LR / 10,
        batch_size=args.batch, epochs=args.epochs, num_workers=args.workers, seed=0, progress=False,
        tracking=False, threads_per_worker=1, sync="diloco", sync_every=32, strategy="data_parallel",
        checkpoint_dir=str(shared / f"checkpoints-{name}"), checkpoint_every=args.checkpoint_every,
        # resubmit-and-wait: the resubmitted job waits for the replacement's slots
        slot_wait_s=args.back_after + 90, timeout_s=60.0, **elastic)
    started = time.monotonic()
    chaos = Chaos(args.every, args.back_after, args.workers, args.losses) if name != "steady" else None
    if chaos is not None:
        with chaos:
            fitted = estimator.fit(train)
    else:
        fitted = estimator.fit(train)
    wall = time.monotonic() - started
    history = fitted.history
    useful = sum(float(r["seconds"]) for r in history)
    return {"wall_s": round(wall, 1), "useful_train_s": round(useful, 1), "goodput": round(useful / wall, 3),
            "eval_loss": float(history[-1]["val_loss"]), "workers": [r.get("workers") for r in history],
            "membership": [c for r in history for c in r.get("membership", [])],
            "resumed": [r.get("resumed_from_step") for r in history if r.get("resumed_from_step") is not None],
            "chaos": chaos.events if chaos is not None else []}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("master")
    parser.add_argument("out", type=Path)
    parser.add_argument("--shared", type=Path, required=True)
    parser.add_argument("--ask", required=True)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--rows", default="steady,elastic,resubmit_wait")
    parser.add_argument("--train-rows", type=int, default=6144)
    parser.add_argument("--eval-rows", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--checkpoint-every", type=int, default=64)
    parser.add_argument("--every", type=float, default=60.0, help="seconds between host losses")
    parser.add_argument("--back-after", type=float, default=40.0, help="seconds until the replacement")
    parser.add_argument("--losses", type=int, default=2, help="host losses per run at most")
    args = parser.parse_args()
    bed_driver.ASK["dir"] = args.ask
    import numpy as np
    from pyspark import cloudpickle as spark_cloudpickle
    from pyspark.sql import SparkSession
    from sparkdl.datasets.images_text import _tokens_dataframe, text_token_arrays

    spark_cloudpickle.register_pickle_by_value(language_model)
    spark = (SparkSession.builder.master(args.master).appName("sparkdl-elastic")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.executor.cores", "1").config("spark.task.cpus", "1").config("spark.executor.memory", "1g")
             .config("spark.stage.maxConsecutiveAttempts", "12")  # a loss a minute: more than 4 attempts
             .config("spark.scheduler.minRegisteredResourcesRatio", "1.0")
             .config("spark.scheduler.maxRegisteredResourcesWaitingTime", "120s").getOrCreate())
    results: dict[str, Any] = {"rows": {}, "started": time.time(), "args": vars(args) | {"out": str(args.out),
                                                                                       "shared": str(args.shared)}}
    try:
        tokens, targets = text_token_arrays(SEQ_LEN, args.train_rows + args.eval_rows)
        order = np.random.default_rng(0).permutation(len(tokens))
        tokens, targets = tokens[order], targets[order]
        train = _tokens_dataframe(spark, tokens[: args.train_rows], targets[: args.train_rows]) \
            .repartition(args.workers).cache()
        evaluation = _tokens_dataframe(spark, tokens[args.train_rows:], targets[args.train_rows:]).cache()
        train.count(), evaluation.count()
        for name in [r for r in args.rows.split(",") if r]:
            try:
                results["rows"][name] = fit_row(name, train, evaluation, args, args.shared)
            except Exception as exc:  # noqa: BLE001 - reported; the next row still runs
                results["rows"][name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
            print(f"[elastic] {name}: {json.dumps(results['rows'][name])[:600]}", file=sys.stderr, flush=True)
            args.out.write_text(json.dumps(results, indent=1, default=str))
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
