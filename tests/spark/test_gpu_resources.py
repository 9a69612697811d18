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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

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
if mode == "stage":  # the same application: 2 executors x 2 GPUs hold only 2 ranks of 2 GPUs each
    try:
        sparkdl.run(report, num_workers=4, progress=False, gpus_per_worker=2)
    except sparkdl.SparkdlError as exc:
        print("REFUSED " + json.dumps({"type": type(exc).__name__, "message": str(exc)}))
    exec(open(sys.argv[3]).read())  # scoring in this CPU-default application too (INFERENCE below)
spark.stop()
'''


def discovery_script(directory: Path) -> Path:
    discover = directory / "discover_gpus.sh"
    discover.write_text('#!/usr/bin/env bash\necho \'{"name": "gpu", "addresses": ["0", "1"]}\'\n')
    discover.chmod(0o755)
    return discover


def run_script(directory: Path, source: str, *args: str) -> dict[str, list[Any]]:
    """Run `source` in a subprocess (an application of its own); its "TAG {json}" lines by tag."""
    script = directory / "gpu_job.py"
    script.write_text(source)
    done = subprocess.run([sys.executable, str(script), str(discovery_script(directory)), *args],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    tagged: dict[str, list[Any]] = {}
    for line in done.stdout.splitlines():
        tag, _, rest = line.partition(" ")
        if tag.isupper() and rest.startswith(("[", "{")):
            tagged.setdefault(tag, []).append(json.loads(rest))
    return tagged


@pytest.fixture(scope="module")
def applications(tmp_path_factory) -> dict[str, dict[str, list[Any]]]:  # type: ignore[no-untyped-def]
    """One application per mode, both at once (each mostly waits on JVMs starting); "stage" also
    tries a run its GPUs cannot hold, and scores (INFERENCE_SCRIPT)."""
    inference = tmp_path_factory.mktemp("inference") / "inference.py"
    inference.write_text(INFERENCE_SCRIPT)
    with ThreadPoolExecutor(2) as pool:
        runs = {mode: pool.submit(run_script, tmp_path_factory.mktemp(mode), SCRIPT, mode, str(inference))
                for mode in ("application", "stage")}
        return {mode: run.result() for mode, run in runs.items()}


@pytest.mark.parametrize("mode", ["application", "stage"])
def test_every_rank_gets_its_own_gpu_address(applications, mode: str) -> None:  # type: ignore[no-untyped-def]
    ranks = applications[mode]["RESULT"][-1]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert all(len(r["gpus"]) == 1 for r in ranks)
    # two executors with GPUs 0 and 1 each: every (executor, GPU) pair is used exactly once
    assert len({(r["executor"], r["gpus"][0]) for r in ranks}) == 4
    assert all(r["visible"] == r["gpus"][0] for r in ranks)  # CUDA_VISIBLE_DEVICES follows the assignment
    import torch

    if not torch.cuda.is_available():
        assert all(r["device"] == "cpu" for r in ranks)  # no CUDA: gloo on CPU, whatever Spark assigned



# Run inside the "stage" application (CPU-default tasks, two executors of two GPU addresses each):
# one application fewer to start.
INFERENCE_SCRIPT = '''
import torch
from pyspark import TaskContext
from sparkdl import TorchModel
from sparkdl.data.layout import FeedLayout


class WhichGpu(torch.nn.Module):
    """Scores every row with the GPU address its task was given (-1: none), and the device it ran on."""
    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x):
        gpu = TaskContext.get().resources().get("gpu")
        address = float(gpu.addresses[0]) if gpu else -1.0
        on_cuda = 1000.0 if x.is_cuda else 0.0
        return torch.full((x.shape[0], 1), address + on_cuda, device=x.device)


df = spark.range(0, 64, 1, 8).selectExpr("cast(id as float) as x")
for amount in (0.0, 0.5):  # one application, both scoring stages
    model = TorchModel(module=WhichGpu(), layout=FeedLayout(num_features=1, label_dtype=None,
                                                            source_feature_cols=("x",)), output_kind="value")
    if amount:
        model.setInferenceGpus(amount)
    rows = model.transform(df).select("prediction").collect()
    print("SCORES " + json.dumps([amount, sorted(r.prediction for r in rows)]))
'''


def test_too_few_gpu_slots_are_refused_before_the_job(applications) -> None:  # type: ignore[no-untyped-def]
    refused = applications["stage"]["REFUSED"][-1]
    assert refused["type"] == "InsufficientSlotsError"
    assert "gpus_per_worker=2" in refused["message"] and "allow only 2" in refused["message"]


@pytest.fixture(scope="module")
def inference_scores(applications) -> dict[float, list[float]]:  # type: ignore[no-untyped-def]
    return {amount: scores for amount, scores in applications["stage"]["SCORES"]}


@pytest.mark.parametrize("amount", [0.0, 0.5])
def test_fractional_gpus_for_inference(inference_scores, amount: float) -> None:  # type: ignore[no-untyped-def]
    """transform in a CPU-default application: with setInferenceGpus(0.5) every scoring task gets one
    of the executor's two GPU addresses through a stage ResourceProfile (two tasks may share each);
    without it, none. Scoring runs on cuda:<address> only where CUDA exists."""
    scores = inference_scores[amount]
    assert len(scores) == 64
    import torch

    cuda = 1000.0 if torch.cuda.is_available() else 0.0
    if amount:
        assert set(scores) <= {0.0 + cuda, 1.0 + cuda}
    else:
        assert set(scores) == {-1.0}


def test_inference_device_follows_the_assigned_gpu() -> None:
    from sparkdl.tracking.inference import inference_device

    assert inference_device([], cuda_available=True) == "cpu"
    assert inference_device(["1"], cuda_available=False) == "cpu"
    assert inference_device(["1"], cuda_available=True) == "cuda:1"
    # a training task narrowed CUDA's view of this worker to physical GPUs 2 and 3
    assert inference_device(["3"], cuda_available=True, visible="2,3") == "cuda:1"
    with pytest.warns(UserWarning, match="GPU 0 is not visible"):
        assert inference_device(["0"], cuda_available=True, visible="2") == "cuda:0"


def test_bad_inference_gpu_amounts_are_refused() -> None:
    from sparkdl import TorchModel
    from sparkdl.errors import ConfigError

    model = TorchModel()
    for bad in (-0.5, 1.5, "one", True, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="inference GPUs per task"):
            model.setInferenceGpus(bad)
    with pytest.raises(ConfigError, match="batch size"):
        model.setInferenceBatchSize(0)
    assert model.setInferenceGpus(0.25).inference_gpus == 0.25


def test_gpus_per_worker_without_executor_gpus_is_refused(spark) -> None:  # type: ignore[no-untyped-def]
    import sparkdl
    from sparkdl.errors import ConfigError

    with pytest.raises(ConfigError, match="executors declare none"):
        sparkdl.run(lambda ctx: None, num_workers=1, gpus_per_worker=1, progress=False)
