"""Planner accuracy on the multi-host bed (issue 53's acceptance): predicted against measured step
time, time to data parallel's loss, and whether repeated plans choose alike, on real (shaped) links.

    sudo .venv/bin/python benchmarks/planner_accuracy_bed.py [--quick] [--models mlp,gpt_small,gpt_large]
        [--hosts 2,4] [--links 20,100,1000] [--loads quiet,hog] [--repeats 3]

The matrix: models (an MLP 64-512-512-10, the GPT of examples/language_model.py at d=64 (the issue's
137k parameters) and d=128, 2 blocks, byte tokens) x worker hosts (2, 4: network namespaces with
their own addresses, one Spark Worker of one core each, tests/support/multihost.py; a standalone
master and the driver on hosts of their own) x every worker link at 20 Mbit/s, 100 Mbit/s, 1 Gbit/s
(tc tbf) x load (quiet, or one CPU hog per worker host: a busy loop started inside the host's
namespace and CPU cgroup, stopped by PID). The cells run in benchmarks/planner_accuracy_bed_driver.py
on the driver host; see it for what one cell measures.

"Data parallel's loss" is its final val loss within 2 % (--loss-tolerance): exact runs of the same rows
land on one of two data orders whose final losses differ by ~1 %. Under --long it is data parallel's
best val loss over the judged run (the MLP's turns up again over 16 epochs of a cell's rows).
Per cell: the chosen candidate's and data parallel's predicted step time against the measured one
(|error|); each feasible candidate's time to data parallel's final val loss = steps x step time,
measured for data parallel and the choice (steps from their val loss curves, step times from their
fits), estimated for the others (data parallel's steps x the planner's steps factor k x its predicted
step: marked "estimated"; a rival whose estimate beats the choice by more than 10 % is trained too, up
to --verify of them, so a verdict against auto rests on measurements); whether auto is within 10 % of
the best; the choices of the repeated plans.
Summary: the share of cells whose two predictions are both within 25 % (target >= 90 %), of cells with
auto within 10 % of the best (>= 90 %), of cells whose repeated plans agree (target: all).

--long: the cells judged over 16-epoch runs (--plan-epochs 16: 256 data-parallel steps a cell, what
the planner is told, so its short-run rule does not decide short cells), each model's steps to the
loss trained once at its fastest link and every cell timing its steps in --epochs epochs (a
candidate's steps to a loss do not depend on the link or load; planner_accuracy_bed_driver.py).

--merge A.json B.json ...: no bed; the matrix from parts run apart (say one model or host count a
session), summarised again by the same rules.

--quick: MLP + gpt_small, 2 hosts, 20 Mbit/s and 1 Gbit/s, quiet + hog, 2 plans a cell, data parallel
3 epochs, the others at most 6, 2 rivals measured (~30 min on a loaded 2-core machine). The full matrix takes hours. Writes benchmarks/results/planner_accuracy_bed.json
and prints a markdown table on stderr and the JSON summary as the last line of stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "support"))

import multihost  # noqa: E402
from bed_controller import Controller  # noqa: E402
from multihost import Bed, Started, kill_group  # noqa: E402

DRIVER = HERE / "planner_accuracy_bed_driver.py"
HOG = "while True: pass"
QUICK = {"models": "mlp,gpt_small", "hosts": "2", "links": "20,1000", "loads": "quiet,hog", "repeats": 2}
QUICK_DRIVER = {"--epochs": "3", "--cap-epochs": "2", "--verify": "2"}  # the driver's options under --quick
# --long: the quick matrix judged over 16-epoch runs (256 data-parallel steps), each model's steps to
# the loss trained once (at 1 Gbit/s) and every cell timing its steps in --epochs (the driver's docstring)
LONG_DRIVER = {"--plan-epochs": "16"}


class HogController(Controller):
    """The bed's controller plus {"do": "hog", "on": bool}: one busy loop per worker host, inside its
    namespace and CPU group (it competes with that host's executor, as a neighbour process would)."""

    def __init__(self, bed: Bed, ask: Path) -> None:
        super().__init__(bed, ask)
        self.hogs: list[Started] = []

    def _do(self, asked: dict[str, Any]) -> dict[str, Any]:
        if asked["do"] != "hog":
            return super()._do(asked)
        if asked["on"] and not self.hogs:
            self.hogs = [self.bed.start_on(host, [sys.executable, "-c", HOG], "hog") for host in self.bed.workers]
        elif not asked["on"]:
            self.stop_hogs()
        return {"pids": [h.process.pid for h in self.hogs]}

    def stop_hogs(self) -> None:
        for hog in self.hogs:
            kill_group(hog.process)  # by its PID (its own session), nothing else
            if hog in self.bed._started:
                self.bed._started.remove(hog)
        self.hogs = []

    def __exit__(self, *exc: Any) -> None:
        self.stop_hogs()
        super().__exit__(*exc)


def run_driver(bed: Bed, argv: list[str], log: Path, timeout: float) -> int:
    """The driver script on the driver host, its output to `log`; its process group is killed on
    timeout, Ctrl-C or any error, so nothing outlives the bed."""
    with open(log, "ab") as out:
        process = subprocess.Popen(bed.command_on(bed.driver, argv), stdout=out, stderr=subprocess.STDOUT,
                                   env=bed.environment(), start_new_session=True)
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return -9
        finally:
            kill_group(process)


def run_hosts(hosts: int, args: argparse.Namespace, passed: list[str], root: Path, log: Path) -> dict[str, Any]:
    with Bed(root, workers=hosts, worker_cores=1, worker_memory="2g") as bed:
        # Each worker host a CPU group of --host-cpus cores that its Worker, executors and hog share:
        # the hog competes with its own host's rank, and the bed takes at most that much of the machine.
        why = multihost.cpu_why_not()
        if why:
            raise SystemExit(f"planner_accuracy_bed needs CPU groups for its hosts: {why}")
        for host in bed.workers:
            bed.set_cpu(host, args.host_cpus)
        out, ask = bed.shared / "cells.json", bed.shared / "ask"
        with HogController(bed, ask):
            rc = run_driver(bed, [sys.executable, str(DRIVER), bed.master_url, str(out), "--shared", str(bed.shared),
                                  "--ask", str(ask), "--workers", str(hosts), "--models", args.models, "--links",
                                  args.links, "--loads", args.loads, "--repeats", str(args.repeats), *passed],
                            log, args.timeout_s)
        raw = json.loads(out.read_text()) if out.exists() else {"cells": []}
        raw["driver_rc"] = rc
        return raw


def time_to_loss(cell: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each feasible candidate's seconds to data parallel's final val loss: steps x step time, both
    measured for the runs the cell trained, else data parallel's steps x k x the predicted step."""
    target, dp_steps = cell["target_val_loss"], cell["dp_steps"]
    out: dict[str, dict[str, Any]] = {}
    for c in cell["plans"][0]["candidates"]:
        run = cell["runs"].get(c["label"])
        if not c["feasible"]:
            continue
        if run is None:
            out[c["label"]] = {"s": dp_steps * c["steps_factor"] * c["predicted_step_s"], "estimated": True}
        elif "error" in run:
            out[c["label"]] = {"s": None, "estimated": False, "error": run["error"]}
        else:
            steps = run["steps_to_target"] if "steps_to_target" in run else \
                next((int(n) for n, loss in run["curve"] if loss <= target), None)  # runs of older JSON
            out[c["label"]] = {"s": None if steps is None else steps * run["step"]["measured_s"], "estimated": False,
                               "steps": steps, "trained_steps": run["steps"]}
    return out


def summarise_cell(cell: dict[str, Any]) -> dict[str, Any]:
    if "error" in cell:
        return {k: cell[k] for k in ("cell", "error") if k in cell}
    plan = cell["plans"][0]
    by_label = {c["label"]: c for c in plan["candidates"]}
    chosen, dp = by_label[plan["chosen"]], by_label.get("data_parallel")
    chosen_run, dp_run = cell["runs"][chosen["label"]], cell["runs"]["data_parallel"]

    def pair(predicted: float, run: dict[str, Any]) -> dict[str, Any] | None:
        if "error" in run:
            return None
        measured = run["step"]["measured_s"]
        return {"predicted_ms": round(predicted * 1e3, 2), "measured_ms": round(measured * 1e3, 2),
                "abs_err": round(abs(predicted / measured - 1), 3)}

    ttl = time_to_loss(cell)
    reached = {k: v for k, v in ttl.items() if v["s"] is not None}
    best = min(reached, key=lambda k: reached[k]["s"]) if reached else None
    mine = ttl.get(chosen["label"], {}).get("s")
    return {"cell": cell["cell"], "model": cell["model"], "hosts": cell["hosts"], "link_mbit": cell["link_mbit"],
            "load": cell["load"], "chosen": chosen["label"], "chosen_exact": chosen["exact"],
            "chosen_step": pair(chosen["predicted_step_s"], chosen_run),
            "dp_step": pair(dp["predicted_step_s"], dp_run) if dp else None,
            "time_to_dp_loss_s": {k: {**v, "s": None if v["s"] is None else round(v["s"], 2)} for k, v in ttl.items()},
            "rivals_measured": [k for k, r in cell["runs"].items() if r.get("rival")],
            "best": best, "auto_within_10pct": bool(mine is not None and best and mine <= 1.10 * reached[best]["s"]),
            "repeated_choices": [p["chosen"] for p in cell["plans"]],
            "same_choice": len({p["chosen"] for p in cell["plans"]}) == 1,
            "plan_s": [p["plan_s"] for p in cell["plans"]], "target_val_loss": cell["target_val_loss"],
            "loadavg": [round(x, 2) for x in cell.get("loadavg", [])], "cell_s": cell.get("cell_s")}


def summary(cells: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [c for c in cells if "error" not in c]

    def share(test: Any) -> float | None:
        return round(sum(1 for c in ok if test(c)) / len(ok), 3) if ok else None

    def close(pair: dict[str, Any] | None) -> bool:
        return pair is not None and pair["abs_err"] <= 0.25

    def within(c: dict[str, Any]) -> bool:
        return close(c["chosen_step"]) and close(c["dp_step"])

    figures = {"cells": len(cells), "cells_failed": len(cells) - len(ok),
               "share_cells_predictions_within_25pct": share(within),
               "share_chosen_prediction_within_25pct": share(lambda c: close(c["chosen_step"])),
               "share_dp_prediction_within_25pct": share(lambda c: close(c["dp_step"])),
               "share_auto_within_10pct_of_best": share(lambda c: c["auto_within_10pct"]),
               "share_same_choice_on_repeats": share(lambda c: c["same_choice"])}
    figures["targets"] = {"share_cells_predictions_within_25pct": 0.9, "share_auto_within_10pct_of_best": 0.9,
                          "share_same_choice_on_repeats": 1.0}
    figures["met"] = bool(ok) and all((figures[k] or 0) >= v for k, v in figures["targets"].items()) \
        and len(ok) == len(cells)
    return figures


def pair_text(pair: dict[str, Any] | None) -> str:
    if pair is None:
        return "-"
    return f"{pair['predicted_ms']:.1f} / {pair['measured_ms']:.1f} ({100 * pair['abs_err']:.0f} %)"


def markdown(cells: list[dict[str, Any]]) -> str:
    lines = ["| cell | chosen (repeats) | chosen ms pred / meas (err) | DP ms pred / meas (err) | "
             "time to DP's loss: chosen / best (s) | within 10 % |", "|---|---|---:|---:|---|:-:|"]
    for c in cells:
        if "error" in c:
            lines.append(f"| {c['cell']} | error: {c['error'][:80]} | | | | |")
            continue
        s, d = c["chosen_step"], c["dp_step"]
        ttl = c["time_to_dp_loss_s"]
        mine, best = ttl.get(c["chosen"], {}).get("s"), c["best"]
        best_s = ttl[best]["s"] if best else None
        marked = f"{best} {best_s:.1f}" + (" (est.)" if best and ttl[best]["estimated"] else "") if best else "none"
        repeats = "same" if c["same_choice"] else " / ".join(c["repeated_choices"])
        lines.append(f"| {c['cell']} | {c['chosen']} ({repeats}) | {pair_text(s)} | {pair_text(d)} | "
                     f"{'never' if mine is None else f'{mine:.1f}'} / "
                     f"{marked} | {'yes' if c['auto_within_10pct'] else 'no'} |")
    return "\n".join(lines)


def merge(args: argparse.Namespace) -> None:
    """The whole matrix from parts run apart (the full one takes hours): every part's raw cells,
    summarised again by this script's rules, with each part's commit and matrix kept beside them."""
    raw_cells: dict[str, dict[str, Any]] = {}
    parts = []
    for path in args.merge:
        part = json.loads(path.read_text())
        parts.append({"file": str(path), "commit": part.get("commit"), "quick": part.get("quick"),
                      "matrix": part.get("matrix"), "driver_options": part.get("driver_options"),
                      "loadavg_start": part.get("loadavg_start"), "seconds": part.get("seconds")})
        for cell in part.get("raw", []):
            raw_cells[cell["cell"]] = cell
    cells = [summarise_cell(c) for c in raw_cells.values()]
    result = {"benchmark": "planner_accuracy_bed", "merged": parts, **summary(cells), "cells": cells,
              "raw": list(raw_cells.values())}
    if not args.no_write:
        args.out.write_text(json.dumps(result, indent=1))
    print(markdown(cells), file=sys.stderr)
    print(json.dumps({k: v for k, v in result.items() if k != "raw"}))


def interrupted(*_: Any) -> None:
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Other options go to the driver (planner_accuracy_bed_driver.py): --epochs, "
                                            "--steps-per-epoch, --cap-epochs, --verify, --loss-tolerance, --mlp-batch, "
                                            "--gpt-batch, --eval-rows.")
    parser.add_argument("--quick", action="store_true", help="; ".join(f"{k}={v}" for k, v in QUICK.items()))
    parser.add_argument("--long", action="store_true",
                        help="runs judged over --plan-epochs 16 (unless given): the planner's short-run rule "
                             "sees a 256-step run; steps to the loss trained once a model, step times per cell")
    parser.add_argument("--models", default="mlp,gpt_small,gpt_large")
    parser.add_argument("--hosts", default="2,4")
    parser.add_argument("--links", default="20,100,1000", help="Mbit/s")
    parser.add_argument("--loads", default="quiet,hog")
    parser.add_argument("--repeats", type=int, default=3, help="plans a cell (each on a fresh calibration)")
    parser.add_argument("--host-cpus", type=float, default=0.5, help="each worker host's CPU capacity (cores)")
    parser.add_argument("--timeout-s", type=float, default=6 * 3600, help="per host count")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "planner_accuracy_bed.json")
    parser.add_argument("--no-write", action="store_true", help="print only (a debugging run)")
    parser.add_argument("--merge", type=Path, nargs="+", default=(),
                        help="no bed: the matrix from earlier runs' JSON files (each a part of it, e.g. one model or "
                             "host count a session; a cell in several: the last file's), summarised again to --out")
    args, passed = parser.parse_known_args()  # the rest goes to the driver (--epochs, --steps-per-epoch, ...)
    if args.merge:
        merge(args)
        return
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
        for option, value in QUICK_DRIVER.items():
            passed = passed if option in passed else [option, value, *passed]
    if args.long:
        for option, value in LONG_DRIVER.items():
            passed = passed if option in passed else [option, value, *passed]
    why = multihost.why_not()
    if why:
        raise SystemExit(f"planner_accuracy_bed needs the multi-host bed: {why}")
    # SIGTERM unwinds like Ctrl-C: the bed's teardown (hogs, Spark, namespaces) runs either way.
    signal.signal(signal.SIGTERM, interrupted)
    root = Path("/var/tmp") / f"sparkdl-planner-bed-{os.getpid()}"
    log = Path("/var/tmp") / f"sparkdl-planner-bed-{os.getpid()}-driver.log"
    started, load_before = time.time(), os.getloadavg()
    commit = subprocess.run(["git", "-C", str(HERE.parent), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()  # the planner measured (others change it meanwhile)
    raw_cells: list[dict[str, Any]] = []
    rcs = {}
    try:
        for hosts in [int(h) for h in args.hosts.split(",") if h]:
            shutil.rmtree(root, ignore_errors=True)
            raw = run_hosts(hosts, args, passed, root, log)
            raw_cells += raw["cells"]
            rcs[hosts] = raw["driver_rc"]
    finally:
        shutil.rmtree(root, ignore_errors=True)
        sys.stderr.write(log.read_text(errors="replace")[-6000:] if log.exists() else "")
    cells = [summarise_cell(c) for c in raw_cells]
    result = {"benchmark": "planner_accuracy_bed", "quick": args.quick, "long": args.long, "commit": commit,
              "bed": "worker hosts of 1 Spark core, 1 rank and --host-cpus CPU capacity each (network namespaces, tc tbf links) + master + driver "
                     "hosts, on one shared 2-core machine",
              "matrix": {k: getattr(args, k) for k in ("models", "hosts", "links", "loads", "repeats", "host_cpus")},
              "driver_options": passed, "driver_rc": rcs, **summary(cells), "cells": cells,
              "seconds": round(time.time() - started, 1), "loadavg_start": [round(x, 2) for x in load_before],
              "loadavg_end": [round(x, 2) for x in os.getloadavg()], "raw": raw_cells}
    if not args.no_write:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    print(markdown(cells), file=sys.stderr)
    print(json.dumps({k: v for k, v in result.items() if k != "raw"}))


if __name__ == "__main__":
    main()
