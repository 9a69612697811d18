"""Training on slow links, on the multi-host bed: sparkdl's layouts against TorchDistributor's DDP.

    sudo .venv/bin/python benchmarks/slow_links.py [--networks 1gbit,100mbit,20mbit,islands] [--quick]

Four worker hosts (network namespaces with their own addresses and shaped links, tests/support/
multihost.py; one core and one rank each, on this machine's cores), a standalone master, the driver
on a host of its own. The GPT of examples/language_model.py (2 blocks, d=128, byte tokens of the
Python standard library's sources, 64 bytes a row) with a fixed seed, rows, batch (16 a rank), lr
schedule and token budget (3 epochs of 128 steps, 4 rows of 64 bytes a rank a step), on four networks: every link at 1 Gbit/s, 100
Mbit/s, 20 Mbit/s, and two islands (2 + 2 hosts at 1 Gbit/s inside, 20 Mbit/s between).

Rows: data parallel, DiLoCo fp32 (H=32; fp16 too at 1 Gbit/s), Streaming DiLoCo int8 and int4 (H=104,
4 fragments, tau=2; int8 at 1 Gbit/s and 100 Mbit/s), islands (on the islands network), `auto`, and
TorchDistributor running plain DDP on the same hosts,
model, rows, batch and steps. Columns: training seconds, bytes on the wire per rank, final eval loss,
compute utilisation, and the time each row first reaches data parallel's final eval loss.

Bounded: a row stops at the end of the epoch in which its training passed --cap-s (120 s). Exact rows
(data parallel, DDP) update the same way on every network, so away from 1 Gbit/s they run only
--exact-cap-s (30 s) for their step time; their time to the target loss there is the steps they
needed at 1 Gbit/s times that step time (marked "estimated"). The whole run takes about 30 min.
Prints JSON (benchmarks/results/slow_links.json) and writes docs/img/slow_links.png.
"""
from __future__ import annotations

import argparse
import json
import re
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

DRIVER = HERE / "slow_links_driver.py"


def time_to(curve: list[list[float]], target: float) -> tuple[float | None, int | None]:
    """(training seconds, steps) at the first eval at or below `target`; (None, None) if never."""
    for seconds, steps, loss in curve:
        if loss <= target:
            return seconds, steps
    return None, None


def summarise(raw: dict[str, Any]) -> dict[str, Any]:
    networks = raw["networks"]
    reference = networks.get("1gbit", {}).get("rows", {})
    dp = reference.get("data_parallel", {})
    target = dp.get("eval_loss")
    table: dict[str, dict[str, Any]] = {}
    for network, data in networks.items():
        for name, row in data["rows"].items():
            if "error" in row:
                table.setdefault(network, {})[name] = {"error": row["error"]}
                continue
            figures = {k: row[k] for k in ("train_s", "fit_wall_s", "bytes_per_rank", "eval_loss",
                                           "compute_utilisation", "steps", "capped") if k in row}
            reached_s, reached_steps = time_to(row["curve"], target) if target is not None else (None, None)
            figures["time_to_dp_loss_s"] = reached_s
            if row.get("capped") and name in ("data_parallel", "torchdistributor_ddp") and network != "1gbit":
                exact = reference.get(name, {})
                _, steps_needed = time_to(exact.get("curve", []), target) if target is not None else (None, None)
                if steps_needed is not None:
                    figures["time_to_dp_loss_s"] = round(steps_needed * row["train_s"] / max(row["steps"], 1), 1)
                    figures["time_to_dp_loss_estimated"] = True
                    figures["eval_loss"] = exact.get("eval_loss")
                    figures["eval_loss_from"] = "1gbit (same updates)"
            if "plan" in row and name == "auto":
                figures["auto_chose"] = row["plan"]
                figures["auto_options"] = row.get("options", {})
            table.setdefault(network, {})[name] = figures
    return {"target_eval_loss": target, "table": table, "verdicts": verdicts(table, target),
            "step_predictions": step_predictions(raw)}


