"""Fine-tuning a causal LM on a text column: sparkdl against PySpark's TorchDistributor running Hugging
Face's `Trainer` (the path Databricks documents), side by side in one run on the same hosts, model,
data and steps (issue 51).

    .venv/bin/python benchmarks/llm_finetune.py --mode host [--repeats 3]
    sudo .venv/bin/python benchmarks/llm_finetune.py --mode bed [--world 2] [--mbit 100]

Both sides train the same GPT-2 built from a config (4 layers, n_embd 128 by default) under the
same seed, on the same texts (benchmarks/llm_finetune_parts.py: a made-up language, a byte-level
BPE tokenizer trained on it, every text exactly one block with its end-of-text token, so sparkdl's
packing and the Trainer's group_texts give the same blocks), with the same block size, batch per
rank, steps and AdamW (constant lr, no weight decay, no clipping), one torch thread a rank.

--mode host: local-cluster[2,1,...] on this machine (2 ranks). sparkdl: TorchEstimator(strategy=
  "data_parallel", input_cols=["text"], tokenizer=..., packing=True, loss="causal_lm") for E epochs of
  S steps; the Trainer: TorchDistributor(num_processes=2, local_mode=False) running Trainer (DDP over
  gloo) for max_steps E*S. tokens/s of the steady steps (sparkdl: epochs 2..E, their seconds;
  the Trainer: rank 0's clock from the end of step S to the end of step E*S), the median of
  --repeats rounds alternating which side runs first; the ratio sparkdl / Trainer (target >= 1.0).
--mode bed (benchmarks/llm_finetune_bed.py): the multi-host bed at --mbit; a LoRA fine-tune; the
  Trainer first, then sparkdl strategy="auto" until its held-out loss reaches the Trainer's final
  held-out loss: time to that loss from fit start (target >= 3x sooner), bytes per step on the
  worker hosts' links, and what auto chose.

Prints one JSON object as the last line (the load average before and after is in it: this machine
is shared) and writes it under benchmarks/results/. Nothing here asserts a timing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import llm_finetune_parts as parts  # noqa: E402

TARGETS = {"host_tokens_per_s_x": 1.0, "bed_sooner_x": 3.0}


def register_by_value() -> None:
    """benchmarks/ is not importable on the executors: its functions travel by value (sparkdl
    pickles with pyspark's cloudpickle, TorchDistributor with the cloudpickle package)."""
    import cloudpickle
    from pyspark import cloudpickle as spark_cloudpickle

    for pickler in (cloudpickle, spark_cloudpickle):
        pickler.register_pickle_by_value(parts)


def text_frame(spark: Any, texts: list[str], partitions: int) -> Any:
    df = spark.createDataFrame([(t,) for t in texts], "text string").repartition(partitions).cache()
    df.count()
    return df


def sparkdl_round(df: Any, tokenizer: Any, opts: dict[str, Any], held: Any) -> dict[str, Any]:
    fitted, ends, wall = parts.fit_sparkdl(df, tokenizer, opts, {"strategy": "data_parallel"}, opts["epochs"])
    history = fitted.history
    steady = history[1:]
    tokens = sum(int(r["samples"]) for r in steady) * opts["block"]
    seconds = sum(float(r["seconds"]) for r in steady)
    return {"tokens_per_s": tokens / seconds, "steady_steps": sum(int(r["steps"]) for r in steady),
            "steady_s": seconds, "fit_wall_s": wall, "epoch_losses": [float(r["loss"]) for r in history],
            "held_out_loss": parts.held_out_loss(fitted.torch_module(), held, opts["batch"]),
            # where the steady epochs' time went (the history's numbers: data waits, communication, ...)
            "steady_records": [{k: round(v, 4) for k, v in r.items() if isinstance(v, (int, float))} for r in steady],
            "bytes_sent_per_step_per_rank": sum(int(r.get("bytes_sent_all_ranks", 0)) for r in steady)
            / max(1, sum(int(r["steps"]) for r in steady)) / opts["world"]}


def trainer_round(opts: dict[str, Any], shared: Path, tokenizer: Any, train: list[str], held_texts: list[str]
                  ) -> dict[str, Any]:
    out = parts.run_trainer(opts, shared, tokenizer, train, held_texts)
    ends, warm = out["step_end_s"], opts["warm_steps"]
    steady_steps = len(ends) - warm
    seconds = ends[-1] - ends[warm - 1]
    tokens = steady_steps * opts["batch"] * opts["world"] * opts["block"]
    return {"tokens_per_s": tokens / seconds, "steady_steps": steady_steps, "steady_s": seconds,
            "run_wall_s": out["run_wall_s"], "train_runtime_s": out["train_runtime_s"],
            "logged_losses": [round(h["loss"], 4) for h in out["log"]], "held_out_loss": out["held_out_loss"],
            "world": out["world"]}


def host_mode(opts: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    register_by_value()
    from pyspark.sql import SparkSession

    tokenizer, train, held_texts = parts.make_corpus(opts)
    parts.check_one_block_each(tokenizer, train[: opts["batch"]], opts["block"])
    held = parts.blocks(tokenizer, held_texts)
    spark = (SparkSession.builder.master(f"local-cluster[{opts['world']},1,{opts['executor_mb']}]")
             .appName("sparkdl-llm-finetune").config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").config("spark.driver.memory", "2g")
             .config("spark.sql.execution.arrow.pyspark.enabled", "true").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    rounds: dict[str, list[dict[str, Any]]] = {"sparkdl": [], "trainer": []}
    try:
        df = text_frame(spark, train, opts["world"])
        with tempfile.TemporaryDirectory(prefix="sparkdl-llm-") as tmp:
            shared = Path(tmp)
            for round_ in range(opts["repeats"]):
                order = ["sparkdl", "trainer"] if round_ % 2 == 0 else ["trainer", "sparkdl"]
                for side in order:
                    row = (sparkdl_round(df, tokenizer, opts, held) if side == "sparkdl"
                           else trainer_round(opts, shared, tokenizer, train, held_texts))
                    rounds[side].append(row)
                    print(f"[llm_finetune] round {round_} {side}: {json.dumps(row)[:400]}", file=sys.stderr, flush=True)
    finally:
        spark.stop()
    return host_figures(rounds)


def host_figures(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians of the rounds, their ratio, and each round's own ratio (the two sides of a round ran
    back to back: the load they shared is closer than across rounds)."""
    median = {side: statistics.median(r["tokens_per_s"] for r in rows) for side, rows in rounds.items()}
    ratio = median["sparkdl"] / median["trainer"]
    paired = [round(a["tokens_per_s"] / b["tokens_per_s"], 3) for a, b in zip(rounds["sparkdl"], rounds["trainer"])]
    return {"tokens_per_s": {k: round(v, 1) for k, v in median.items()},
            "tokens_per_s_sparkdl_over_trainer": round(ratio, 3), "per_round_ratios": paired,
            "median_per_round_ratio": statistics.median(paired),
            "fit_wall_s": {"sparkdl": [round(r["fit_wall_s"], 1) for r in rounds["sparkdl"]],
                           "trainer_run": [round(r["run_wall_s"], 1) for r in rounds["trainer"]]},
            "target_met": {"tokens/s >= 1.0x": ratio >= TARGETS["host_tokens_per_s_x"]},
            "held_out_loss": {side: [round(r["held_out_loss"], 4) for r in rows] for side, rows in rounds.items()},
            "rounds": rounds}


def options(args: argparse.Namespace) -> dict[str, Any]:
    opts = {k: v for k, v in vars(args).items() if k not in ("out", "quick")}
    if args.quick:  # a smoke run: tiny model and few steps
        opts.update(layers=2, n_embd=64, heads=2, block=32, batch=4, steps_per_epoch=3, epochs=2, repeats=1,
                    held_out=16)
    if opts["mode"] == "bed":
        opts["lora"] = True
    opts["rows"] = opts["world"] * opts["steps_per_epoch"] * opts["batch"]
    opts["steps"] = opts["epochs"] * opts["steps_per_epoch"]
    opts["warm_steps"] = opts["steps_per_epoch"]
    return opts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("host", "bed"), default="host")
    parser.add_argument("--world", type=int, default=2, help="ranks (host) / worker hosts (bed)")
    parser.add_argument("--repeats", type=int, default=3, help="host: rounds (median)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--block", type=int, default=128, help="tokens a block (max_length)")
    parser.add_argument("--batch", type=int, default=8, help="blocks a rank a step")
    parser.add_argument("--steps-per-epoch", type=int, default=10, help="steps a rank per pass over the rows")
    parser.add_argument("--epochs", type=int, default=3, help="passes (the first is not timed); steps = epochs x S")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--words", type=int, default=300, help="the made-up language's words")
    parser.add_argument("--vocab", type=int, default=512, help="BPE vocabulary (at most)")
    parser.add_argument("--held-out", type=int, default=64, help="held-out texts (blocks)")
    parser.add_argument("--log-every", type=int, default=5, help="the Trainer's logging_steps")
    parser.add_argument("--lora", action="store_true", help="host: a LoRA fine-tune (bed: always)")
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--lora-targets", default="c_attn,c_proj,c_fc")
    parser.add_argument("--mbit", type=float, default=100.0, help="bed: every worker host's link")
    parser.add_argument("--max-epochs-x", type=float, default=3.0, help="bed: sparkdl's epoch cap, x the Trainer's")
    parser.add_argument("--bed-timeout-s", type=float, default=3000.0)
    parser.add_argument("--executor-mb", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a smoke run (tiny settings)")
    parser.add_argument("--out", type=Path, help="default benchmarks/results/llm_finetune_<mode>.json")
    args = parser.parse_args()
    opts = options(args)
    started, load_before = time.time(), os.getloadavg()
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    if opts["mode"] == "host":
        figures = host_mode(opts)
    else:
        import llm_finetune_bed

        figures = llm_finetune_bed.bed_mode(opts)
    result = {"benchmark": f"llm_finetune_{opts['mode']}", "config": opts, **figures,
              "seconds": round(time.time() - started, 1), "cpus": os.cpu_count(),
              "uptime_before": uptime,
              "uptime_after": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
              "loadavg_before": [round(x, 2) for x in load_before],
              "loadavg_after": [round(x, 2) for x in os.getloadavg()]}
    out = args.out or (None if args.quick else HERE / "results" / f"llm_finetune_{opts['mode']}.json")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
