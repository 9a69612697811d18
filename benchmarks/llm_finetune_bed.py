"""benchmarks/llm_finetune.py --mode bed: a LoRA fine-tune on the multi-host bed (issue 51).

W worker hosts (network namespaces with their own addresses, links shaped with tbf at --mbit;
tests/support/multihost.py; one Spark core and one rank each, on this machine's cores), a standalone
master, the driver on a host of its own. `bed_mode` (the test process) starts the bed, carries out
the driver's requests (benchmarks/recsys_bed.CounterController: {"do": "counters"}, what each worker
host's link carried) and runs this file on the driver host (`driver` below), which:

1. runs the Trainer (pyspark's TorchDistributor, local_mode=False, Trainer with DDP over gloo) on a
   LoRA of the GPT-2 for E*S steps; its target is the held-out loss its model ends with; its time
   is from `run` to the end of its last step (process start, tokenizing and DDP set-up included);
2. fits sparkdl strategy="auto" on the same rows, model, batch and lr, with the held-out texts as
   validation_df, stopping at the first epoch whose held-out loss is at or below the target (at
   most --max-epochs-x times the Trainer's epochs); its time is from fit start to that epoch's end.
Bytes per step: the worker hosts' sent bytes (their switch ports' counters) between the end of the
first pass and the end of the last, / steps / W (the Trainer: read by rank 0 at steps S and E*S).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE), str(HERE.parent / "tests" / "support")]

import llm_finetune_parts as parts  # noqa: E402


def bed_mode(opts: dict[str, Any]) -> dict[str, Any]:
    """Start the bed, run the driver on it, stop everything; the figures."""
    import multihost
    from recsys_bed import CounterController

    why = multihost.why_not()
    if why:
        raise SystemExit(f"llm_finetune --mode bed needs the multi-host bed: {why}")
    root = Path("/var/tmp") / f"sparkdl-llm-{os.getpid()}"
    shutil.rmtree(root, ignore_errors=True)
    rate = int(opts["mbit"] * 1e6)
    try:
        with multihost.Bed(root, workers=opts["world"], rates={n: rate for n in range(1, opts["world"] + 1)},
                           worker_cores=1, worker_memory="3g") as bed:
            out, ask = bed.shared / "llm.json", bed.shared / "ask"
            with CounterController(bed, ask):
                done = bed.run_on(bed.driver, [sys.executable, str(Path(__file__).resolve()), "driver",
                                               bed.master_url, str(out), "--shared", str(bed.shared), "--ask",
                                               str(ask), "--opts", json.dumps(opts)], timeout=opts["bed_timeout_s"])
            sys.stderr.write(done.stderr[-6000:])
            if not out.exists():
                raise SystemExit(f"the bed's driver wrote nothing (rc {done.returncode})")
            raw = json.loads(out.read_text())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"hosts": f"{opts['world']} worker hosts (1 core, 1 rank each, links {opts['mbit']:g} Mbit/s) + master + "
                     "driver, network namespaces on one machine", **summarise(raw, opts), "driver_rc": done.returncode,
            "raw": raw}


def _sent(links: dict[str, Any]) -> int:
    return sum(int(links["hosts"][a]["sent"]) for a in links["workers"])


def summarise(raw: dict[str, Any], opts: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    trainer, auto = raw.get("trainer", {}), raw.get("sparkdl_auto", {})
    if "held_out_loss" in trainer:
        links, steps = trainer["links"], opts["steps"] - opts["warm_steps"]
        out["trainer"] = {"final_held_out_loss": round(trainer["held_out_loss"], 4),
                          "time_to_final_loss_s": round(trainer["reached_s"], 1),
                          "train_runtime_s": round(trainer["train_runtime_s"], 1), "steps": opts["steps"],
                          "phases_s": {k: round(v, 1) for k, v in trainer.get("phases_s", {}).items()},
                          "trainable_parameters": trainer["trainable"]}
        if len(links) == 2:
            out["trainer"]["wire_bytes_per_step_per_rank"] = round(
                (_sent(links[str(opts["steps"])]) - _sent(links[str(opts["warm_steps"])])) / steps / opts["world"])
    else:
        out["trainer"] = {k: v for k, v in trainer.items() if k in ("error", "trace")}
    if "curve" in auto:
        row: dict[str, Any] = {"chose": auto["chose"], "options": auto["options"], "curve": auto["curve"],
                               "fit_wall_s": round(auto["fit_wall_s"], 1), "epochs": len(auto["curve"]),
                               "fit_phases_s": auto.get("fit_phases_s"), "time_to_first_step_s": auto.get("time_to_first_step_s")}
        target = out.get("trainer", {}).get("final_held_out_loss")
        reached = next((p for p in auto["curve"] if target is not None and p["val_loss"] <= target), None)
        row["time_to_trainer_loss_s"] = round(reached["at_s"], 1) if reached else None
        # Training alone (the epochs' seconds up to that point; no start-up, no validation)
        row["train_s_to_trainer_loss"] = round(sum(p["seconds"] for p in auto["curve"][: auto["curve"].index(reached) + 1]),
                                               2) if reached else None
        row["steps_to_trainer_loss"] = reached["steps_so_far"] if reached else None
        points = [p for p in auto["curve"] if p.get("links")]
        if len(points) > 1:
            steps = sum(p["steps"] for p in points[1:])
            row["wire_bytes_per_step_per_rank"] = round((_sent(points[-1]["links"]) - _sent(points[0]["links"]))
                                                        / steps / opts["world"])
            row["counted_bytes_per_step_per_rank"] = round(sum(p["bytes_sent_all_ranks"] for p in points[1:])
                                                           / steps / opts["world"])
        out["sparkdl_auto"] = row
        if reached and "time_to_final_loss_s" in out["trainer"]:
            sooner = out["trainer"]["time_to_final_loss_s"] / reached["at_s"]
            out["sooner_x"] = round(sooner, 2)
            out["target_met"] = {"time to the Trainer's final loss >= 3x sooner": sooner >= 3.0}
            out["sooner_x_training_only"] = round(trainer["train_runtime_s"] / max(row["train_s_to_trainer_loss"], 1e-9), 2)
        else:
            out["target_met"] = {"time to the Trainer's final loss >= 3x sooner": False}
    else:
        out["sparkdl_auto"] = {k: v for k, v in auto.items() if k in ("error", "trace")}
    return out


# -- on the bed's driver host ------------------------------------------------------------------
def run_trainer(opts: dict[str, Any], shared: Path, tokenizer: Any, train: list[str], held: list[str]) -> dict[str, Any]:
    started = time.time()
    out = parts.run_trainer(opts, shared, tokenizer, train, held)
    # Where the time went: launch (run to the train function's start on rank 0), set-up (tokenizing,
    # model, Trainer and DDP until on_train_begin), the steps.
    return {**out, "reached_s": out["last_step_at"] - started,
            "phases_s": {"launch": out["fn_started_at"] - started, "setup": out["train_began_at"] - out["fn_started_at"],
                         "steps": out["last_step_at"] - out["train_began_at"]}}


def run_auto(df: Any, validation: Any, tokenizer: Any, opts: dict[str, Any], target: float | None) -> dict[str, Any]:
    curve: list[dict[str, Any]] = []

    def on_epoch(record: dict[str, Any]) -> str | None:
        links = parts.ask(opts["ask"], {"do": "counters"})
        curve.append({"val_loss": float(record.get("val_loss", math.inf)), "loss": float(record["loss"]),
                      "steps": int(record["steps"]), "seconds": float(record["seconds"]),
                      "bytes_sent_all_ranks": int(record.get("bytes_sent_all_ranks", 0)), "links": links})
        return "stop" if target is not None and curve[-1]["val_loss"] <= target else None

    epochs = math.ceil(opts["max_epochs_x"] * opts["epochs"])
    fitted, ends, wall = parts.fit_sparkdl(df, tokenizer, opts, {"strategy": "auto"}, epochs, validation, on_epoch)
    done = 0
    for point, at in zip(curve, ends):
        done += point["steps"]
        point.update(at_s=round(at, 2), steps_so_far=done)
    plan = fitted.plan
    return {"curve": curve, "fit_wall_s": wall, "chose": plan.choice.label if plan and plan.choice else str(plan and plan.strategy),
            "options": {k: str(v) for k, v in (plan.options if plan else {}).items()},
            "explain": plan.explain() if plan is not None else "",
            "fit_phases_s": {k: round(v, 2) for k, v in fitted.fit_seconds.items()},
            "time_to_first_step_s": fitted.history[0].get("time_to_first_step_s")}


def driver() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("master")
    parser.add_argument("out", type=Path)
    parser.add_argument("--shared", type=Path, required=True)
    parser.add_argument("--ask", required=True)
    parser.add_argument("--opts", required=True)
    args = parser.parse_args(sys.argv[2:])
    opts = {**json.loads(args.opts), "ask": args.ask}
    from llm_finetune import register_by_value, text_frame
    from pyspark.sql import SparkSession

    register_by_value()
    spark = (SparkSession.builder.master(args.master).appName("sparkdl-llm-finetune")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.executor.cores", "1").config("spark.task.cpus", "1").config("spark.executor.memory", "2g")
             .config("spark.cores.max", str(opts["world"])).config("spark.driver.maxResultSize", "2g")
             .config("spark.sql.execution.arrow.pyspark.enabled", "true")
             .config("spark.scheduler.minRegisteredResourcesRatio", "1.0")
             .config("spark.scheduler.maxRegisteredResourcesWaitingTime", "120s")
             # TorchDistributor's gloo advertises what the host name resolves to (127.0.0.1 here) unless told.
             .config("spark.executorEnv.GLOO_SOCKET_IFNAME", "eth0").getOrCreate())
    results: dict[str, Any] = {}
    try:
        tokenizer, train, held = parts.make_corpus(opts)
        parts.check_one_block_each(tokenizer, train[: opts["batch"]], opts["block"])
        df, validation = text_frame(spark, train, opts["world"]), text_frame(spark, held, opts["world"])
        for name in ("trainer", "sparkdl_auto"):
            started = time.monotonic()
            try:
                if name == "trainer":
                    row = run_trainer(opts, args.shared, tokenizer, train, held)
                else:
                    row = run_auto(df, validation, tokenizer, opts, results["trainer"].get("held_out_loss"))
            except Exception as exc:  # noqa: BLE001 - reported; the next one still runs
                row = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-4000:]}
            row["wall_s"] = round(time.monotonic() - started, 1)
            results[name] = row
            args.out.write_text(json.dumps(results))
            print(f"[llm_finetune] {name}: {json.dumps(row)[:800]}", file=sys.stderr, flush=True)
    finally:
        spark.stop()


if __name__ == "__main__" and sys.argv[1:2] == ["driver"]:
    driver()
