"""On a real standalone cluster (a Master and two Workers of pyspark's own spark-class on 127.0.0.1):
`sparkdl submit` of the CLI trains and saves a model; a fit survives SIGKILL of a whole executor JVM
by resuming from its checkpoint with the weights of an uninterrupted run; executors that register
late are waited for as long as Spark's own barrier check would wait. Applications run in subprocesses (this process keeps its
local-cluster session)."""
from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from sparkdl.datasets import digits_dataframe
from sparkdl.estimator import TorchModel
import multihost
import standalone_fit
from standalone import StandaloneCluster, environment

SUPPORT = Path(__file__).resolve().parents[1] / "support"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):  # type: ignore[no-untyped-def]
    standalone = StandaloneCluster(tmp_path_factory.mktemp("standalone"))
    try:
        standalone.start_master()
        standalone.start_worker(0)
        standalone.start_worker(1)
        yield standalone
    finally:
        standalone.stop()


def fit(master: str, out: Path, *extra: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, str(SUPPORT / "standalone_fit.py"), master, str(out), *extra], cwd=REPO,
                          env=environment(), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


@pytest.mark.skipif(multihost.why_not() is None,
                    reason="the multi-host bed runs this fit with the executor on a host of its own "
                           "(tests/spark/test_multihost.py, scenario 'kill'); here only where it cannot run")
def test_a_killed_executor_jvm_is_replaced_and_the_fit_resumes_exactly(spark, cluster, tmp_path) -> None:  # type: ignore[no-untyped-def]
    marker = tmp_path / "killed"
    done = fit(cluster.url, tmp_path / "resumed.pt", "--kill-marker", str(marker),
               "--checkpoint-dir", str(tmp_path / "checkpoints"))
    assert marker.exists(), "the executor was never killed"
    output = done.stdout + done.stderr
    assert "Lost executor" in output and "attempt 1 of 4 failed" in output
    # The kill waits until a checkpoint is loadable and takes the rank's Python worker too
    # (standalone_fit), so the resume falls inside the 20 steps (saves every 3 and at epoch ends).
    resumed_at = int(re.search(r"resumed from the checkpoint of step (\d+)", output).group(1))  # type: ignore[union-attr]
    assert 3 <= resumed_at < 20, output[-3000:]
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=False)
    # A resume inside epoch 1 keeps epoch 0's record as saved: the resumed epoch's record names the step.
    assert [h["resumed_from_step"] for h in resumed["history"] if "resumed_from_step" in h] == [resumed_at]
    # The uninterrupted reference: the same fit (two fixed partitions, same seed) on this process's
    # local-cluster session; the ranks' arithmetic does not depend on the cluster manager.
    reference = {"state": standalone_fit.reference_fit(spark)}
    for key, value in reference["state"].items():
        torch.testing.assert_close(resumed["state"][key], value, atol=1e-5, rtol=0, msg=key)


def test_sparkdl_submit_waits_for_late_executors_then_trains_and_saves(spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`sparkdl submit --master spark://...` of the CLI while only one of the two Workers is up: with
    no slot_wait_s set the fit waits as Spark's barrier check would (10 minutes by default), saying
    so, for the second Worker, which arrives 20 s later; then trains on both and saves the model."""
    data = tmp_path / "digits.parquet"
    digits_dataframe(spark).write.parquet(str(data))
    out = tmp_path / "model"
    late = StandaloneCluster(tmp_path)
    try:
        late.start_master()
        late.start_worker(0)  # one of the two slots the fit needs
        driver = subprocess.Popen(
            [sys.executable, "-m", "sparkdl", "submit", "--master", late.url, "--conf", "spark.ui.enabled=false",
             "--conf", "spark.executor.memory=768m", "--", "train", "--conf", "conf/examples/digits.toml",
             "--set", f"input.path={data}", "--set", f"output.model_path={out}", "--set", "train.epochs=2",
             "--set", f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
             "--set", "tracking.progress=false"], cwd=REPO, env=environment(), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)  # under spark-submit Python's log lines may reach stdout
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(driver.stdout), daemon=True)  # type: ignore[arg-type]
        reader.start()
        deadline = time.monotonic() + 420  # a loaded machine takes minutes to get there
        while not any("waiting for task slots: 1 of 2 free" in line for line in lines):  # the wait is shown
            assert driver.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.5)
        time.sleep(20)  # the second Worker arrives later, while the fit says it waits
        assert driver.poll() is None, "".join(lines)[-3000:]
        late.start_worker(1)
        driver.wait(timeout=400)
        reader.join(timeout=30)
        assert driver.returncode == 0, "".join(lines)[-4000:]
        launched = [(tmp_path / f"worker-{i}.log").read_text() for i in (0, 1)]
        assert all("Asked to launch executor app-" in log for log in launched)  # both workers ran the training
    finally:
        late.stop()
    model = TorchModel.load(str(out))
    assert len(model.history) == 2 and model.history[-1]["loss"] < model.history[0]["loss"]
