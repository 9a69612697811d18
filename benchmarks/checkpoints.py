"""Checkpoint overhead benchmark: the language-model example's step time with checkpoints every 10
steps vs none, and what a synchronous save would have cost.

One SparkSession (--master, local[2] by default), the example's token DataFrame
(examples/language_model.py: bytes of the standard library's sources, `tokens`/`targets` columns)
cached and counted first, its GPT (`gpt(d_model, layers, heads, seq_len)`) trained by TorchEstimator
with 2 workers, AdamW, data parallel. Fits alternate NONE, EVERY_10, EVERY_10, NONE, ... (--rounds
pairs, the order flipped every round) so both settings see the same machine state; the step time is the second epoch's training
seconds / steps from each fit's history (epoch 1 spools and warms up; the epoch-end save falls
between the epochs, not inside either), and the figure compared is the median over rounds.

Also reported: per save, the training thread's stall (snapshot + waiting for the previous write +
the allgather) and the background write (serialise + write) that a synchronous save would have
stalled for, from the epoch records (slowest rank); and one synchronous save measured directly on
the driver (deep copy + torch.save + atomic write of the same model and AdamW state). The load
average (os.getloadavg) before and after says how busy the machine was.

Prints one JSON object and writes it to benchmarks/results/checkpoints.json. Asserts no timing.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))

TARGET_OVERHEAD = 1.05
RESULT = REPO / "benchmarks" / "results" / "checkpoints.json"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--rounds", type=int, default=3, help="NONE/EVERY_10 pairs of fits")
    parser.add_argument("--rows", type=int, default=3072)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--every", type=int, default=10, help="checkpoint_every of the checkpointed fits")
    parser.add_argument("--out", default=str(RESULT))
    return parser.parse_args()


def fit_once(df: Any, args: argparse.Namespace, checkpoint_dir: str | None) -> dict[str, Any]:
    """One fit; the second epoch's figures."""
    from language_model import gpt

    from sparkdl import TorchEstimator

    options: dict[str, Any] = dict(checkpoint_dir=checkpoint_dir, checkpoint_every=args.every) if checkpoint_dir else {}
    model = TorchEstimator(model=functools.partial(gpt, args.d_model, args.layers, 4, args.seq_len),
                           input_cols=["tokens"], label_col="targets", loss="cross_entropy",
                           strategy="data_parallel", optimizer="adamw", lr=3e-3, batch_size=args.batch_size,
                           epochs=2, num_workers=2, seed=0, progress=False, tracking=False, **options).fit(df)
    epoch = model.history[1]
    return {"step_s": epoch["seconds"] / epoch["steps"], "steps": epoch["steps"],
            **{k: epoch[k] for k in ("checkpoint_saves", "checkpoint_stall_s", "checkpoint_write_s") if k in epoch}}


def synchronous_save_s(args: argparse.Namespace, root: str) -> tuple[float, int]:
    """(seconds, bytes) of one synchronous save of the model and its AdamW state after a step, on the driver."""
    import torch
    from language_model import gpt

    from sparkdl.executor.checkpoint import CheckpointStore
    from sparkdl.executor.checkpoint_async import snapshot

    torch.manual_seed(0)
    model = gpt(args.d_model, args.layers, 4, args.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 256, (args.batch_size, args.seq_len))
    model(tokens).sum().backward()
    optimizer.step()
    store = CheckpointStore(root, "sync", 0)
    times = []
    for step in range(5):
        started = time.perf_counter()
        store.write_part(step, {"strategy": snapshot({"module": model.state_dict(), "optimizer": optimizer.state_dict()})})
        times.append(time.perf_counter() - started)
    return statistics.median(times), store.part(0, 0).fs.get_file_info(store.part(0, 0).path).size


def main() -> dict[str, Any]:
    args = parse_args()
    from pyspark.sql import SparkSession

    from sparkdl.datasets import text_tokens_dataframe

    os.environ["PYSPARK_PYTHON"] = sys.executable  # the workers run this venv's Python (torch, pyarrow)
    import language_model
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(language_model)  # examples/ is not on the workers' path
    load_before = os.getloadavg()
    spark = SparkSession.builder.master(args.master).config("spark.ui.enabled", "false").getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    df = text_tokens_dataframe(spark, seq_len=args.seq_len, max_rows=args.rows).repartition(2).cache()
    rows = df.count()
    runs: dict[str, list[dict[str, Any]]] = {"none": [], f"every_{args.every}": []}
    with tempfile.TemporaryDirectory(prefix="sparkdl-bench-ckpt-") as root:
        for round_ in range(args.rounds):
            order = ["none", f"every_{args.every}"][:: 1 if round_ % 2 == 0 else -1]  # neither always goes first
            for name in order:
                runs[name].append(fit_once(df, args, os.path.join(root, f"r{round_}") if name != "none" else None))
            print(json.dumps({"round": round_, **{k: v[-1] for k, v in runs.items()}}), file=sys.stderr, flush=True)
        sync_s, part_bytes = synchronous_save_s(args, os.path.join(root, "sync"))
    spark.stop()
    return report(args, rows, runs, sync_s, part_bytes, load_before, os.getloadavg())


def report(args: argparse.Namespace, rows: int, runs: dict[str, list[dict[str, Any]]], sync_s: float,
           part_bytes: int, load_before: tuple[float, ...], load_after: tuple[float, ...]) -> dict[str, Any]:
    checkpointed = runs[f"every_{args.every}"]
    median = {name: statistics.median(r["step_s"] for r in fits) for name, fits in runs.items()}
    per_save = {key: statistics.median(r[key] / max(r["checkpoint_saves"], 1) for r in checkpointed)
                for key in ("checkpoint_stall_s", "checkpoint_write_s")}
    ratio = median[f"every_{args.every}"] / median["none"]
    return {
        "benchmark": "checkpoints", "master": args.master, "workers": 2, "cpus": os.cpu_count(),
        "model": {"example": "examples/language_model.py gpt", "d_model": args.d_model, "layers": args.layers,
                  "seq_len": args.seq_len, "optimizer": "adamw", "batch_size": args.batch_size},
        "rows": rows, "rounds": args.rounds, "checkpoint_every": args.every,
        "steps_per_epoch": checkpointed[0]["steps"], "saves_in_epoch_2": checkpointed[0].get("checkpoint_saves"),
        "step_s": {name: [round(r["step_s"], 5) for r in fits] for name, fits in runs.items()},
        "median_step_s": {name: round(v, 5) for name, v in median.items()},
        "overhead_ratio": round(ratio, 4), "target_ratio": TARGET_OVERHEAD, "within_target": ratio <= TARGET_OVERHEAD,
        "per_save_s": {"training_thread_stall": round(per_save["checkpoint_stall_s"], 5),
                       "background_write": round(per_save["checkpoint_write_s"], 5),
                       "synchronous_save_measured_on_driver": round(sync_s, 5)},
        "part_bytes_rank0": part_bytes,
        "loadavg_before": [round(x, 2) for x in load_before], "loadavg_after": [round(x, 2) for x in load_after],
    }


if __name__ == "__main__":
    result = main()
    out = Path(parse_args().out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
