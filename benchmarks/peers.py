"""sparkdl side by side with the tools users would otherwise pick, in one run on one machine (issue 10).

Parts (each in benchmarks/peers_parts/, runnable alone):
  ingest   rows/s from one cached Spark DataFrame (1M rows x 64 float columns) into torch batches on 2
           ranks: sparkdl epoch 1 and epochs 2+, TorchDistributor's DataFrame loader, Petastorm
  launch   call -> first training step and no-op job: sparkdl, TorchDistributor, bare torchrun
  steps    step time of the same MLP and batch: sparkdl data parallel vs torchrun DDP
  horovod  the same Horovod training function: sparkdl's horovod backend vs horovodrun

Every figure is the median of --repeats rounds; each ratio is the median of per-round ratios (the two
sides measured back to back in the same round). Prints one JSON object as the last stdout line, writes
it to --json-out, draws --png and rewrites the table between markers in --docs. Needs the bench venv
(`make bench` creates .venv-bench with the peers and runs this). Nothing here asserts a timing.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(REPO))

import records  # noqa: E402
from peers_parts import common, report  # noqa: E402

PARTS = {"ingest": "peers_parts.ingest", "launch": "peers_parts.launch", "steps": "peers_parts.steps",
         "horovod": "peers_parts.horovod_steps"}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from {sorted(PARTS)}")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; figures are medians over them")
    parser.add_argument("--rows", type=int, default=1_000_000, help="ingest: DataFrame rows")
    parser.add_argument("--features", type=int, default=64, help="ingest: float columns")
    parser.add_argument("--batch-size", type=int, default=256, help="ingest: rows per torch batch")
    parser.add_argument("--source", choices=("cached", "parquet"), default="cached",
                        help="ingest: the frame every tool reads, cached in Spark's memory or a Parquet scan")
    parser.add_argument("--step-rows", type=int, default=102_400, help="steps: DataFrame rows")
    parser.add_argument("--step-epochs", type=int, default=3, help="steps: epochs per run (first is warm-up)")
    parser.add_argument("--json-out", type=Path, default=REPO / "benchmarks" / "results" / "peers.json")
    parser.add_argument("--png", type=Path, default=REPO / "docs" / "img" / "peers.png")
    parser.add_argument("--docs", type=Path, default=REPO / "docs" / "benchmarks.md")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite the table in --docs")
    parser.add_argument("--no-record", action="store_true",
                        help="compare with benchmarks/results/records/ but do not replace the record")
    args = parser.parse_args()
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown or not args.parts:
        parser.error(f"--parts: unknown {unknown}; choose from {sorted(PARTS)}")
    if min(args.repeats, args.rows, args.features, args.batch_size, args.step_rows) < 1 or args.step_epochs < 2:
        parser.error("--repeats, --rows, --features, --batch-size, --step-rows must be >= 1; --step-epochs >= 2")
    return args


def versions() -> dict[str, str]:
    out = {}
    for name in ("sparkdl", "torch", "pyspark", "pyarrow", "horovod", "petastorm"):
        try:
            out[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception as exc:  # noqa: BLE001 - a missing peer is a fact of the run
            out[name] = f"unavailable ({type(exc).__name__})"
    return out


def autogroup() -> str:
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip()
    except OSError:
        return "unknown"


def main() -> None:
    args = parse_args()
    began = time.time()
    load_before = os.getloadavg()[0]
    args.work_dir = Path(tempfile.mkdtemp(prefix="sparkdl-peers-"))
    spark = common.spark_session()
    parts: list[dict[str, Any]] = []
    for name in args.parts:
        common.log(f"part {name}")
        module = importlib.import_module(PARTS[name])
        try:
            parts.append(module.measure(spark, args))
        except Exception as exc:  # noqa: BLE001 - one broken peer must not lose the other parts
            common.log(f"part {name} failed: {type(exc).__name__}: {exc}")
            parts.append({"part": name, "figures": {}, "runs": {}, "ratios": [], "notes": [],
                          "errors": {name: f"{type(exc).__name__}: {exc}"}})
    spark.stop()
    shutil.rmtree(args.work_dir, ignore_errors=True)
    result = {"benchmark": "peers", "when": time.strftime("%Y-%m-%d %H:%M"), "repeats": args.repeats,
              "rows": args.rows, "features": args.features, "batch_size": args.batch_size,
              "host": {"cpus": os.cpu_count(), "loadavg_before_after": [round(load_before, 2),
                                                                        round(os.getloadavg()[0], 2)],
                       # torchrun/horovodrun start ranks in new sessions: with autogroup on, each gets
                       # its own CFS group, which changes its CPU share when the host is busy.
                       "sched_autogroup_enabled": autogroup()},
              "versions": versions(), "parts": parts, "wall_s": round(time.time() - began, 1)}
    result["targets_met"] = {r["name"]: r["met"] for r in report.all_ratios(result) if r["met"] is not None}
    # Each figure against the last recorded run (benchmarks/results/records/): a drop shows here.
    record_name = "peers" if args.source == "cached" and args.rows == 1_000_000 else \
        f"peers_{args.source}_{args.rows}"
    result["against_record"] = records.compare_and_record(record_name, result, keep=not args.no_record)
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(result, indent=1))
    report.chart(result, args.png)
    if not args.no_docs:
        command = "make bench" if os.environ.get("SPARKDL_BENCH_VIA_MAKE") else \
            "python benchmarks/peers.py " + shlex.join(sys.argv[1:])
        png = os.path.relpath(args.png, args.docs.parent)
        report.write_docs(args.docs, report.markdown(result, command.strip(), png))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
