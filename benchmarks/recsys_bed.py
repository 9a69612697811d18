"""benchmarks/recsys.py --mode bed: the issue's full benchmark on the multi-host bed (issue 45).

W worker hosts (network namespaces with their own addresses and links shaped with tbf at --gbps,
tests/support/multihost.py; one Spark core and one rank each, on this machine's cores), a standalone
master, the driver on a host of its own (its link unshaped). recsys_bed_driver.py runs on the driver
host: sparkdl sharded, sparkdl replicated (where sparkdl has it) and TorchDistributor DDP, side by
side on the same data, DLRM, batch, epochs and optimizers. This process carries out the driver's
requests (bed_controller.Controller) plus one more, {"do": "counters"}: what each worker host's link
carried so far (its switch port's counters: bytes the host sent and received, whoever sent them).

Figures per variant over the steady epochs (2..E; epoch 1 streams the data and warms up):
  samples_per_s          samples / seconds of those epochs (sparkdl: the history's records; DDP:
                         the train function's clock around its steps), and the median epoch's
  wire_bytes_per_step_per_rank   the worker hosts' sent bytes between the end of epoch 1 and the
                         end of the last epoch (read at each epoch end while no step runs), / steps / W
  counted_bytes_per_step_per_rank  sparkdl only: its communicators' own counters (history)
  auc                    on the held-out rows, after the same epochs
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "support"))

import multihost  # noqa: E402
from bed_controller import Controller  # noqa: E402

DRIVER = HERE / "recsys_bed_driver.py"
TARGETS = {"bytes_fewer_x": 3.0, "samples_per_s_x": 2.0, "auc_within": 0.002}


class CounterController(Controller):
    """The bed's controller with {"do": "counters"}: {address: {"sent", "received"}} of every worker
    host and the driver host, from the switch side of their links (rx there = what the host sent)."""

    def _do(self, asked: dict[str, Any]) -> dict[str, Any]:
        if asked["do"] != "counters":
            return super()._do(asked)
        out = {}
        for host in [*self.bed.workers, self.bed.driver]:
            shown = subprocess.run(["ip", "-j", "-s", "-n", self.bed.switch, "link", "show", "dev", f"p{host.index}"],
                                   capture_output=True, text=True, check=True)
            stats = json.loads(shown.stdout)[0]["stats64"]
            out[host.address] = {"sent": stats["rx"]["bytes"], "received": stats["tx"]["bytes"]}
        return {"at": time.time(), "hosts": out, "workers": [h.address for h in self.bed.workers]}


def run(opts: dict[str, Any]) -> dict[str, Any]:
    """Start the bed, run the driver script on it, stop everything; the driver's raw JSON."""
    why = multihost.why_not()
    if why:
        raise SystemExit(f"recsys --mode bed needs the multi-host bed: {why}")
    root = Path("/var/tmp") / f"sparkdl-recsys-{os.getpid()}"
    shutil.rmtree(root, ignore_errors=True)
    rate = int(opts["gbps"] * 1e9)
    try:
        with multihost.Bed(root, workers=opts["world"], rates={n: rate for n in range(1, opts["world"] + 1)},
                           worker_cores=1, worker_memory="3g") as bed:
            out, ask = bed.shared / "recsys.json", bed.shared / "ask"
            with CounterController(bed, ask):
                done = bed.run_on(bed.driver, [sys.executable, str(DRIVER), bed.master_url, str(out), "--shared",
                                               str(bed.shared), "--ask", str(ask), "--opts", json.dumps(opts)],
                                  timeout=opts["bed_timeout_s"])
            sys.stderr.write(done.stderr[-6000:])
            if not out.exists():
                raise SystemExit(f"the bed's driver wrote nothing (rc {done.returncode})")
            return {**json.loads(out.read_text()), "driver_rc": done.returncode}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _sent(links: dict[str, Any], workers: list[str]) -> dict[str, int]:
    return {a: int(links["hosts"][a]["sent"]) for a in workers}


