"""The driver side of benchmarks/planner_accuracy_bed.py: runs on the multi-host bed's driver host,
asks the benchmark process (which owns the links and the hogs) to set each link and load, and
measures every cell of the matrix on one SparkSession.

One cell = (model, link, load) on this bed's worker hosts:
1. `sparkdl.plan(strategy="auto")` --repeats times, each on a fresh calibration (its own
   SPARKDL_CACHE_DIR), as the first fit of a session would plan: the choices, to see they repeat.
2. A data parallel fit (--epochs short epochs, val loss after each): its measured step time and its
   final val loss, the cell's target loss.
3. The first plan's choice trained with exactly that plan (TorchEstimator(plan=...)) until its val
   loss reaches data parallel's final one (at most --cap-epochs x --epochs epochs): its step time
   and the steps it needed. Skipped when the choice is data parallel (2. is it).
4. Up to --verify rivals, each the candidate whose estimated time to that loss (data parallel's
   steps x the planner's steps factor x its predicted step) beats the choice's measured one by more
   than 10 %, trained the same way with its options: a verdict against auto rests on measurements.
Both fits run with replan="off": the step time measured is the planned candidate's.

With --plan-epochs P > --epochs, the runs judged are P epochs long (what the planner is told, so its
short-run rule sees a run of that length) while each cell still trains only --epochs for its step
times: a candidate's steps to the loss do not depend on the link or the load (the same rows, seed
and updates), only its step time does. So each model's references are trained once, at the first
(fastest: links run fastest first) cell that needs them - data parallel for P epochs (its final val
loss is the target for every cell of the model), and each choice or rival up to --cap-epochs x P
epochs to that target - and every other cell measures the step time alone. Such runs are marked
"steps_from": "an earlier cell".
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "examples"), str(HERE.parent / "tests" / "support")]

import bed_driver  # noqa: E402 - the bed's ask() (tests/support)
import language_model  # noqa: E402 - the GPT of examples/language_model.py

SEQ_LEN, HEADS, FEATURES, CLASSES = 64, 4, 64, 10
FEATURE_COLS = [f"f{i}" for i in range(FEATURES)]
# name -> (kind, shape): the MLP is wide enough that its 1.2 MB of fp32 gradients bind at 20 Mbit/s;
# gpt_small is the 137k-parameter GPT, gpt_large slow_links.py's (d=128).
MODELS = {"mlp": ("mlp", (512, 512)), "gpt_small": ("gpt", (64, 2)), "gpt_large": ("gpt", (128, 2))}
LOADS = ("quiet", "hog")


def mlp(hidden: tuple[int, int] = (512, 512)) -> Any:
    from torch import nn

    return nn.Sequential(nn.Linear(FEATURES, hidden[0]), nn.ReLU(), nn.Linear(hidden[0], hidden[1]), nn.ReLU(),
                         nn.Linear(hidden[1], CLASSES))


def factory(name: str) -> Callable[[], Any]:
    kind, shape = MODELS[name]
    if kind == "mlp":
        return lambda: mlp(shape)
    return lambda: language_model.gpt(shape[0], shape[1], HEADS, SEQ_LEN)


def mlp_frames(spark: Any, train_rows: int, eval_rows: int, workers: int, long_rows: int = 0) -> tuple[Any, ...]:
    """Rows labelled by a fixed random teacher (a tanh layer, no label noise): the loss keeps falling
    over the few hundred steps a cell trains instead of the val loss turning up on repeated rows.
    With `long_rows`, also a training frame of that many rows whose first `train_rows` are the short
    one's (the same teacher and held-out rows)."""
    import numpy as np

    rng = np.random.default_rng(0)
    total = max(train_rows, long_rows)
    x = rng.normal(size=(train_rows + eval_rows, FEATURES)).astype("float32")
    teacher = (rng.normal(size=(FEATURES, 32)), rng.normal(size=(32, CLASSES)))  # drawn as before --long
    if total > train_rows:
        extra = np.random.default_rng(1).normal(size=(total - train_rows, FEATURES)).astype("float32")
        x = np.concatenate([x[:train_rows], extra, x[train_rows:]])
    y = np.argmax(np.tanh(x @ teacher[0]) @ teacher[1], axis=1)
    rows = [(*map(float, r), int(t)) for r, t in zip(x, y)]
    columns = FEATURE_COLS + ["label"]
    evaluation = spark.createDataFrame(rows[total:], columns).cache()
    frames = [spark.createDataFrame(rows[:n], columns).repartition(workers).cache()
              for n in ([train_rows, long_rows] if long_rows else [train_rows])]
    return (frames[0], evaluation, *frames[1:])


