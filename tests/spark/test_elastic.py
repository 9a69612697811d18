"""Spot-safe runs on a real standalone cluster (a Master and 1-core Workers of pyspark's own
spark-class on 127.0.0.1): a Worker and its executor killed for good mid-run (nothing relaunches
them) -> the fit goes on with the 2 workers left, its data parallel weights equal to a run that
resumed the same checkpoint on 2 workers; fewer slots than min_workers -> a TrainingError naming
the slots found; a worker that comes back -> the fit grows to 3 at the next epoch end.
Applications run in subprocesses (this process keeps its local-cluster session)."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import multihost
from standalone import StandaloneCluster, descendants, environment

SUPPORT = Path(__file__).resolve().parents[1] / "support"
REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(900)
# Where the multi-host bed runs, tests/spark/test_multihost_elastic.py runs these on hosts of their own.
ON_THE_BED = pytest.mark.skipif(multihost.why_not() is None, reason="the multi-host bed runs this across hosts "
                                "(tests/spark/test_multihost_elastic.py); here only where it cannot run")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):  # type: ignore[no-untyped-def]
    standalone = StandaloneCluster(tmp_path_factory.mktemp("elastic"), memory="900m")
    try:
        standalone.start_master()
        for index in range(3):
            standalone.start_worker(index)
        standalone.next_worker = 3  # type: ignore[attr-defined]
        yield standalone
    finally:
        standalone.stop()


def workers_alive(cluster: StandaloneCluster) -> int:
    return sum(1 for p in cluster._processes[1:] if p.poll() is None)  # noqa: SLF001 - the test's own cluster


def restore_workers(cluster: StandaloneCluster, count: int) -> None:
    """Exactly `count` live workers: new ones started, extra ones stopped with their executors (by PID)."""
    while workers_alive(cluster) < count:
        cluster.start_worker(cluster.next_worker)  # type: ignore[attr-defined]
        cluster.next_worker += 1  # type: ignore[attr-defined]
    extra = [p for p in cluster._processes[1:] if p.poll() is None][count:]  # noqa: SLF001
    for process in extra:
        for pid in [*descendants(process.pid), process.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.wait(20)
    if extra:
        time.sleep(2)  # the master drops them from its workers


def fit(cluster: StandaloneCluster, out: Path, *extra: str, check: bool = True, timeout: float = 420
        ) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, str(SUPPORT / "elastic_fit.py"), cluster.url, str(out), *extra], cwd=REPO,
                          env=environment(), capture_output=True, text=True, timeout=timeout)
    if check:
        assert done.returncode == 0, done.stderr[-5000:]
    return done


@ON_THE_BED
def test_a_host_lost_for_good_shrinks_the_run_and_data_parallel_matches_a_resume_on_two(cluster, tmp_path) -> None:  # type: ignore[no-untyped-def]
    restore_workers(cluster, 3)
    checkpoints, marker = tmp_path / "checkpoints", tmp_path / "killed"
    done = fit(cluster, tmp_path / "elastic.pt", "--checkpoint-dir", str(checkpoints), "--min-workers", "2",
               "--kill-marker", str(marker))
    assert marker.exists(), "the worker was never killed"
    output = done.stdout + done.stderr
    assert "sparkdl: workers 3 -> 2 (executors lost" in output
    step = int(re.search(r"resuming the checkpoint of step (\d+), written by 3 workers, on 2", output).group(1))  # type: ignore[union-attr]
    elastic = torch.load(tmp_path / "elastic.pt", weights_only=False)
    history = elastic["history"]
    assert [h["workers"] for h in history][-1] == 2 and history[0]["workers"] in (2, 3)
    (changed,) = [h for h in history if "membership" in h]
    (change,) = changed["membership"]
    assert (change["from_workers"], change["to_workers"]) == (3, 2)
    assert change["global_batch"] == 24 and change["per_rank_batch"] == 12

    # The reference: the same checkpoint resumed on 2 workers from the start (a copy, its manifest
    # cut back to the step the elastic run resumed).
    (run,) = elastic["runs"]
    copy = tmp_path / "reference-checkpoints"
    shutil.copytree(checkpoints / run, copy / run)
    manifest = json.loads((copy / run / "manifest.json").read_text())
    manifest["steps"] = [s for s in manifest["steps"] if s["step"] <= step]
    assert manifest["steps"][-1]["step"] == step and manifest["steps"][-1]["world_size"] == 3
    (copy / run / "manifest.json").write_text(json.dumps(manifest))
    fit(cluster, tmp_path / "reference.pt", "--checkpoint-dir", str(copy), "--workers", "2", "--batch", "12",
        "--resume-run", run)
    reference = torch.load(tmp_path / "reference.pt", weights_only=False)
    for key, value in reference["state"].items():
        torch.testing.assert_close(elastic["state"][key], value, atol=1e-6, rtol=0, msg=key)
    assert [h["loss"] for h in elastic["history"][1:]] == pytest.approx([h["loss"] for h in reference["history"][1:]],
                                                                         rel=1e-5)


@ON_THE_BED
def test_below_min_workers_the_fit_fails_naming_the_slots_found(cluster, tmp_path) -> None:  # type: ignore[no-untyped-def]
    restore_workers(cluster, 2)
    marker = tmp_path / "killed"
    started = time.monotonic()
    done = fit(cluster, tmp_path / "none.pt", "--checkpoint-dir", str(tmp_path / "checkpoints"), "--workers", "2",
               "--min-workers", "2", "--max-workers", "3", "--grow", "--kill-rank", "1", "--kill-marker", str(marker),
               check=False)
    assert marker.exists() and done.returncode != 0
    assert re.search(r"TrainingError: the run lost executors: 1 slot\(s\) found after waiting "
                     r"launch.replacement_wait_s=5 s for replacements, fewer than launch.min_workers=2 \(it had 2\)",
                     done.stderr), done.stderr[-3000:]
    assert time.monotonic() - started < 240


@ON_THE_BED
def test_a_worker_that_comes_back_grows_the_run_at_an_epoch_end(cluster, tmp_path) -> None:  # type: ignore[no-untyped-def]
    restore_workers(cluster, 3)
    marker, log = tmp_path / "killed", tmp_path / "fit.log"

    def replace_the_host() -> None:  # a replacement registers once the run went on with 2
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if log.exists() and "sparkdl: workers 3 -> 2" in log.read_text(errors="replace"):
                restore_workers(cluster, 3)
                return
            time.sleep(0.5)

    helper = threading.Thread(target=replace_the_host, daemon=True)
    helper.start()
    with open(log, "w") as sink:
        done = subprocess.run([sys.executable, str(SUPPORT / "elastic_fit.py"), cluster.url, str(tmp_path / "grown.pt"),
                               "--checkpoint-dir", str(tmp_path / "checkpoints"), "--min-workers", "2", "--grow",
                               "--sync", "diloco", "--epochs", "12", "--step-sleep", "0.2", "--kill-marker",
                               str(marker)], cwd=REPO, env=environment(), stdout=sink, stderr=subprocess.STDOUT,
                              timeout=600)
    helper.join(60)
    output = log.read_text(errors="replace")
    assert done.returncode == 0, output[-5000:]
    grown = torch.load(tmp_path / "grown.pt", weights_only=False)
    workers = [h["workers"] for h in grown["history"]]
    assert 2 in workers and workers[-1] == 3, (workers, output[-3000:])
    changes = [c for h in grown["history"] for c in h.get("membership", [])]
    assert [(c["from_workers"], c["to_workers"]) for c in changes] == [(3, 2), (2, 3)]
    assert changes[1]["reason"] == "slots returned" and "sparkdl: workers 2 -> 3 (slots returned" in output
    assert changes[1]["global_batch"] == changes[0]["global_batch"] == 24
    assert all(h["val_loss"] < 1.2 for h in grown["history"][-2:])  # it kept learning through both changes
