"""Spot-safe runs on a real standalone cluster (a Master and 1-core Workers of pyspark's own
spark-class on 127.0.0.1): a Worker and its executor killed for good mid-run (nothing relaunches
them) -> the fit goes on with the 2 workers left, its data parallel weights equal to a run that
resumed the same checkpoint on 2 workers; fewer slots than min_workers -> a TrainingError naming
the slots found; a worker that comes back -> the fit grows to 3 at the next epoch end. Tracked by a
real MLflow server: a run that shrinks and grows back ends FINISHED with every change in
membership.json and the workers metric; a run of fixed size that loses a host ends FAILED with a
TrainingError naming min_workers. Applications run in subprocesses (this process keeps its
local-cluster session)."""
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
# Mostly waiting (JVMs starting, a host's replacement, replacement_wait_s): `make test` runs it in the
# bed's lane, beside the main one (setup.cfg's bed_lane marker).
pytestmark = [pytest.mark.timeout(900), pytest.mark.bed_lane]
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


def shrink_and_grow_back(cluster: StandaloneCluster, tmp_path: Path, *extra: str) -> tuple[int, str, dict]:
    """A 3-worker fit that loses a Worker for good (-> 2) and gets a replacement once it went on with 2
    (-> 3 at an epoch end): (its exit status, its output, what it saved)."""
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
                               str(marker), *extra], cwd=REPO, env=environment(), stdout=sink, stderr=subprocess.STDOUT,
                              timeout=600)
    helper.join(60)
    output = log.read_text(errors="replace")
    saved = torch.load(tmp_path / "grown.pt", weights_only=False) if done.returncode == 0 else {}
    return done.returncode, output, saved


@ON_THE_BED
def test_a_worker_that_comes_back_grows_the_run_at_an_epoch_end(cluster, tmp_path) -> None:  # type: ignore[no-untyped-def]
    returncode, output, grown = shrink_and_grow_back(cluster, tmp_path)
    assert returncode == 0, output[-5000:]
    workers = [h["workers"] for h in grown["history"]]
    assert 2 in workers and workers[-1] == 3, (workers, output[-3000:])
    changes = [c for h in grown["history"] for c in h.get("membership", [])]
    assert [(c["from_workers"], c["to_workers"]) for c in changes] == [(3, 2), (2, 3)]
    assert changes[1]["reason"] == "slots returned" and "sparkdl: workers 2 -> 3 (slots returned" in output
    assert changes[1]["global_batch"] == changes[0]["global_batch"] == 24
    assert all(h["val_loss"] < 1.2 for h in grown["history"][-2:])  # it kept learning through both changes


def test_a_run_that_shrinks_and_grows_back_keeps_its_whole_mlflow_record(cluster, mlflow_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Issue 52: each attempt re-logged world.size, MLflow refused the changed value and tracking went
    off: the run stayed RUNNING, without its loss curve, and the grow-back never reached MLflow."""
    from mlflow import MlflowClient

    returncode, output, grown = shrink_and_grow_back(cluster, tmp_path, "--tracking-uri", mlflow_server.uri,
                                                     "--experiment", "sparkdl-elastic")
    assert returncode == 0, output[-5000:]
    assert "MLflow tracking failed" not in output, output[-3000:]
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    run = client.get_run(grown["run_id"])
    assert run.info.status == "FINISHED"
    changes = [c for h in grown["history"] for c in h.get("membership", [])]
    assert [(c["from_workers"], c["to_workers"]) for c in changes] == [(3, 2), (2, 3)]
    logged = json.loads(Path(client.download_artifacts(run.info.run_id, "membership.json", str(tmp_path))).read_text())
    assert logged == changes  # every change, the grow-back too, as the history has them
    workers = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "workers"))
    assert workers == [(0, 3.0), (1, 2.0), (2, 3.0)]
    # Each attempt's world: metrics over the attempts and a tag each; params only the first one's.
    sizes = [m.value for m in sorted(client.get_metric_history(run.info.run_id, "world_size"), key=lambda m: m.step)]
    assert [s for i, s in enumerate(sizes) if i == 0 or s != sizes[i - 1]] == [3.0, 2.0, 3.0], sizes
    assert run.data.tags["sparkdl.attempts"] == str(len(sizes)) and run.data.params["world.size"] == "3"
    assert "2 workers on" in run.data.tags["sparkdl.attempt.2.world"]
    epochs = {m.step for m in client.get_metric_history(run.info.run_id, "epoch_loss")}
    assert epochs == set(range(12))  # the whole loss curve, across both changes
    assert {"loss_curve.png", "membership.json"} <= {a.path for a in client.list_artifacts(run.info.run_id)}


def test_a_run_of_fixed_size_that_loses_a_host_fails_naming_min_workers(cluster, mlflow_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """min_workers unset (= num_workers): the run waits replacement_wait_s for a replacement, then
    fails naming what it lost and min_workers (was: the slot check's InsufficientSlotsError)."""
    from mlflow import MlflowClient

    restore_workers(cluster, 3)
    marker = tmp_path / "killed"
    done = fit(cluster, tmp_path / "none.pt", "--checkpoint-dir", str(tmp_path / "checkpoints"), "--kill-marker",
               str(marker), "--tracking-uri", mlflow_server.uri, "--experiment", "sparkdl-fixed-size-loss",
               check=False)
    assert marker.exists() and done.returncode != 0
    assert re.search(r"TrainingError: the run lost (executors|host\(s\) [^:]+): 2 slot\(s\) found after waiting "
                     r"launch.replacement_wait_s=5 s for replacements, fewer than launch.min_workers=3 "
                     r"\(unset: num_workers\) \(it had 3\)", done.stderr), done.stderr[-3000:]
    assert "InsufficientSlotsError" not in done.stderr
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    (run,) = client.search_runs([client.get_experiment_by_name("sparkdl-fixed-size-loss").experiment_id])
    assert run.info.status == "FAILED"
    assert "failure.txt" in {a.path for a in client.list_artifacts(run.info.run_id)}