def figures(row: dict[str, Any], world: int) -> dict[str, Any]:
    """A variant's steady-state figures (epochs 2..E) from its raw epochs."""
    epochs = row["epochs"]
    steady = epochs[1:] or epochs
    steps = sum(e["steps"] for e in steady)
    samples, seconds = sum(e["samples"] for e in steady), sum(e["seconds"] for e in steady)
    out: dict[str, Any] = {"epochs": len(epochs), "steady_steps": steps,
                           "samples_per_s": round(samples / seconds, 1),
                           "median_epoch_samples_per_s": round(statistics.median(e["samples"] / e["seconds"]
                                                                                 for e in steady), 1),
                           "auc": round(row["auc"], 5), "fit_wall_s": row["fit_wall_s"]}
    if "step_s" in row:
        out["median_step_s"] = round(statistics.median(row["step_s"][len(row["step_s"]) // len(epochs):]), 4)
    if len(epochs) > 1 and epochs[0].get("links") and epochs[-1].get("links"):
        workers = epochs[0]["links"]["workers"]
        first, last = _sent(epochs[0]["links"], workers), _sent(epochs[-1]["links"], workers)
        per_rank = {a: (last[a] - first[a]) / steps for a in workers}
        out["wire_bytes_per_step_per_rank"] = round(sum(per_rank.values()) / world)
        out["wire_bytes_per_step_by_host"] = {a: round(v) for a, v in per_rank.items()}
    if "bytes_sent_all_ranks" in steady[0]:
        out["counted_bytes_per_step_per_rank"] = round(sum(e["bytes_sent_all_ranks"] for e in steady) / steps / world)
    for key in ("options", "table_gradients", "sparse_gradients_error"):
        if row.get(key):
            out[key] = row[key]
    return out


def summarise(raw: dict[str, Any], opts: dict[str, Any]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for name, row in raw.get("variants", {}).items():
        if "epochs" in row:
            table[name] = figures(row, opts["world"])
        else:
            table[name] = {k: v for k, v in row.items() if k in ("skipped", "error", "trace", "variant_wall_s")}
    result: dict[str, Any] = {"variants": table, "planted_model_auc": round(raw.get("planted_model_auc", 0.0), 5),
                              "train_rows": raw.get("train_rows"), "table_rows": raw.get("table_rows")}
    sharded, ddp = table.get("sharded", {}), table.get("ddp", {})
    if "auc" in sharded and "auc" in ddp:
        ratios: dict[str, Any] = {
            "samples_per_s_sharded_over_ddp": round(sharded["samples_per_s"] / ddp["samples_per_s"], 2),
            "auc_sharded_minus_ddp": round(sharded["auc"] - ddp["auc"], 5)}
        if sharded.get("wire_bytes_per_step_per_rank") and ddp.get("wire_bytes_per_step_per_rank"):
            ratios["wire_bytes_ddp_over_sharded"] = round(ddp["wire_bytes_per_step_per_rank"]
                                                          / sharded["wire_bytes_per_step_per_rank"], 1)
        ratios["targets"] = {
            "bytes >= 3x fewer": ratios.get("wire_bytes_ddp_over_sharded", 0) >= TARGETS["bytes_fewer_x"],
            "samples/s >= 2x": ratios["samples_per_s_sharded_over_ddp"] >= TARGETS["samples_per_s_x"],
            "AUC within 0.002": abs(ratios["auc_sharded_minus_ddp"]) <= TARGETS["auc_within"]}
        result["ratios"] = ratios
    return result


def markdown(summary: dict[str, Any]) -> str:
    lines = ["| variant | wire bytes / step / rank | sparkdl counted | samples/s (steady) | held-out AUC |",
             "|---|---:|---:|---:|---:|"]
    for name, f in summary["variants"].items():
        if "auc" not in f:
            lines.append(f"| {name} | {f.get('skipped') or f.get('error', '')[:80]} | | | |")
            continue
        wire, counted = f.get("wire_bytes_per_step_per_rank"), f.get("counted_bytes_per_step_per_rank")
        lines.append(f"| {name} | {wire / 1e6:.3f} MB | " + (f"{counted / 1e6:.3f} MB" if counted else "") +
                     f" | {f['samples_per_s']:,.0f} | {f['auc']:.4f} |" if wire else f"| {name} | | | "
                     f"{f['samples_per_s']:,.0f} | {f['auc']:.4f} |")
    return "\n".join(lines)


def main(opts: dict[str, Any], out: Path | None) -> None:
    started, load_before = time.time(), os.getloadavg()
    uptime_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    raw = run(opts)
    result = {"benchmark": "recsys_bed", "config": opts,
              "hosts": f"{opts['world']} worker hosts (1 core, 1 rank each, links {opts['gbps'] * 1000:g} Mbit/s) "
                       "+ master + driver, network namespaces on one 2-core machine",
              **summarise(raw, opts), "raw": raw, "seconds": round(time.time() - started, 1),
              "uptime_before": uptime_before,
              "uptime_after": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
              "loadavg_start": [round(x, 2) for x in load_before],
              "loadavg_end": [round(x, 2) for x in os.getloadavg()]}
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
    sys.stderr.write(markdown(result) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "raw"}))
