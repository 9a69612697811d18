"""GPU assignment without GPUs: a fake discovery script gives every executor of a local-cluster two
GPU addresses and each task one; every rank must see its own address (BarrierTaskContext
resources), with CUDA_VISIBLE_DEVICES following it. Runs in a subprocess: it needs a SparkContext
of its own (one per process). "application": spark.task.resource.gpu.amount=1 for every task;
"stage": a CPU-default application whose training stage alone asks for GPUs
(launch.gpus_per_worker, a stage-level ResourceProfile)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = '''
import json, os, sys
os.environ["PYSPARK_PYTHON"] = sys.executable
from pyspark.sql import SparkSession
import sparkdl
discover, mode = sys.argv[1], sys.argv[2]
builder = (SparkSession.builder.master("local-cluster[2,2,1024]").config("spark.ui.enabled", "false")
           .config("spark.executor.memory", "1g")
           .config("spark.worker.resource.gpu.amount", "2").config("spark.worker.resource.gpu.discoveryScript", discover)
           .config("spark.executor.resource.gpu.amount", "2")
           .config("spark.executor.resource.gpu.discoveryScript", discover))
if mode == "application":  # every task of the application gets a GPU
    builder = builder.config("spark.task.resource.gpu.amount", "1")
spark = builder.getOrCreate()
options = {"gpus_per_worker": 1} if mode == "stage" else {}  # only the training stage asks for GPUs

def report(ctx):
    return ctx.comm.allgather_object({"rank": ctx.rank, "gpus": list(ctx.world.gpus),
                                      "executor": ctx.world.executors[ctx.rank], "device": str(ctx.device),
                                      "visible": os.environ.get("CUDA_VISIBLE_DEVICES")})

print("RESULT " + json.dumps(sparkdl.run(report, num_workers=4, progress=False, **options)))
spark.stop()
'''


@pytest.mark.parametrize("mode", ["application", "stage"])
def test_every_rank_gets_its_own_gpu_address(tmp_path: Path, mode: str) -> None:
    discover = tmp_path / "discover_gpus.sh"
    discover.write_text('#!/usr/bin/env bash\necho \'{"name": "gpu", "addresses": ["0", "1"]}\'\n')
    discover.chmod(0o755)
    script = tmp_path / "gpu_job.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(discover), mode], capture_output=True, text=True,
                          timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    ranks = json.loads(lines[-1][len("RESULT "):])
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert all(len(r["gpus"]) == 1 for r in ranks)
    # two executors with GPUs 0 and 1 each: every (executor, GPU) pair is used exactly once
    assert len({(r["executor"], r["gpus"][0]) for r in ranks}) == 4
    assert all(r["visible"] == r["gpus"][0] for r in ranks)  # CUDA_VISIBLE_DEVICES follows the assignment
    import torch

    if not torch.cuda.is_available():
        assert all(r["device"] == "cpu" for r in ranks)  # no CUDA: gloo on CPU, whatever Spark assigned

