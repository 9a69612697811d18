"""A data-parallel fit against TorchDistributor's DDP, step for step, on a slow link (issue 53 part 6).

    .venv/bin/python benchmarks/dp_fit_bed.py [--link 20mbit] [--workers 2] [--train-rows 2048] [--batch 16]

benchmarks/overlap.py times the strategy's step alone (no Spark); this times whole fits on the
multi-host bed, so what a fit adds around the step (feeding, reporting, epoch ends) shows: W worker
hosts (one core, one rank each) at --link, a standalone master, the driver on its own host, the GPT of
examples/language_model.py (d=64, 2 blocks: 137,216 parameters) on the byte tokens of
benchmarks/slow_links_driver.py, AdamW, the same rows, batch, lr schedule and epochs for both:
  sparkdl_dp   TorchEstimator(strategy="data_parallel", threads_per_worker=1) (overlap_grads on)
  sparkdl_dp_2threads, sparkdl_dp_dynamic   two torch threads a rank; batch_balance="dynamic" (row_options)
  sparkdl_auto strategy="auto" (threads_per_worker=1), planning included, for --auto-epochs epochs
               (an approximate strategy needs more steps to reach the same loss)
  ddp          slow_links_driver.ddp_train under TorchDistributor (plain DDP over gloo)
--load hog: one busy loop on every worker host (inside its namespace) for the whole run, as a
neighbour would be.
Figures: training seconds per step (epoch seconds / steps: validation not included, as DDP's), and
for sparkdl its epoch records' split of a step (compute, blocked in collectives, waiting for data) per
rank; with sparkdl_auto and ddp, each one's wall seconds to DDP's final eval loss (issue 53's
acceptance: auto >= 5x sooner, planning included). Prints JSON (and writes it to --out).

    .venv/bin/python benchmarks/dp_fit_bed.py --rows sparkdl_auto,ddp --epochs 6 --auto-epochs 12 --load hog
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE), str(HERE.parent / "tests" / "support"), str(HERE.parent / "examples")]

RATES = {"1gbit": 1_000_000_000, "100mbit": 100_000_000, "20mbit": 20_000_000}


def row_options(name: str) -> dict[str, Any]:
    """sparkdl_dp[_2threads][_dynamic]: torch threads a rank (default 1, as DDP's; 2 is what sparkdl
    gave a rank alone on a 2-core host before issue 53 part 5), batch_balance="dynamic" (what
    strategy="auto" sets for data parallel, driver/planning.py)."""
    threads = next((int(part[:-len("threads")]) for part in name.split("_") if part.endswith("threads")), 1)
    return {"threads_per_worker": threads, "batch_balance": "dynamic" if name.endswith("_dynamic") else "equal"}


def estimator(evaluation: Any, args: argparse.Namespace, epochs: int, **options: Any) -> Any:
    """The TorchEstimator every sparkdl row trains with (DDP's model, rows, batch and schedule), plus `options`."""
    import slow_links_driver as sld
    from sparkdl import TorchEstimator

    return TorchEstimator(
        model=sld._model_factory, validation_df=evaluation, input_cols=["tokens"], label_col="targets",
        loss="cross_entropy", optimizer="adamw", lr=sld.LR, lr_schedule="cosine", warmup_steps=sld.WARMUP,
        min_lr=sld.MIN_LR, batch_size=args.batch, epochs=epochs, num_workers=args.workers, seed=0,
        progress=False, tracking=False, **options)


def auto_row(spark: Any, train: Any, evaluation: Any, args: argparse.Namespace) -> dict[str, Any]:
    """strategy="auto" for --auto-epochs: what it chose, its eval loss after each epoch, and the wall
    seconds from fit() to the end of each epoch (planning, start and earlier validations included)."""
    started = time.perf_counter()
    fitted = estimator(evaluation, args, args.auto_epochs, strategy="auto", threads_per_worker=1).fit(train)
    wall = time.perf_counter() - started
    history = fitted.history
    # Wall time at each epoch's end: the fit's wall less the epochs after it (their training; their
    # validations stay counted, so these are upper bounds).
    later = [sum(float(r["seconds"]) for r in history[i + 1:]) for i in range(len(history))]
    plan = fitted.plan
    return {"fit_wall_s": round(wall, 1), "chosen": plan.choice.label if plan.choice is not None else plan.strategy,
            "explain": plan.explain(), "fit_seconds": dict(fitted.fit_seconds),  # where the wall went before training
            "time_to_first_step_s": history[0].get("time_to_first_step_s"),
            "curve": [[round(wall - later[i], 2), sum(int(h["steps"]) for h in history[:i + 1]), float(r["val_loss"])]
                      for i, r in enumerate(history)],
            "step_ms": [round(1e3 * r["seconds"] / int(r["steps"]), 1) for r in history],
            "predicted_step_ms": round(1e3 * plan.choice.predicted_step_s, 2) if plan.choice is not None else None,
            "split": [step_split(r) for r in history], "val_loss": float(history[-1]["val_loss"])}


def step_split(record: dict[str, Any]) -> dict[str, Any]:
    """One epoch record's step split per rank (ms a step): compute, blocked in collectives, waiting for data."""
    steps = max(int(record["steps"]), 1)
    return {"compute_ms_by_rank": [round(1e3 * c / steps, 1) for c in record.get("compute_seconds_by_rank", ())],
            "wait_ms_by_rank": [round(1e3 * w / steps, 1) for w in record.get("wait_seconds_by_rank", ())],
            "data_ms_slowest": round(1e3 * record.get("data_seconds", 0.0) / steps, 1)}


def time_to(curve: list[list[float]], target: float) -> float | None:
    """The first [seconds, step, loss] point at or below `target`: its seconds (None: never)."""
    return next((point[0] for point in curve if point[2] <= target), None)


def sparkdl_row(spark: Any, train: Any, evaluation: Any, args: argparse.Namespace, options: dict[str, Any]
                ) -> dict[str, Any]:
    started = time.perf_counter()
    fitted = estimator(evaluation, args, args.epochs, strategy="data_parallel", **options,
                       overlap_grads=not args.no_overlap).fit(train)
    history = fitted.history
    per_epoch = []
    for r in history:
        steps = int(r["steps"])
        per_epoch.append({"step_ms": round(1e3 * r["seconds"] / steps, 1), **step_split(r),
                          "bytes_per_step_rank0": int(r["bytes_sent"] / steps),
                          **{k: r[k] for k in ("rebalances", "rows_moved", "batch_rows_per_rank") if k in r}})
    return {"fit_wall_s": round(time.perf_counter() - started, 1), "epochs": per_epoch,
            "step_ms": [e["step_ms"] for e in per_epoch], "val_loss": float(history[-1]["val_loss"])}


def ddp_row(spark: Any, shared: Path, args: argparse.Namespace, steps_per_epoch: int) -> dict[str, Any]:
    import slow_links_driver as sld
    from pyspark.ml.torch.distributor import TorchDistributor

    started = time.perf_counter()
    out = TorchDistributor(num_processes=args.workers, local_mode=False, use_gpu=False).run(
        sld.ddp_train, str(shared / "train.npy"), str(shared / "eval.npy"), args.epochs, args.batch, steps_per_epoch,
        1e9, sld.SHAPE["d_model"], sld.SHAPE["layers"])
    curve = out["curve"]
    seconds = [c[0] - (curve[i - 1][0] if i else 0.0) for i, c in enumerate(curve)]
    return {"fit_wall_s": round(time.perf_counter() - started, 1), "curve": curve,
            "step_ms": [round(1e3 * s / steps_per_epoch, 1) for s in seconds], "val_loss": curve[-1][2]}


def driver(args: argparse.Namespace) -> None:
    import cloudpickle
    import numpy as np
    from pyspark import cloudpickle as spark_cloudpickle
    from pyspark.sql import SparkSession

    import language_model
    import slow_links_driver as sld
    from sparkdl.datasets.images_text import _tokens_dataframe, text_token_arrays

    sld.SHAPE.update(d_model=args.d_model, layers=args.layers)
    for pickler in (cloudpickle, spark_cloudpickle):
        pickler.register_pickle_by_value(language_model)
        pickler.register_pickle_by_value(sld)
    spark = (SparkSession.builder.master(args.master).appName("sparkdl-dp-fit-bed")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.executor.cores", "1").config("spark.task.cpus", "1").config("spark.executor.memory", "1g")
             .config("spark.cores.max", str(args.workers)).config("spark.scheduler.minRegisteredResourcesRatio", "1.0")
             .config("spark.executorEnv.GLOO_SOCKET_IFNAME", "eth0").getOrCreate())
    shared = Path(args.shared)
    result: dict[str, Any] = {}
    try:
        tokens, targets = text_token_arrays(sld.SEQ_LEN, args.train_rows + 256)
        order = np.random.default_rng(0).permutation(len(tokens))
        tokens, targets = tokens[order], targets[order]
        windows = np.concatenate([tokens, targets[:, -1:]], axis=1)
        np.save(shared / "train.npy", windows[: args.train_rows])
        np.save(shared / "eval.npy", windows[args.train_rows:])
        train = _tokens_dataframe(spark, tokens[: args.train_rows], targets[: args.train_rows]) \
            .repartition(args.workers).cache()
        evaluation = _tokens_dataframe(spark, tokens[args.train_rows:], targets[args.train_rows:]).cache()
        train.count(), evaluation.count()
        steps_per_epoch = args.train_rows // args.workers // args.batch
        result["steps_per_epoch"] = steps_per_epoch
        for name in args.rows.split(","):
            if name == "ddp":
                result[name] = ddp_row(spark, shared, args, steps_per_epoch)
            elif name == "sparkdl_auto":
                result[name] = auto_row(spark, train, evaluation, args)
            else:
                result[name] = sparkdl_row(spark, train, evaluation, args, row_options(name))
            print(f"[dp_fit_bed] {name}: {json.dumps(result[name])}", file=sys.stderr, flush=True)
            Path(args.out).write_text(json.dumps(result))  # what finished survives a timeout
    finally:
        spark.stop()
        Path(args.out).write_text(json.dumps(result))


def controller(args: argparse.Namespace) -> None:
    import multihost

    why = multihost.why_not()
    if why:
        raise SystemExit(f"dp_fit_bed needs the multi-host bed: {why}")
    root = Path("/var/tmp") / f"sparkdl-dp-fit-{os.getpid()}"
    shutil.rmtree(root, ignore_errors=True)
    started, load_before = time.time(), os.getloadavg()
    rate = RATES[args.link]
    try:
        with multihost.Bed(root, workers=args.workers, rates={n: rate for n in range(1, args.workers + 1)},
                           worker_cores=1, worker_memory="2g") as bed:
            out = bed.shared / "dp_fit.json"
            argv = [sys.executable, str(Path(__file__).resolve()), "--driver", bed.master_url, "--out", str(out),
                    "--shared", str(bed.shared)]
            for key in ("workers", "train_rows", "batch", "epochs", "d_model", "layers", "rows"):
                argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
            argv += ["--auto-epochs", str(args.auto_epochs)]
            # A neighbour on every worker host: a busy loop inside its namespace, for the whole run.
            hogs = [bed.start_on(host, [sys.executable, "-c", "while True: pass"], "hog")
                    for host in bed.workers] if args.load == "hog" else []
            try:
                done = bed.run_on(bed.driver, argv + (["--no-overlap"] if args.no_overlap else []),
                                  timeout=args.timeout)
            finally:
                for hog in hogs:
                    multihost.kill_group(hog.process)  # by its PID (its own session), nothing else
            sys.stderr.write(done.stderr[-4000:])
            if not out.exists():
                raise SystemExit(f"the driver wrote nothing (rc {done.returncode})")
            raw = json.loads(out.read_text())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary: dict[str, Any] = {"benchmark": "dp_fit_bed", "link": args.link, "load": args.load, "workers": args.workers,
                               "model": f"GPT d={args.d_model} {args.layers} blocks", "batch_per_rank": args.batch,
                               "overlap_grads": not args.no_overlap, **raw}
    if "ddp" in raw and "sparkdl_dp" in raw:
        # Epoch 1 also streams the partition in: the later epochs are the steady state.
        ours, theirs = raw["sparkdl_dp"]["step_ms"][1:], raw["ddp"]["step_ms"][1:]
        summary["ratio_steady"] = round(statistics.median(ours) / statistics.median(theirs), 3) if ours else None
        summary["ratio_epoch1"] = round(raw["sparkdl_dp"]["step_ms"][0] / raw["ddp"]["step_ms"][0], 3)
    if "ddp" in raw and "sparkdl_auto" in raw:
        # DDP reaches its own final loss at the end of its run (TorchDistributor's start included);
        # auto at the end of its first epoch at or below it (planning and start included).
        target, ddp_s = raw["ddp"]["val_loss"], raw["ddp"]["fit_wall_s"]
        auto_s = time_to(raw["sparkdl_auto"]["curve"], target)
        summary["to_ddp_loss"] = {"target_val_loss": target, "ddp_s": ddp_s, "auto_s": auto_s,
                                  "auto_sooner": round(ddp_s / auto_s, 2) if auto_s else None,
                                  "auto_chose": raw["sparkdl_auto"]["chosen"], "target_sooner": 5.0}
    summary.update(seconds=round(time.time() - started, 1), loadavg_start=[round(x, 2) for x in load_before],
                   loadavg_end=[round(x, 2) for x in os.getloadavg()])
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link", choices=tuple(RATES), default="20mbit")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--train-rows", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rows", default="sparkdl_dp,ddp")
    parser.add_argument("--no-overlap", action="store_true")
    parser.add_argument("--auto-epochs", type=int, default=0, help="sparkdl_auto's epochs (default: 2 x --epochs)")
    parser.add_argument("--load", choices=("quiet", "hog"), default="quiet")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", default="")
    parser.add_argument("--driver", default="", help="(internal) run as the bed's driver against this master")
    parser.add_argument("--shared", default="")
    args = parser.parse_args()
    args.auto_epochs = args.auto_epochs or 2 * args.epochs
    if args.driver:
        args.master = args.driver
        driver(args)
    else:
        controller(args)


if __name__ == "__main__":
    main()