def verdicts(table: dict[str, dict[str, Any]], target: float | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    fast = table.get("1gbit", {})
    dp = fast.get("data_parallel", {})
    s4 = fast.get("streaming_int4", {})
    if dp.get("bytes_per_rank") and s4.get("bytes_per_rank"):
        # Whole runs: every byte each sent to reach its final loss (the streaming row may train more
        # steps than data parallel, --approximate-epochs; then per step it sends fewer still).
        ratio = dp["bytes_per_rank"] / s4["bytes_per_rank"]
        per_step = ratio * s4["steps"] / max(dp["steps"], 1)
        gap = 100 * (s4["eval_loss"] / dp["eval_loss"] - 1)
        out["streaming_int4_vs_dp"] = {"bytes_fewer_x": round(ratio, 1), "bytes_fewer_per_step_x": round(per_step, 1),
                                       "steps": s4["steps"], "dp_steps": dp["steps"],
                                       "eval_loss_gap_pct": round(gap, 2), "passes": ratio >= 400 and gap <= 2.0}
    f32, f16 = fast.get("diloco_fp32", {}), fast.get("diloco_fp16", {})
    if f32.get("eval_loss") and f16.get("eval_loss"):
        gap = 100 * (f16["eval_loss"] / f32["eval_loss"] - 1)
        out["fp16_vs_fp32_diloco"] = {"eval_loss_gap_pct": round(gap, 2), "passes": gap <= 0.5}
    slow = table.get("20mbit", {})
    auto, ddp = slow.get("auto", {}), slow.get("torchdistributor_ddp", {})
    if auto.get("time_to_dp_loss_s") and ddp.get("time_to_dp_loss_s"):
        speedup = ddp["time_to_dp_loss_s"] / auto["time_to_dp_loss_s"]
        out["auto_vs_ddp_at_20mbit"] = {"speedup_to_dp_loss": round(speedup, 2), "passes": speedup >= 5}
    elif auto:
        out["auto_vs_ddp_at_20mbit"] = {"auto_reached_dp_loss": bool(auto.get("time_to_dp_loss_s")), "passes": False}
    medium = table.get("100mbit", {})
    for name in ("streaming_int8", "streaming_int4"):
        if "compute_utilisation" in medium.get(name, {}):
            out[f"{name}_utilisation_at_100mbit"] = {"value": medium[name]["compute_utilisation"],
                                                     "passes": medium[name]["compute_utilisation"] >= 0.9}
    islands = table.get("islands", {})
    if islands.get("auto"):
        chose = islands["auto"].get("auto_chose")
        mine, flat = islands["auto"].get("time_to_dp_loss_s"), islands.get("diloco_fp32", {}).get("time_to_dp_loss_s")
        out["islands_auto"] = {"chose": chose, "time_to_dp_loss_s": mine, "flat_diloco_time_to_dp_loss_s": flat,
                               "beats_flat_diloco": bool(mine and (flat is None or mine < flat))}
    return out


def predicted_steps(row: dict[str, Any]) -> dict[str, float]:
    """The auto row's priced candidates, {label: predicted seconds a step}: recorded by the driver
    (`candidates`), or read from its plan's table (runs before it recorded them)."""
    if row.get("candidates"):
        return {c["label"]: float(c["predicted_step_s"]) for c in row["candidates"]}
    found = {}
    for line in str(row.get("explain", "")).splitlines():
        match = re.match(r"^[* ]\s+(\w+(?:\([^)]*\))?)\s+([0-9.]+)\s+[0-9.]+\s+[0-9.]+\s", line)
        if match:
            found[match.group(1)] = float(match.group(2)) / 1e3
    return found


def step_predictions(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """The planner's predicted step time against the measured one (training seconds / steps) on
    each shaped network: the candidate auto chose against the auto row, data parallel's against
    the data parallel row (item 5: within 25 %)."""
    out = []
    for network, data in raw["networks"].items():
        rows = data["rows"]
        auto = rows.get("auto", {})
        predicted = predicted_steps(auto)
        chosen = auto.get("chosen_label") or _chosen_label(auto)
        pairs = [("auto", chosen), ("data_parallel", "data_parallel")]
        for row_name, label in pairs:
            row = rows.get(row_name, {})
            if not label or label not in predicted or not row.get("steps"):
                continue
            measured = row["train_s"] / row["steps"]
            error = predicted[label] / measured - 1
            out.append({"network": network, "row": row_name, "candidate": label,
                        "predicted_step_ms": round(predicted[label] * 1e3, 2), "measured_step_ms": round(measured * 1e3, 2),
                        "error_pct": round(100 * error, 1), "within_25pct": abs(error) <= 0.25})
    return out


def _chosen_label(auto: dict[str, Any]) -> str | None:
    match = re.search(r"^chosen: (\w+(?:\([^)]*\))?)", str(auto.get("explain", "")), re.M)
    return match.group(1) if match else None


def markdown(summary: dict[str, Any]) -> str:
    lines = ["| network | row | train s | bytes/rank | eval loss | utilisation | time to DP's loss (s) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for network, rows in summary["table"].items():
        for name, f in rows.items():
            if "error" in f:
                lines.append(f"| {network} | {name} | error: {f['error'][:60]} | | | | |")
                continue
            reached = f.get("time_to_dp_loss_s")
            shown = "never" if reached is None else f"{reached:.1f}" + (" (est.)" if f.get("time_to_dp_loss_estimated")
                                                                        else "")
            label = name + (f" ({f['auto_chose']})" if f.get("auto_chose") else "")
            lines.append(f"| {network} | {label} | {f['train_s']:.1f}{' (capped)' if f.get('capped') else ''} | "
                         f"{f['bytes_per_rank'] / 2**20:.2f} MiB | {f['eval_loss']:.4f} | "
                         f"{f['compute_utilisation']:.2f} | {shown} |")
    if summary.get("step_predictions"):
        lines += ["", "| network | row | planner's candidate | predicted ms/step | measured | error |", "|---|---|---|---:|---:|---:|"]
        lines += [f"| {p['network']} | {p['row']} | {p['candidate']} | {p['predicted_step_ms']:.1f} | "
                  f"{p['measured_step_ms']:.1f} | {p['error_pct']:+.1f} % |" for p in summary["step_predictions"]]
    return "\n".join(lines)


def plot(raw: dict[str, Any], summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    networks = list(raw["networks"])
    names = sorted({name for data in raw["networks"].values() for name in data["rows"]})
    colours = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(names)}  # one colour a row everywhere
    figure, axes = plt.subplots(1, len(networks), figsize=(4.2 * len(networks), 3.8), sharey=True)
    axes = axes if len(networks) > 1 else [axes]
    for axis, network in zip(axes, networks):
        for name, row in raw["networks"][network]["rows"].items():
            if "curve" in row:
                xs, ys = [c[0] for c in row["curve"]], [c[2] for c in row["curve"]]
                axis.plot(xs, ys, marker=".", label=name, color=colours[name])
        if summary.get("target_eval_loss"):
            axis.axhline(summary["target_eval_loss"], color="grey", linestyle=":", linewidth=1)
        axis.set_title(network)
        axis.set_xlabel("training seconds")
        axis.set_xscale("log")
    axes[0].set_ylabel("eval loss (byte cross entropy)")
    handles = [plt.Line2D([], [], color=colours[n], marker=".", label=n) for n in names]
    figure.legend(handles=handles, loc="lower center", ncol=len(names), fontsize=7, frameon=False)
    figure.subplots_adjust(bottom=0.25)
    figure.tight_layout(rect=(0, 0.08, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--networks", default="1gbit,100mbit,20mbit,islands")
    parser.add_argument("--rows", default="data_parallel,diloco_fp32,diloco_fp16,streaming_int8,streaming_int4,"
                                          "islands,auto,torchdistributor_ddp")
    parser.add_argument("--quick", action="store_true", help="2 epochs, 1 Gbit/s only: a smoke run")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "slow_links.json")
    parser.add_argument("--plot", type=Path, default=HERE.parent / "docs" / "img" / "slow_links.png")
    parser.add_argument("--merge", action="store_true",
                        help="keep the rows of --out's earlier run that this run does not measure again")
    args, passed = parser.parse_known_args()
    why = multihost.why_not()
    if why:
        raise SystemExit(f"slow_links needs the multi-host bed: {why}")
    root = Path("/var/tmp") / f"sparkdl-slow-links-{os.getpid()}"
    shutil.rmtree(root, ignore_errors=True)
    started = time.time()
    load_before = os.getloadavg()
    extra = ["--epochs", "2"] if args.quick else []
    networks = "1gbit" if args.quick else args.networks
    try:
        with multihost.Bed(root, workers=4, worker_cores=1, worker_memory="2g") as bed:
            out, ask = bed.shared / "slow_links.json", bed.shared / "ask"
            with Controller(bed, ask):
                done = bed.run_on(bed.driver, [sys.executable, str(DRIVER), bed.master_url, str(out), "--shared",
                                               str(bed.shared), "--ask", str(ask), "--networks", networks,
                                               "--rows", args.rows, *extra, *passed], timeout=60 * 60)
            sys.stderr.write(done.stderr[-8000:])
            if not out.exists():
                raise SystemExit(f"the driver wrote nothing (rc {done.returncode})")
            raw = json.loads(out.read_text())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.merge and args.out.exists():
        earlier = json.loads(args.out.read_text())["raw"]
        for network, data in raw["networks"].items():
            earlier["networks"].setdefault(network, {"links": data["links"], "rows": {}})["rows"].update(data["rows"])
        raw = {**earlier, "merged_runs": earlier.get("merged_runs", 1) + 1}
    summary = summarise(raw)
    result = {"benchmark": "slow_links", "hosts": "4 worker hosts (1 core, 1 rank each) + master + driver, "
              "network namespaces on one 2-core machine", "model": "GPT 2 blocks d=128, byte tokens, 64 a row",
              "params": raw.get("params"), "steps_per_epoch": raw.get("steps_per_epoch"),
              **summary, "raw": raw, "seconds": round(time.time() - started, 1),
              "loadavg_start": [round(x, 2) for x in load_before], "loadavg_end": [round(x, 2) for x in os.getloadavg()]}
    if not args.quick:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        plot(raw, summary, args.plot)
    print(markdown(summary), file=sys.stderr)
    print(json.dumps({k: v for k, v in result.items() if k != "raw"}))


if __name__ == "__main__":
    main()
