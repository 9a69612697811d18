"""On a real standalone cluster (a Master and two Workers of pyspark's own spark-class on 127.0.0.1):
`sparkdl submit` of the CLI trains and saves a model; a fit survives SIGKILL of a whole executor JVM
by resuming from its checkpoint with the weights of an uninterrupted run; executors that register
late are waited for within slot_wait_s. Applications run in subprocesses (this process keeps its
local-cluster session)."""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sparkdl.datasets import digits_dataframe
from sparkdl.estimator import TorchModel
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


def test_sparkdl_submit_trains_and_saves_on_a_standalone_cluster(spark, cluster, tmp_path) -> None:  # type: ignore[no-untyped-def]
    data = tmp_path / "digits.parquet"
    digits_dataframe(spark).write.parquet(str(data))
    out = tmp_path / "model"
    done = subprocess.run(
        [sys.executable, "-m", "sparkdl", "submit", "--master", cluster.url, "--conf", "spark.ui.enabled=false",
         "--conf", "spark.executor.memory=768m", "--", "train", "--conf", "conf/examples/digits.toml",
         "--set", f"input.path={data}", "--set", f"output.model_path={out}", "--set", "train.epochs=2",
         "--set", f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db", "--set", "tracking.progress=false"],
        cwd=REPO, env=environment(), capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    launched = [(cluster.workdir / f"worker-{i}.log").read_text() for i in (0, 1)]
    assert all("Asked to launch executor app-" in log for log in launched)  # both workers ran the training
    model = TorchModel.load(str(out))
    assert len(model.history) == 2 and model.history[-1]["loss"] < model.history[0]["loss"]


def test_a_killed_executor_jvm_is_replaced_and_the_fit_resumes_exactly(cluster, tmp_path) -> None:  # type: ignore[no-untyped-def]
    marker = tmp_path / "killed"
    marker.touch()  # present: the reference run never kills
    fit(cluster.url, tmp_path / "reference.pt", "--kill-marker", str(marker))
    marker.unlink()
    done = fit(cluster.url, tmp_path / "resumed.pt", "--kill-marker", str(marker),
               "--checkpoint-dir", str(tmp_path / "checkpoints"))
    assert marker.exists(), "the executor was never killed"
    output = done.stdout + done.stderr
    assert "Lost executor" in output and "attempt 1 of 4 failed" in output
    # The rank's Python worker outlives its JVM for a step or two (it notices on its next write to
    # Spark), so the last complete checkpoint is step 6 or 9 of the 20.
    resumed_at = int(re.search(r"resumed from the checkpoint of step (\d+)", output).group(1))  # type: ignore[union-attr]
    assert resumed_at in (6, 9, 12)
    reference, resumed = (torch.load(tmp_path / f"{name}.pt", weights_only=False) for name in ("reference", "resumed"))
    assert resumed["history"][0]["resumed_from_step"] == resumed_at
    for key, value in reference["state"].items():
        torch.testing.assert_close(resumed["state"][key], value, atol=1e-5, rtol=0, msg=key)


def test_executors_that_register_late_are_waited_for(tmp_path) -> None:  # type: ignore[no-untyped-def]
    late = StandaloneCluster(tmp_path)
    try:
        late.start_master()
        late.start_worker(0)  # one of the two slots the fit needs
        marker = tmp_path / "never"
        marker.touch()
        driver = subprocess.Popen([sys.executable, str(SUPPORT / "standalone_fit.py"), late.url, str(tmp_path / "late.pt"),
                                   "--kill-marker", str(marker), "--slot-wait", "120"], cwd=REPO, env=environment(),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(15)  # the driver is up and waiting for slots
        assert driver.poll() is None, driver.communicate()[1][-3000:]
        late.start_worker(1)
        _, stderr = driver.communicate(timeout=400)
        assert driver.returncode == 0, stderr[-4000:]
        assert len(torch.load(tmp_path / "late.pt", weights_only=False)["history"]) == 2
    finally:
        late.stop()
