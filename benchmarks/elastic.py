"""Goodput of spot-safe runs on the multi-host bed: hosts lost for good every minute, replaced later.

    sudo .venv/bin/python benchmarks/elastic.py [--every 60] [--back-after 40] [--losses 2] [--epochs 6]

Three worker hosts (network namespaces with their own addresses, disks and links, tests/support/
multihost.py; one core and one rank each, on this machine's cores), a standalone master, the driver
on a host of its own. One DiLoCo fit of the GPT of examples/language_model.py (2 blocks, d=128, byte
tokens; H=32, checkpoints every 64 steps in the shared directory) three ways: without failures; with
a worker host lost for good (its Spark Worker and executors SIGKILLed, its link cut) every --every
seconds (at most --losses times) and a replacement registered --back-after seconds later, once elastic (min_workers=2,
grow_workers) and once as before spot-safe runs (the failed job is resubmitted and waits for the
replacement's slots in launch.slot_wait_s). Goodput = the training seconds the final history keeps
(work redone after a failure counts once) / the fit's wall seconds.
Prints JSON (benchmarks/results/elastic.json) and a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "support"))

import multihost  # noqa: E402
from bed_controller import Controller  # noqa: E402

DRIVER = HERE / "elastic_driver.py"


def summarise(raw: dict[str, Any]) -> dict[str, Any]:
    rows = raw["rows"]
    steady = rows.get("steady", {})
    out: dict[str, Any] = {}
    for name, row in rows.items():
        if "error" in row:
            out[name] = {"error": row["error"]}
            continue
        figures = {k: row[k] for k in ("wall_s", "useful_train_s", "goodput", "eval_loss")}
        figures["losses"] = sum(1 for e in row["chaos"] if "lost" in e)
        figures["worker_changes"] = [f"{m['from_workers']}->{m['to_workers']}" for m in row["membership"]]
        if steady.get("wall_s"):
            figures["wall_over_steady"] = round(row["wall_s"] / steady["wall_s"], 2)
        if steady.get("eval_loss") and name != "steady":
            figures["eval_loss_vs_steady_pct"] = round(100 * (row["eval_loss"] / steady["eval_loss"] - 1), 2)
        out[name] = figures
    return out


def markdown(table: dict[str, Any]) -> str:
    lines = ["| row | host losses | wall s | useful train s | goodput | eval loss (vs steady) | workers changed |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for name, f in table.items():
        if "error" in f:
            lines.append(f"| {name} | error: {f['error'][:80]} | | | | | |")
            continue
        versus = f" ({f['eval_loss_vs_steady_pct']:+.2f} %)" if "eval_loss_vs_steady_pct" in f else ""
        lines.append(f"| {name} | {f['losses']} | {f['wall_s']:.1f} | {f['useful_train_s']:.1f} | {f['goodput']:.2f} | "
                     f"{f['eval_loss']:.4f}{versus} | {', '.join(f['worker_changes']) or '-'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "results" / "elastic.json")
    parser.add_argument("--quick", action="store_true", help="2 epochs, losses every 30 s: a smoke run")
    args, passed = parser.parse_known_args()
    why = multihost.why_not()
    if why:
        raise SystemExit(f"elastic needs the multi-host bed: {why}")
    root = Path("/var/tmp") / f"sparkdl-elastic-{os.getpid()}"
    shutil.rmtree(root, ignore_errors=True)
    started, load_before = time.time(), os.getloadavg()
    extra = ["--epochs", "2", "--every", "30", "--back-after", "20", "--train-rows", "3072", "--losses", "1"] \
        if args.quick else []
    try:
        with multihost.Bed(root, workers=3, worker_cores=1, worker_memory="2g") as bed:
            out, ask = bed.shared / "elastic.json", bed.shared / "ask"
            with Controller(bed, ask):
                done = bed.run_on(bed.driver, [sys.executable, str(DRIVER), bed.master_url, str(out), "--shared",
                                               str(bed.shared), "--ask", str(ask), *extra, *passed], timeout=60 * 60)
            sys.stderr.write(done.stderr[-8000:])
            if not out.exists():
                raise SystemExit(f"the driver wrote nothing (rc {done.returncode})")
            raw = json.loads(out.read_text())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    table = summarise(raw)
    result = {"benchmark": "elastic", "hosts": "3 worker hosts (1 core, 1 rank each) + master + driver, network "
              "namespaces on one 2-core machine", "model": "GPT 2 blocks d=128, byte tokens, DiLoCo H=32",
              "table": table, "raw": raw, "seconds": round(time.time() - started, 1),
              "loadavg_start": [round(x, 2) for x in load_before], "loadavg_end": [round(x, 2) for x in os.getloadavg()]}
    if not args.quick:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    print(markdown(table), file=sys.stderr)
    print(json.dumps({k: v for k, v in result.items() if k != "raw"}))


if __name__ == "__main__":
    main()