def gpt_frames(spark: Any, train_rows: int, eval_rows: int, workers: int, long_rows: int = 0) -> tuple[Any, ...]:
    """Byte windows of the standard library's source, shuffled; with `long_rows`, also a training
    frame of that many (distinct) windows whose first `train_rows` are the short one's."""
    import numpy as np
    from sparkdl.datasets.images_text import _tokens_dataframe, text_token_arrays

    total = max(train_rows, long_rows)
    tokens, targets = text_token_arrays(SEQ_LEN, train_rows + eval_rows)
    order = np.random.default_rng(0).permutation(len(tokens))
    tokens, targets = tokens[order], targets[order]
    held = tokens[train_rows:], targets[train_rows:]
    if total > train_rows:  # windows after the first ones: none of them held out or repeated
        more_tokens, more_targets = text_token_arrays(SEQ_LEN, total + eval_rows)
        more = np.random.default_rng(1).permutation(np.arange(train_rows + eval_rows, len(more_tokens)))
        more = more[:total - train_rows]
        tokens = np.concatenate([tokens[:train_rows], more_tokens[more]])
        targets = np.concatenate([targets[:train_rows], more_targets[more]])
    evaluation = _tokens_dataframe(spark, *held).cache()
    frames = [_tokens_dataframe(spark, tokens[:n], targets[:n]).repartition(workers).cache()
              for n in ([train_rows, long_rows] if long_rows else [train_rows])]
    return (frames[0], evaluation, *frames[1:])


