"""What issue 44's hardening costs: the same fits on this tree and on the commit before it, side by side.

    .venv/bin/python benchmarks/hardening.py [--baseline 7b18a00] [--rounds 3] [--fits 3]

Each round runs one child process per tree (the baseline checked out with `git worktree` into a
temporary directory, this working tree as it is), alternating which goes first, each with its own
local[2] session: one warm-up fit, then --fits measured fits of each kind:
  fixed_cost_s     a warm 1-epoch digits fit (tracking on, a sqlite MLflow store): the whole
                   TorchEstimator.fit wall time (channel admission, private spool, redaction, typed
                   allgather, the store bound to one address, the non-finite check);
  epoch_s          the median epoch of a 4-epoch fit on 4 x the digits with checkpoints every 8 steps (checksums taken
                   while parts are written, 0600 files, the manifest checked on every read).
The figures are medians over rounds x fits; `ratio` is this tree over the baseline (1.0 = no cost).
Prints one JSON object as the last line. Nothing here asserts a timing; say the machine's load.
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

REPO = Path(__file__).resolve().parents[1]
BASELINE = "7b18a00"  # main before issue 44's first hardening commit


def child(repeats: int) -> dict[str, list[float]]:
    """One tree's fits (run with that tree first on sys.path)."""
    from pyspark.sql import SparkSession
    from torch import nn

    from sparkdl import TorchEstimator
    from sparkdl.datasets import DIGITS_FEATURE_COLS, digits_dataframe

    spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
    df = digits_dataframe(spark).repartition(2).cache()
    df.count()
    digits = df
    for _ in range(2):  # 4 x the digits (7,188 rows): epochs long enough to time, still a small fit
        digits = digits.union(digits)
    long_df = digits.repartition(2).cache()
    long_df.count()
    work = Path(tempfile.mkdtemp(prefix="sparkdl-bench-hardening-"))

    def mlp() -> Any:
        return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def fit(epochs: int, frame: Any = df, **options: Any) -> tuple[float, Any]:
        started = time.perf_counter()
        model = TorchEstimator(model=mlp, feature_cols=DIGITS_FEATURE_COLS, epochs=epochs, batch_size=32, num_workers=2,
                               strategy="data_parallel", progress=False, **options).fit(frame)
        return time.perf_counter() - started, model

    tracked = {"tracking_uri": f"sqlite:///{work}/mlflow.db", "experiment": "sparkdl-bench-hardening"}
    fit(1, **tracked)  # warm-up: Python workers, imports, MLflow tables
    figures: dict[str, list[float]] = {"fixed_cost_s": [], "epoch_s": []}
    for index in range(repeats):
        figures["fixed_cost_s"].append(fit(1, **tracked)[0])
        _, model = fit(4, long_df, tracking=False, checkpoint_dir=str(work / f"ckpt-{index}"), checkpoint_every=8)
        figures["epoch_s"].append(statistics.median(h["seconds"] for h in model.history))
    spark.stop()
    return figures


def baseline_tree(revision: str) -> Path:
    target = Path(tempfile.mkdtemp(prefix="sparkdl-baseline-")) / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(target), revision], check=True,
                   capture_output=True)
    return target


def run_child(tree: Path, fits: int) -> dict[str, list[float]]:
    env = {**os.environ, "PYTHONPATH": str(tree), "PYSPARK_PYTHON": sys.executable,
           "PYSPARK_DRIVER_PYTHON": sys.executable}
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "hardening.py"), "--child", "--fits", str(fits)],
                          cwd=str(tree), env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"the fits on {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=BASELINE)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fits", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        result = child(args.fits)
        print(json.dumps(result))
        return result
    base = baseline_tree(args.baseline)
    gathered: dict[str, dict[str, list[float]]] = {"baseline": {}, "hardened": {}}
    try:
        for round_index in range(args.rounds):
            order = [("baseline", base), ("hardened", REPO)]
            for name, tree in (order if round_index % 2 == 0 else order[::-1]):
                for key, values in run_child(tree, args.fits).items():
                    gathered[name].setdefault(key, []).extend(values)
                print(f"round {round_index + 1}/{args.rounds}: {name} done", file=sys.stderr, flush=True)
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], capture_output=True)
    result: dict[str, Any] = {"baseline_revision": args.baseline, "rounds": args.rounds, "fits": args.fits,
                              "load_1min": os.getloadavg()[0]}
    for key in ("fixed_cost_s", "epoch_s"):
        medians = {name: statistics.median(gathered[name][key]) for name in gathered}
        result[key] = {**{name: round(value, 4) for name, value in medians.items()},
                       "ratio": round(medians["hardened"] / medians["baseline"], 3),
                       "spread_hardened": [round(min(gathered["hardened"][key]), 4),
                                           round(max(gathered["hardened"][key]), 4)]}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
