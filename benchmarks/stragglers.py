"""Stragglers: data parallel on hosts of uneven CPU, on the multi-host bed (issue 43).

    sudo .venv/bin/python benchmarks/stragglers.py [--hosts 4] [--cores 0.4] [--repeats 1] [--epochs 3]
        [--scenarios slow_host,noisy,even] [--rows lockstep,torchdistributor_ddp,dynamic,auto] [--quick]

Worker hosts (network namespaces with their own addresses, tests/support/multihost.py; one rank
each) whose CPU capacity is a cgroup of their own (tests/support/cpu_capacity.py: the host's Spark
Worker and every executor and Python worker under it share it). Side by side in one run, with the
same model (an MLP 16-W-W-3, W=1024: ~1.07M parameters), rows, batch (per rank), SGD lr, seed,
epochs and hosts:
  torchdistributor_ddp  PySpark's TorchDistributor running plain DDP (gloo)
  lockstep              sparkdl data parallel, batch_balance="equal" (every rank the same rows a step)
  dynamic               sparkdl data parallel, batch_balance="dynamic" (the global batch re-split by
                        measured speed every --rebalance-every steps; the same update as lockstep)
  auto                  sparkdl strategy="auto" (the planner's choice on its calibration of these hosts)
Scenarios (C = --cores, the capacity of a host at full speed):
  slow_host  the last host at C/3, the others at C
  noisy      the last host with a seeded noisy neighbour: its capacity drawn uniform in [C/4, C] at
             exponential gaps of mean --noisy-interval-s (random.Random(--seed)); restarted with the
             same seed at the start of every row, so that every row meets the same capacities at the
             same times from its start; the others at C
  even       every host at C

Figures. A row's curve is (training seconds, held-out eval loss) at each epoch end (sparkdl: the
epoch records' seconds; DDP: its loop's time less evaluation). The target is lockstep's final eval
loss in the same scenario and round; a row's time to target is the training seconds at its first
epoch end with eval loss <= target x (1 + --tolerance) (dynamic makes exactly lockstep's updates, so
it reaches the target at its last epoch; DDP and auto differ in rows per step or layout).
Ratios (medians over rounds):
  auto_vs_ddp            DDP's time to target / auto's (> 1: auto is faster)
  dynamic_vs_lockstep    lockstep's time / dynamic's
  dynamic_vs_ideal       ideal / dynamic's time (also per row: "vs_ideal"), where ideal is the time
                         of a perfect split of the same work over the capacities the row trained
                         on: the even scenario's lockstep time (every host at C) x (n x C) / (sum
                         of the hosts' mean capacities while the row trained; the noisy host's is
                         the mean of its applied schedule over the row's last train_s seconds
                         before the neighbour stopped, less TAIL_S). 1.0 = as fast as the
                         capacities allow, 0.5 = twice the ideal time.
                         Without an even round: lockstep's time x n x min(c) / sum(c) (a lock-step
                         step is set by the slowest host; the same bound, from the same run)
  even_overhead          on even hosts, each row's time to target / lockstep's (the cost of
                         measuring and re-splitting when nothing is uneven)
Prints one JSON object as the last line of stdout (the load average before and after is in it: the
machine is shared) and a markdown table on stderr. Nothing here asserts a timing.
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
sys.path.insert(0, str(HERE.parent / "tests" / "support"))

import multihost  # noqa: E402
from bed_controller import Controller  # noqa: E402
from cpu_capacity import mean_cores  # noqa: E402

DRIVER = HERE / "stragglers_driver.py"


class CpuController(Controller):
    """The bed's controller (tests/support/bed_controller.py) with two more requests:
    {"do": "cpu", "scenario"}: every worker host's capacity for the scenario; {"do": "noisy", "on"}:
    the noisy neighbour (re)started with the seed on the last host, or stopped (its schedule back)."""

    def __init__(self, bed: multihost.Bed, ask: Path, cores: float, seed: int, interval_s: float) -> None:
        super().__init__(bed, ask)
        self.cores, self.seed, self.interval_s = cores, seed, interval_s
        self.neighbour: Any = None

    def capacities(self, scenario: str) -> list[float]:
        n, c = len(self.bed.workers), self.cores
        if scenario == "slow_host":
            return [c] * (n - 1) + [round(c / 3, 4)]
        if scenario in ("noisy", "even"):
            return [c] * n
        raise ValueError(f"unknown scenario {scenario!r}")

    def _do(self, asked: dict[str, Any]) -> dict[str, Any]:
        if asked["do"] == "cpu":
            capacities = self.capacities(asked["scenario"])
            for host, cores in zip(self.bed.workers, capacities):
                self.bed.set_cpu(host, cores)
            return {"hosts": [h.address for h in self.bed.workers], "cores": capacities}
        if asked["do"] == "noisy":
            host = self.bed.workers[-1]
            if asked["on"]:
                self.neighbour = self.bed.noisy_neighbour(host, self.seed, self.cores / 4, self.cores, self.interval_s)
                return {"host": host.address}
            neighbour, self.neighbour = self.neighbour, None
            stopped_s = time.time() - neighbour.started_at
            neighbour.stop()
            return {"host": host.address, "seed": self.seed, "schedule": [[t, c] for t, _, c in neighbour.schedule],
                    "stopped_s": round(stopped_s, 3), "mean_cores": round(neighbour.mean_capacity(stopped_s), 4)}
        return super()._do(asked)


def time_to(curve: list[list[float]], target: float, tolerance: float) -> float | None:
    for seconds, loss in curve:
        if loss <= target * (1 + tolerance):
            return seconds
    return None


TAIL_S = 1.0  # from a row's last training step to the driver's answer (model back, processes ended)


def row_cores(row: dict[str, Any]) -> list[float]:
    """The hosts' mean capacities while `row` trained: the scenario's, with the noisy host's mean
    over the row's training window (its last train_s seconds before TAIL_S of the neighbour's stop)."""
    cores = list(row.get("capacities", {}).get("cores", []))
    noisy = row.get("noisy")
    if cores and noisy and noisy.get("schedule"):
        end = noisy.get("stopped_s", row.get("row_s", 0.0)) - TAIL_S
        cores[-1] = mean_cores([(t, c) for t, c in noisy["schedule"]], max(0.0, end - row["train_s"]), end)
    return cores


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 3) if present else None


def summarise(raw: dict[str, Any], tolerance: float) -> dict[str, Any]:
    rounds = raw["rounds"]
    table: dict[str, dict[str, Any]] = {}
    per_round: dict[tuple[int, str], dict[str, Any]] = {}
    for entry in rounds:
        per_round.setdefault((entry["repeat"], entry["scenario"]), {})[entry["row"]] = entry
    times: dict[tuple[str, str], list[float | None]] = {}
    ideals: dict[tuple[str, str], list[float | None]] = {}
    for (repeat, scenario), rows in per_round.items():
        target = rows.get("lockstep", {}).get("eval_loss")
        even_lockstep = per_round.get((repeat, "even"), {}).get("lockstep", {})
        for name, row in rows.items():
            if "error" in row:
                table.setdefault(scenario, {})[name] = {"error": row["error"][:300]}
                continue
            reached = time_to(row["curve"], target, tolerance) if target is not None else None
            times.setdefault((scenario, name), []).append(reached)
            figures = table.setdefault(scenario, {}).setdefault(name, {"time_to_target_s": [], "train_s": [],
                                                                       "eval_loss": [], "fit_wall_s": []})
            for key, value in (("time_to_target_s", reached), ("train_s", row["train_s"]),
                               ("eval_loss", round(row["eval_loss"], 4)), ("fit_wall_s", row["fit_wall_s"])):
                figures[key].append(value)
            if row.get("plan"):
                figures["chose"] = f"{row['plan']} {json.dumps(row.get('options', {}))}"
            if row.get("pace"):
                figures["last_pace"] = row["pace"]
            cores = row_cores(row)
            if row.get("noisy"):
                figures.setdefault("noisy_mean_cores", []).append(round(cores[-1], 4))
            # the time a perfect split of the same work over these capacities would take
            ideal = None
            if cores and even_lockstep.get("train_s"):
                ideal = even_lockstep["train_s"] * sum(even_lockstep["capacities"]["cores"]) / sum(cores)
            elif cores and rows.get("lockstep", {}).get("train_s"):
                lockstep_cores = row_cores(rows["lockstep"])
                ideal = rows["lockstep"]["train_s"] * len(lockstep_cores) * min(lockstep_cores) / sum(cores)
            ideals.setdefault((scenario, name), []).append(ideal)
            figures.setdefault("ideal_s", []).append(None if ideal is None else round(ideal, 3))
            figures.setdefault("vs_ideal", []).append(round(ideal / reached, 3) if ideal and reached else None)
    for scenario, rows in table.items():
        for figures in rows.values():
            for key in ("time_to_target_s", "train_s", "eval_loss", "fit_wall_s", "noisy_mean_cores", "ideal_s",
                        "vs_ideal"):
                if key in figures:
                    figures[key] = {"median": median(figures[key]), "all": figures[key]}
    ratios: dict[str, dict[str, Any]] = {}
    for scenario in table:
        def t(name: str) -> float | None:
            return median(times.get((scenario, name), []))
        r: dict[str, Any] = {}
        if t("auto") and t("torchdistributor_ddp"):
            r["auto_vs_ddp"] = round(t("torchdistributor_ddp") / t("auto"), 3)
        if t("dynamic") and t("lockstep"):
            r["dynamic_vs_lockstep"] = round(t("lockstep") / t("dynamic"), 3)
        ideal = median(ideals.get((scenario, "dynamic"), []))
        if t("dynamic") and ideal:
            r["dynamic_ideal_s"] = ideal
            r["dynamic_vs_ideal"] = round(ideal / t("dynamic"), 3)
        if scenario == "even" and t("lockstep"):
            r["even_overhead"] = {name: round(t(name) / t("lockstep"), 3) for name in ("dynamic", "auto",
                                  "torchdistributor_ddp") if t(name)}
        ratios[scenario] = r
    return {"target": "lockstep's final eval loss in the same scenario and round", "tolerance": tolerance,
            "table": table, "ratios": ratios}


def markdown(summary: dict[str, Any]) -> str:
    lines = ["| scenario | row | time to lockstep's loss (s) | ideal s | ideal / time | final eval loss | fit wall s |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for scenario, rows in summary["table"].items():
        for name, f in rows.items():
            if "error" in f:
                lines.append(f"| {scenario} | {name} | error: {f['error'][:80]} | | | | | |")
                continue
            reached = f["time_to_target_s"]["median"]
            label = name + (f" (chose {f['chose']})" if f.get("chose") and name == "auto" else "")
            ideal, share = f["ideal_s"]["median"], f["vs_ideal"]["median"]
            lines.append(f"| {scenario} | {label} | {'never' if reached is None else f'{reached:.1f}'} | "
                         f"{'' if ideal is None else f'{ideal:.1f}'} | {'' if share is None else f'{share:.2f}'} | "
                         f"{f['eval_loss']['median']:.4f} | {f['fit_wall_s']['median']:.1f} |")
    lines += ["", "| scenario | ratios |", "|---|---|"]
    lines += [f"| {s} | {json.dumps(r)} |" for s, r in summary["ratios"].items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--cores", type=float, default=0.4, help="a host's capacity at full speed (cores)")
    parser.add_argument("--scenarios", default="slow_host,noisy,even")
    parser.add_argument("--rows", default="lockstep,torchdistributor_ddp,dynamic,auto")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train-rows", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=256, help="rows per rank and step")
    parser.add_argument("--width", type=int, default=1024, help="the MLP's hidden width (W)")
    parser.add_argument("--rebalance-every", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1, help="the noisy neighbour's")
    parser.add_argument("--noisy-interval-s", type=float, default=3.0)
    parser.add_argument("--tolerance", type=float, default=0.005)
    parser.add_argument("--quick", action="store_true", help="3 hosts, 2 epochs, 12288 rows: a few minutes")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON (with the raw rounds) here")
    args = parser.parse_args()
    if args.quick:
        args.hosts, args.epochs, args.train_rows = 3, 2, 12288
    why = multihost.why_not() or multihost.cpu_why_not()
    if why:
        raise SystemExit(f"stragglers needs the multi-host bed with CPU capacities: {why}")
    root = Path("/var/tmp") / f"sparkdl-stragglers-{os.getpid()}"
    shutil.rmtree(root, ignore_errors=True)
    started, load_before = time.time(), os.getloadavg()
    try:
        with multihost.Bed(root, workers=args.hosts, worker_cores=1, worker_memory="2g") as bed:
            out, ask = bed.shared / "stragglers.json", bed.shared / "ask"
            with CpuController(bed, ask, args.cores, args.seed, args.noisy_interval_s):
                done = bed.run_on(bed.driver, [sys.executable, str(DRIVER), bed.master_url, str(out), "--shared",
                                               str(bed.shared), "--ask", str(ask), "--workers", str(args.hosts),
                                               "--scenarios", args.scenarios, "--rows", args.rows,
                                               "--repeats", str(args.repeats), "--epochs", str(args.epochs),
                                               "--train-rows", str(args.train_rows), "--batch", str(args.batch),
                                               "--width", str(args.width),
                                               "--rebalance-every", str(args.rebalance_every)], timeout=3 * 60 * 60)
            sys.stderr.write(done.stderr[-6000:])
            if not out.exists():
                raise SystemExit(f"the driver wrote nothing (rc {done.returncode})")
            raw = json.loads(out.read_text())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = summarise(raw, args.tolerance)
    result = {"benchmark": "stragglers", "hosts": f"{args.hosts} worker hosts (1 rank each, {args.cores} cores at "
              "full speed) + master + driver, network namespaces on one 2-core machine",
              "model": f"MLP 16-{args.width}-{args.width}-3 ({raw.get('params')} parameters)", "steps_per_epoch": raw.get("steps_per_epoch"),
              "epochs": args.epochs, "batch_per_rank": args.batch, "repeats": args.repeats,
              "noisy": {"seed": args.seed, "low": args.cores / 4, "high": args.cores, "mean_interval_s": args.noisy_interval_s},
              **summary, "seconds": round(time.time() - started, 1),
              "loadavg_start": [round(x, 2) for x in load_before], "loadavg_end": [round(x, 2) for x in os.getloadavg()]}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**result, "raw": raw}, indent=1))
    print(markdown(summary), file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
