"""Two measurements on the multi-host bed behind the planner's accuracy figures (docs/benchmarks.md,
"Planner accuracy on the bed"), printed as JSON:

  sudo .venv/bin/python benchmarks/bed_diagnostics.py idle [--host-cpus 0.5]
      one worker host of --host-cpus cores (a cgroup cpu.max quota, as planner_accuracy_bed.py
      makes them), quiet and with a busy loop beside the rank: the MLP's training step timed back to
      back (as the calibration's trial times it) and after an idle pause of 5-600 ms (as a rank
      resumes after blocking in a collective);
  sudo .venv/bin/python benchmarks/bed_diagnostics.py collectives [--mbit 20] [--host-cpus 0]
      two worker hosts on a shaped link: gloo allreduce and allgather of IST's subnet (85,002
      floats) and of the whole MLP (301,066), back to back and after idle pauses (median, best ms).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "support"))

from multihost import Bed  # noqa: E402 - tests/support

STEP = r'''
import json, statistics, time, torch
from torch import nn
torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
optimizer = torch.optim.Adam(model.parameters(), 1e-3)
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
def step():
    began = time.perf_counter()
    optimizer.zero_grad(); torch.nn.functional.cross_entropy(model(x), y).backward(); optimizer.step()
    return time.perf_counter() - began
for _ in range(5):
    step()
out = {"back_to_back": statistics.median([step() for _ in range(40)])}
for idle in (0.005, 0.02, 0.05, 0.2, 0.6):
    times = []
    for _ in range(12):
        time.sleep(idle)
        times.append(step())
    out[f"after_{int(idle * 1000)}ms_idle"] = statistics.median(times)
print("RESULT " + json.dumps({k: round(v * 1e3, 2) for k, v in out.items()}), flush=True)
'''

COLLECTIVES = r'''
import json, statistics, sys, time, torch, torch.distributed as dist
torch.set_num_threads(1)
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method=f"tcp://{sys.argv[2]}:29555", rank=rank, world_size=2)
def timed(fn, rounds, idle=0.0):
    times = []
    for _ in range(rounds):
        dist.barrier()
        if idle:
            time.sleep(idle)
        began = time.perf_counter(); fn(); times.append(time.perf_counter() - began)
    return [round(statistics.median(times) * 1e3, 1), round(min(times) * 1e3, 1)]
out = {}
for n in (85_002, 301_066):
    x = torch.zeros(n); gathered = [torch.empty_like(x) for _ in range(2)]
    out[f"allreduce_{n}"] = timed(lambda: dist.all_reduce(x), 6)
    out[f"allgather_{n}"] = timed(lambda: dist.all_gather(gathered, x), 6)
    out[f"allgather_{n}_after_150ms_idle"] = timed(lambda: dist.all_gather(gathered, x), 6, 0.15)
    out[f"allgather_{n}_after_600ms_idle"] = timed(lambda: dist.all_gather(gathered, x), 4, 0.6)
print("RESULT " + json.dumps(out), flush=True)
dist.destroy_process_group()
'''


def run_on(bed: Bed, host: Any, script: Path, *args: str) -> subprocess.Popen[str]:
    process = subprocess.Popen(bed.command_on(host, [sys.executable, str(script), *args]), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True,
                               env={**bed.environment(), "GLOO_SOCKET_IFNAME": "eth0"})
    bed._join_cpu_group(host, process.pid)  # the host's CPU capacity, as for what the bed starts itself
    return process


def result_of(process: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = process.communicate(timeout=300)
    line = next((l for l in out.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(err[-2000:])
    return json.loads(line[len("RESULT "):])


def idle(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    script = root / "step.py"
    script.write_text(STEP)
    out: dict[str, Any] = {}
    for load in ("quiet", "hog"):
        bed = Bed(root / load, workers=1, cpus={1: args.host_cpus}).start(spark=False)
        try:
            host = bed.workers[0]
            if load == "hog":
                bed.start_on(host, [sys.executable, "-c", "while True: pass"], "hog")
            out[load] = result_of(run_on(bed, host, script))
        finally:
            bed.stop()
    return {"host_cpus": args.host_cpus, "step_ms": out}


def collectives(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    script = root / "collectives.py"
    script.write_text(COLLECTIVES)
    rate = int(args.mbit * 1e6)
    cpus = {1: args.host_cpus, 2: args.host_cpus} if args.host_cpus else None
    bed = Bed(root / "pair", workers=2, rates={1: rate, 2: rate}, cpus=cpus).start(spark=False)
    try:
        first = bed.workers[0].address
        ranks = [run_on(bed, host, script, str(rank), first) for rank, host in enumerate(bed.workers)]
        results = [result_of(p) for p in ranks]
    finally:
        bed.stop()
    return {"mbit": args.mbit, "host_cpus": args.host_cpus, "ms_median_best_by_rank": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("idle", "collectives"))
    parser.add_argument("--host-cpus", type=float, default=None)
    parser.add_argument("--mbit", type=float, default=20.0)
    args = parser.parse_args()
    if args.host_cpus is None:
        args.host_cpus = 0.5 if args.what == "idle" else 0.0
    # the bed's root lies outside /tmp (every host mounts its own)
    with tempfile.TemporaryDirectory(dir=str(HERE.parent), prefix=".bed-diagnostics-") as root:
        result = idle(args, Path(root)) if args.what == "idle" else collectives(args, Path(root))
    print(json.dumps({"benchmark": f"bed_diagnostics {args.what}", **result, "loadavg": list(os.getloadavg())}))


if __name__ == "__main__":
    main()