def options_for(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The options every run of the model shares (the planner sees the same ones the fits use)."""
    common = {"num_workers": args.workers, "seed": 0, "progress": False, "tracking": False, "replan": "off",
              # The emulated hosts have one core each (as slow_links.py): one torch thread a rank.
              "threads_per_worker": 1}
    if MODELS[name][0] == "mlp":
        return {**common, "feature_cols": FEATURE_COLS, "label_col": "label", "loss": "cross_entropy",
                "optimizer": "adam", "lr": 1e-3, "batch_size": args.mlp_batch}
    return {**common, "input_cols": ["tokens"], "label_col": "targets", "loss": "cross_entropy",
            "optimizer": "adamw", "lr": 3e-3, "batch_size": args.gpt_batch}


def exact(candidate: Any) -> bool:
    return candidate.strategy not in ("diloco", "islands", "ist")


def step_time(history: list[dict[str, Any]], approximate: bool) -> dict[str, Any]:
    """The measured seconds a step after the warm-up epoch: the median of the epochs' step times,
    and the mean over those epochs (an approximate strategy's outer syncs land in some epochs only:
    its prediction is the mean over sync periods, so it is compared with the mean). The mean leaves
    out the fit's final write-back (DiLoCo's last outer sync, IST's last allgather: strategy.finish(),
    in the last epoch's wall beyond its steps), a once-a-fit cost like the warm-up epoch's: in a
    48-step window it was a third sync where the run syncs every 30 steps."""
    timed = history[1:] or history
    per_epoch = [float(r["seconds"]) / max(int(r["steps"]), 1) for r in timed]
    final = final_write_back_s(timed)
    mean = (sum(float(r["seconds"]) for r in timed) - final) / max(sum(int(r["steps"]) for r in timed), 1)
    median = statistics.median(per_epoch)
    return {"median_s": round(median, 6), "mean_s": round(mean, 6), "measured_s": round(mean if approximate else median, 6),
            "timed_epochs": len(timed), "final_write_back_s": round(final, 4), "split_ms": [step_split(r) for r in timed]}


def final_write_back_s(timed: list[dict[str, Any]]) -> float:
    """The last epoch's wall beyond its steps, less what the other epochs' walls held beyond theirs."""
    if len(timed) < 2:
        return 0.0
    return max(epoch_parts_s(timed[-1])["rest"] - statistics.median(epoch_parts_s(r)["rest"] for r in timed[:-1]), 0.0)


def epoch_parts_s(record: dict[str, Any]) -> dict[str, float]:
    """An epoch's wall in seconds (slowest rank's parts): computing, blocked in collectives, waiting
    for data, and the rest (the loop, the epoch's ends)."""
    compute = max(record.get("compute_seconds_by_rank", ()) or (0.0,))
    wait = max(record.get("wait_seconds_by_rank", ()) or (0.0,))
    data = float(record.get("data_seconds", 0.0))
    seconds = float(record["seconds"])
    return {"step": seconds, "compute": compute, "wait": wait, "data": data, "rest": seconds - compute - wait - data}


def step_split(record: dict[str, Any]) -> dict[str, float]:
    """Where an epoch's step went (ms a step): epoch_parts_s over its steps."""
    steps = max(int(record["steps"]), 1)
    return {name: round(1e3 * value / steps, 2) for name, value in epoch_parts_s(record).items()}


def fit(model: Callable[[], Any], train: Any, evaluation: Any, options: dict[str, Any], epochs: int,
        target: float | None = None, plan: Any = None) -> dict[str, Any]:
    """One fit; stops at the end of the epoch whose val loss reaches `target`."""
    from sparkdl import TorchEstimator

    def stop_at_target(record: dict[str, Any]) -> str | None:
        return "stop" if target is not None and float(record.get("val_loss", float("inf"))) <= target else None

    started = time.perf_counter()
    fitted = TorchEstimator(model=model, validation_df=evaluation, epochs=epochs, callbacks=[stop_at_target],
                            plan=plan, **options).fit(train)
    history = [dict(r) for r in fitted.history]
    steps, curve = 0, []
    for record in history:
        steps += int(record["steps"])
        curve.append([steps, round(float(record["val_loss"]), 5)])
    return {"fit_wall_s": round(time.perf_counter() - started, 2), "steps": steps, "curve": curve,
            "train_s": round(sum(float(r["seconds"]) for r in history), 3), "history": history,
            "plan": fitted.plan.strategy if fitted.plan is not None else ""}


def plan_once(model: Callable[[], Any], train: Any, options: dict[str, Any], epochs: int, cache: Path) -> dict[str, Any]:
    import sparkdl

    os.environ["SPARKDL_CACHE_DIR"] = str(cache)  # a fresh calibration: measured now, as a new session would
    started = time.perf_counter()
    resolved = sparkdl.plan(model, train, epochs=epochs, strategy="auto", **options)
    seconds = time.perf_counter() - started
    auto = resolved.auto
    candidates = [{"label": c.label, "strategy": c.strategy, "options": plain(c.config_options()),
                   "feasible": c.feasible, "exact": exact(c),
                   "predicted_step_s": c.predicted_step_s, "steps_factor": getattr(c, "steps_factor", 1.0),
                   "steps_rule": getattr(c, "steps_rule", ""), "comm_s": c.comm_s, "compute_s": c.compute_s,
                   "reason": c.reason} for c in auto.candidates]
    return {"resolved": resolved, "plan_s": round(seconds, 2), "chosen": auto.choice.label, "candidates": candidates,
            "bandwidth_Bps": auto.bandwidth_Bps, "latency_s": auto.latency_s, "hinge": getattr(auto, "hinge", ""),
            "explain": resolved.explain() if hasattr(resolved, "explain") else auto.explain()}


def say(text: str) -> None:
    print(f"[planner_accuracy_bed] {text}", file=sys.stderr, flush=True)


def plain(options: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(options, default=list))


def first_at(curve: list[list[float]], target: float) -> int | None:
    return next((int(steps) for steps, loss in curve if loss <= target), None)


def to_loss_s(run: dict[str, Any], target: float) -> float | None:
    """A measured run's seconds to `target`: the steps it needed (this run's, or its model's
    reference) x its measured step (None: never)."""
    steps = run["steps_to_target"] if "steps_to_target" in run else first_at(run["curve"], target)
    return None if steps is None else steps * run["step"]["measured_s"]


def estimated_s(candidate: dict[str, Any], dp_steps: int) -> float:
    """An unmeasured candidate's: data parallel's steps x the planner's steps factor x its predicted step."""
    return dp_steps * candidate["steps_factor"] * candidate["predicted_step_s"]


def doubtful(candidates: list[dict[str, Any]], runs: dict[str, Any], chosen: str, target: float,
             dp_steps: int) -> dict[str, Any] | None:
    """The unmeasured candidate whose estimate beats the choice's measured time to the loss by more
    than 10 % (the verdict would rest on an estimate): the lowest such, or None."""
    mine = to_loss_s(runs[chosen], target)
    rivals = [c for c in candidates if c["feasible"] and c["label"] not in runs
              and (mine is None or estimated_s(c, dp_steps) * 1.10 < mine)]
    return min(rivals, key=lambda c: estimated_s(c, dp_steps)) if rivals else None


def measure_run(model: Callable[[], Any], frames: tuple[Any, Any], options: dict[str, Any], args: argparse.Namespace,
                target: float, candidate: dict[str, Any], plan: Any, reference: dict[str, Any]) -> dict[str, Any]:
    """`candidate` with exactly `plan` (the choice), else with the candidate's options (a rival, planned
    by its name as a user would): trained to `target` (at most --cap-epochs x the judged epochs) where
    the model's references lack its steps to the target, else for --epochs to time its step."""
    run_options = options if plan is not None else {**options, **candidate["options"]}
    known = candidate["label"] in reference["steps"]
    epochs = args.epochs if known else args.cap_epochs * judged_epochs(args)
    try:
        ran = fit(model, *(frames[:2] if known else judged(frames)), run_options, epochs,
                  target=None if known else target, plan=plan)
    except Exception as exc:  # noqa: BLE001 - reported in the cell
        return {"error": f"{type(exc).__name__}: {exc}", "rival": plan is None}
    ran["step"] = step_time(ran.pop("history"), approximate=not candidate["exact"])
    if not known:
        reference["steps"][candidate["label"]] = first_at(ran["curve"], target)
    ran["steps_to_target"] = reference["steps"][candidate["label"]]
    ran["steps_from"] = "an earlier cell" if known else "this cell"
    return {**ran, "rival": plan is None}


def judged_epochs(args: argparse.Namespace) -> int:
    """The epochs of the run the planner is told of and the verdicts judge: --epochs over the cell's
    rows, or under --plan-epochs --long-passes over rows that many times fewer passes need (so a
    256-step run repeats each row 4 times, not 16: the approximate strategies drift on rows seen
    16 times before they catch up)."""
    return args.long_passes if long_run(args) else args.epochs


def long_run(args: argparse.Namespace) -> bool:
    return args.plan_epochs > args.epochs


def judged(frames: tuple[Any, ...]) -> tuple[Any, Any]:
    """(training rows, held-out rows) of the judged run: the long frame where there is one."""
    return (frames[2], frames[1]) if len(frames) > 2 else (frames[0], frames[1])


def dp_reference(model: Callable[[], Any], frames: tuple[Any, Any], options: dict[str, Any],
                 args: argparse.Namespace, short: dict[str, Any], reference: dict[str, Any]) -> None:
    """The model's target (data parallel's best val loss over the judged epochs, within
    --loss-tolerance: exact runs of the same rows land on one of two data orders ~1 % apart) and
    data parallel's steps to it: from `short` when the judged run is that one, else one long fit."""
    if reference.get("target") is not None:
        return
    long = fit(model, *judged(frames), {**options, "strategy": "data_parallel"}, judged_epochs(args)) \
        if long_run(args) else short
    # Its best val loss over the judged run (its final one while the loss keeps falling): over many
    # epochs of a cell's few rows the MLP's val loss turns up again (16 epochs: 1.71 at 48 steps, 2.46
    # at 256), and a target above the first epoch's loss would be reached by everything at once.
    best = min(loss for _, loss in long["curve"])
    reference["target"] = best * (1 + args.loss_tolerance)
    reference["dp_final_val_loss"] = long["curve"][-1][1]
    reference["dp_best_val_loss"] = best
    reference["steps"]["data_parallel"] = first_at(long["curve"], reference["target"])
    reference["dp_curve"] = long["curve"]


def measure_cell(name: str, frames: tuple[Any, Any], args: argparse.Namespace, cell: str,
                 reference: dict[str, Any]) -> dict[str, Any]:
    """Plans (--repeats), data parallel, the choice, and up to --verify rivals whose estimates would
    beat the choice (so a verdict against auto rests on measured runs)."""
    model, options = factory(name), options_for(name, args)
    train, evaluation = frames[:2]
    plans = []
    for r in range(args.repeats):
        plans.append(plan_once(model, judged(frames)[0], options, judged_epochs(args),
                               args.shared / "calibration" / f"{cell}-{r}".replace("/", "-")))
        say(f"{cell}: plan {r + 1} chose {plans[-1]['chosen']} in {plans[-1]['plan_s']} s")
    first = plans[0]
    dp = fit(model, train, evaluation, {**options, "strategy": "data_parallel"}, args.epochs)
    dp["step"] = step_time(dp.pop("history"), approximate=False)
    dp_reference(model, frames, options, args, dp, reference)
    target, dp_steps = reference["target"], reference["steps"]["data_parallel"]
    dp["steps_to_target"], dp["steps_from"] = dp_steps, "the model's reference run"
    say(f"{cell}: data_parallel {dp['steps']} steps, {dp['train_s']} s, curve {dp['curve']}; target {target:.5f} "
        f"at {dp_steps} steps")
    by_label = {c["label"]: c for c in first["candidates"]}
    runs: dict[str, Any] = {"data_parallel": dp}
    if first["chosen"] not in runs:
        runs[first["chosen"]] = measure_run(model, frames, options, args, target, by_label[first["chosen"]],
                                            first["resolved"], reference)
        say(f"{cell}: chosen {first['chosen']} {json.dumps(runs[first['chosen']])[:300]}")
    for _ in range(args.verify):
        if "error" in runs[first["chosen"]]:
            break
        rival = doubtful(first["candidates"], runs, first["chosen"], target, dp_steps)
        if rival is None:
            break
        runs[rival["label"]] = measure_run(model, frames, options, args, target, rival, None, reference)
        say(f"{cell}: rival {rival['label']} {json.dumps(runs[rival['label']])[:300]}")
    return {"cell": cell, "model": name, "target_val_loss": round(target, 5),
            "dp_final_val_loss": reference["dp_final_val_loss"], "dp_steps": dp_steps, "judged_epochs":
            judged_epochs(args), "runs": runs, "plans": [{k: v for k, v in p.items() if k != "resolved"} for p in plans]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("master")
    parser.add_argument("out", type=Path)
    parser.add_argument("--shared", type=Path, required=True)
    parser.add_argument("--ask", required=True)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--links", default="20,100,1000", help="Mbit/s of every worker host's link")
    parser.add_argument("--loads", default=",".join(LOADS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4, help="data parallel's epochs (the first is warm-up)")
    parser.add_argument("--plan-epochs", type=int, default=0,
                        help="the judged run's length in epochs of the cell's rows, when more than --epochs "
                             "(references trained once a model, on rows --plan-epochs / --long-passes times as many)")
    parser.add_argument("--long-passes", type=int, default=4,
                        help="passes over its rows a --plan-epochs run makes (validation after each)")
    parser.add_argument("--steps-per-epoch", type=int, default=16)
    parser.add_argument("--cap-epochs", type=int, default=3, help="the choice trains at most this x --epochs")
    parser.add_argument("--mlp-batch", type=int, default=32)
    parser.add_argument("--gpt-batch", type=int, default=8)
    parser.add_argument("--verify", type=int, default=2,
                        help="at most this many rivals measured whose estimates would beat the choice by > 10 %%")
    parser.add_argument("--loss-tolerance", type=float, default=0.02, help="the target: DP's final val loss x (1 + this)")
    parser.add_argument("--eval-rows", type=int, default=256)
    args = parser.parse_args()
    bed_driver.ASK["dir"] = args.ask
    import cloudpickle
    from pyspark import cloudpickle as spark_cloudpickle
    from pyspark.sql import SparkSession

    for pickler in (cloudpickle, spark_cloudpickle):  # executors cannot import examples/
        pickler.register_pickle_by_value(language_model)
    spark = (SparkSession.builder.master(args.master).appName("sparkdl-planner-accuracy-bed")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.executor.cores", "1").config("spark.task.cpus", "1").config("spark.executor.memory", "1g")
             .config("spark.cores.max", str(args.workers))
             .config("spark.scheduler.minRegisteredResourcesRatio", "1.0")
             .config("spark.scheduler.maxRegisteredResourcesWaitingTime", "120s").getOrCreate())
    results: dict[str, Any] = {"workers": args.workers, "cells": [], "started": time.time(),
                               "settings": {k: v for k, v in vars(args).items() if isinstance(v, (int, str))}}
    try:
        for name in [m for m in args.models.split(",") if m]:
            batch = args.mlp_batch if MODELS[name][0] == "mlp" else args.gpt_batch
            rows = args.steps_per_epoch * args.workers * batch
            long_rows = rows * args.plan_epochs // args.long_passes if long_run(args) else 0
            frames = (mlp_frames if MODELS[name][0] == "mlp" else gpt_frames)(spark, rows, args.eval_rows, args.workers,
                                                                             long_rows)
            reference: dict[str, Any] = {"steps": {}}  # this model's steps to its target (see the docstring)
            for mbit in sorted((float(m) for m in args.links.split(",") if m), reverse=True):
                bed_driver.ask({"do": "network", "mbit": mbit})
                for load in [x for x in args.loads.split(",") if x]:
                    hogs = bed_driver.ask({"do": "hog", "on": load == "hog"})
                    cell = f"{name}/{args.workers}h/{mbit:g}mbit/{load}"
                    started = time.monotonic()
                    try:
                        row = measure_cell(name, frames, args, cell, reference)
                    except Exception as exc:  # noqa: BLE001 - reported; the next cell still runs
                        row = {"cell": cell, "model": name, "error": f"{type(exc).__name__}: {exc}",
                               "trace": traceback.format_exc()[-2500:]}
                    row.update(hosts=args.workers, link_mbit=mbit, load=load, hog_pids=hogs.get("pids", []),
                               cell_s=round(time.monotonic() - started, 1), loadavg=list(os.getloadavg()))
                    results["cells"].append(row)
                    print(f"[planner_accuracy_bed] {json.dumps(row)[:600]}", file=sys.stderr, flush=True)
                    args.out.write_text(json.dumps(results, indent=1))
            bed_driver.ask({"do": "hog", "on": False})
    finally:
        args.out.write_text(json.dumps(results, indent=1))
        spark.stop()


if __name__ == "__main__":
    main()
