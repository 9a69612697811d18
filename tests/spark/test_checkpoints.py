"""Checkpoints and resume on local-cluster: a worker killed with SIGKILL mid-epoch makes Spark retry
the barrier stage, every rank resumes from the last complete checkpoint, and the weights equal
those of an uninterrupted run."""
from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from sparkdl import TorchEstimator
from sparkdl.errors import ConfigError, TrainingError

FEATURES = [f"f{i}" for i in range(6)]


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 3))


MARKER = {"path": "", "rank": 1, "calls_per_step": 1}  # shipped by value with the loss, set before each fit
CALLS = {"n": 0}


def killing_loss(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy; the chosen rank's process kills itself (SIGKILL, no clean-up) at its 8th
    step, once per marker file, so the retried attempt trains through."""
    CALLS["n"] += 1
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    at_step_8 = CALLS["n"] == 8 * MARKER["calls_per_step"]
    if rank == MARKER["rank"] and at_step_8 and MARKER["path"] and not os.path.exists(MARKER["path"]):
        Path(MARKER["path"]).touch()
        # After this process's checkpoint writes queued so far (rank 0's: the manifest recording the
        # save of step 3), so the resume point does not depend on how fast the disk is; a kill inside
        # a write is test_a_rank_killed_mid_write_resumes_from_the_last_complete_checkpoint.
        from sparkdl.executor.checkpoint_async import wait_idle

        wait_idle(60)
        os.kill(os.getpid(), signal.SIGKILL)
    return nn.functional.cross_entropy(output, labels)


def failing_loss(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Rank 1 raises at its 3rd step; every call that raises leaves a file behind (one per attempt)."""
    CALLS["n"] += 1
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 1 and CALLS["n"] == 3:
        Path(f"{MARKER['path']}-{os.getpid()}-{time.time_ns()}").touch()
        raise ValueError("bad batch on purpose")
    return nn.functional.cross_entropy(output, labels)


def rows_df(spark):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(11)
    x = rng.normal(size=(160, 6))
    y = (x[:, 0] + x[:, 1] > 0).astype(int) + (x[:, 2] > 1).astype(int)
    data = [(*map(float, r), int(t)) for r, t in zip(x, y)]
    # Exactly two partitions: each rank's shard is the same in every attempt and every run.
    return spark.sparkContext.parallelize(data, 2).toDF(FEATURES + ["label"]).cache()


def fit(df, **options):  # type: ignore[no-untyped-def]
    settings = dict(model=net, feature_cols=FEATURES, label_col="label", batch_size=8, epochs=2, num_workers=2,
                    optimizer="sgd", lr=0.1, momentum=0.9, seed=5, strategy="data_parallel", tracking=False,
                    progress=False, loss=killing_loss, peer_failure_delay_s=0.5)  # nobody needs to be heard first
    settings.update(options)
    return TorchEstimator(**settings).fit(df)


# Killed at step 8 with checkpoints every 3 steps: the saves of steps 3 and 6 were taken, and step 3
# was recorded complete at the save of step 6 (a step is recorded at the next save, once every rank's
# background write is known durable), so the run resumes from step 3.
@pytest.mark.parametrize("options, killed_rank, resumed_from", [
    ({}, 1, 3),
    ({"sync": "diloco", "sync_every": 4}, 1, 3),
    ({"strategy": "ist", "ist_sync_every": 4}, 1, 3),
    # rank 0 holds the last stage: it computes the loss, once per micro-batch
    ({"strategy": "hybrid", "stages": 2, "microbatches": 2}, 0, 3),
    # killed mid-warm-up (optimizer step 4 of 6) inside accumulation windows of 2: the lr schedule's
    # position and the window boundaries come back exactly; the save due at step 3 is taken at the
    # window's end, step 4
    ({"lr_schedule": "cosine", "warmup_steps": 6, "accumulate_steps": 2}, 1, 4),
    # one pass, no spool: the retried attempt streams its partition from Spark again and skips the
    # checkpointed steps' batches (drawn through the shuffle buffer, never assembled)
    ({"epochs": 1, "spool": "none"}, 1, 3),
    # every rank saves and resumes its own shard of the parameters and the optimizer state
    ({"strategy": "sharded"}, 1, 3),
], ids=["data_parallel", "diloco", "ist", "hybrid", "warmup_accumulate", "one_pass", "sharded"])
def test_a_killed_worker_resumes_from_the_last_checkpoint(spark, tmp_path, capsys, options,  # type: ignore[no-untyped-def]
                                                         killed_rank, resumed_from) -> None:
    df = rows_df(spark)
    MARKER.update(path=str(tmp_path / "killed"), rank=killed_rank, calls_per_step=options.get("microbatches", 1))
    Path(MARKER["path"]).touch()  # present: the uninterrupted reference run never kills
    reference = fit(df, **options)
    os.remove(MARKER["path"])

    checkpoints = tmp_path / "checkpoints"
    with pytest.warns(UserWarning) if options.get("strategy") == "ist" else contextlib.nullcontext():
        resumed = fit(df, checkpoint_dir=str(checkpoints), checkpoint_every=3, **options)
    assert os.path.exists(MARKER["path"]), "the worker was never killed"
    captured = capsys.readouterr()
    assert f"resumed from the checkpoint of step {resumed_from}" in captured.out + captured.err
    assert "attempt 1 of 4 failed" in captured.err
    assert resumed.history[0]["resumed_from_step"] == resumed_from  # at most two intervals redone
    assert [h["steps"] for h in resumed.history] == [h["steps"] for h in reference.history] == \
        [10] * options.get("epochs", 2)
    # the epoch's loss includes the steps before the failure (their sums were checkpointed too)
    assert resumed.history[0]["loss"] == pytest.approx(reference.history[0]["loss"], rel=1e-5)
    got, want = resumed.torch_module().state_dict(), reference.torch_module().state_dict()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0, msg=key)
    assert_two_complete_steps_kept(checkpoints)


def assert_two_complete_steps_kept(checkpoints: Path) -> None:
    """The manifest lists the last two steps, only their directories are left, each with both
    ranks' parts, and nothing half-written."""
    import json

    (run_dir,) = [p for p in checkpoints.iterdir()]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    kept = [f"step-{s['step']:09d}" for s in manifest["steps"]]
    assert manifest["world_size"] == 2 and len(kept) == 2
    assert sorted(p.name for p in run_dir.iterdir() if p.is_dir()) == kept
    assert all(sorted(p.name for p in (run_dir / name).iterdir()) == ["rank-0.pt", "rank-1.pt"] for name in kept)
    assert not list(checkpoints.rglob("*.tmp-*"))


MID_WRITE = {"marker": "", "checkpoints": "", "rank": 1, "write_step": 9, "recorded": 6}


def installing_loss(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy; on the chosen rank (while the marker file is absent) it installs the writer's
    hook that kills this process in the middle of a checkpoint write."""
    from sparkdl.executor import checkpoint_async

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == MID_WRITE["rank"] and MID_WRITE["marker"] and not os.path.exists(MID_WRITE["marker"]):
        checkpoint_async.WRITE_HOOK = kill_mid_write
    return nn.functional.cross_entropy(output, labels)


def kill_mid_write(step: int, written: int) -> None:
    """On the writer thread, inside the write of step `write_step` (its bytes so far in a temporary
    file, not renamed): once rank 0 has recorded the previous save in the manifest (a condition,
    polled, so the verdict is deterministic), SIGKILL this process."""
    if step != MID_WRITE["write_step"] or os.path.exists(MID_WRITE["marker"]):
        return
    root = MID_WRITE["checkpoints"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and MID_WRITE["recorded"] not in _recorded_steps(root):
        time.sleep(0.01)
    temporary = [p.name for p in Path(root).glob(f"*/step-{step:09d}/rank-{MID_WRITE['rank']}.pt.tmp-*")] \
        if "://" not in root else ["an upload not completed"]  # an object store shows nothing until the close
    Path(MID_WRITE["marker"]).write_text(f"{written} bytes written; {temporary}; recorded {_recorded_steps(root)}")
    os.kill(os.getpid(), signal.SIGKILL)


def _recorded_steps(root: str) -> list[int]:
    """The steps the run's manifest records, read through sparkdl's storage (a local path or a URI)."""
    import json

    from sparkdl.storage import files as storage

    where = storage.locate(root)
    for run_id in storage.list_names(where):
        manifest = where.child(run_id, "manifest.json")
        try:
            return [s["step"] for s in json.loads(storage.read_all(manifest))["steps"]]
        except (OSError, ValueError):
            pass
    return []


def test_a_rank_killed_mid_write_resumes_from_the_last_complete_checkpoint(spark, tmp_path, capsys  # type: ignore[no-untyped-def]
                                                                           ) -> None:
    df = rows_df(spark)
    checkpoints = tmp_path / "checkpoints"
    MID_WRITE.update(marker=str(tmp_path / "killed"), checkpoints=str(checkpoints))
    Path(MID_WRITE["marker"]).touch()  # present: the reference run installs no hook
    reference = fit(df, loss=installing_loss)
    os.remove(MID_WRITE["marker"])

    resumed = fit(df, loss=installing_loss, checkpoint_dir=str(checkpoints), checkpoint_every=3)
    note = Path(MID_WRITE["marker"]).read_text()
    assert "rank-1.pt.tmp-" in note and "recorded [3, 6]" in note, note  # killed inside the write of step 9
    captured = capsys.readouterr()
    assert "resumed from the checkpoint of step 6" in captured.out + captured.err
    assert resumed.history[0]["resumed_from_step"] == 6
    got, want = resumed.torch_module().state_dict(), reference.torch_module().state_dict()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0, msg=key)
    assert_two_complete_steps_kept(checkpoints)  # the half-written step 9 was deleted at resume
    assert resumed.history[-1]["checkpoint_saves"] == 4 and resumed.history[-1]["checkpoint_write_s"] > 0


def test_a_rank_exception_is_not_retried(spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    MARKER.update(path=str(tmp_path / "raised"), rank=1, calls_per_step=1)
    started = time.monotonic()
    with pytest.raises(TrainingError, match="rank 1.*ValueError: bad batch on purpose"):
        fit(rows_df(spark), loss=failing_loss, checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=2,
            peer_failure_delay_s=0.5)
    assert len(list(tmp_path.glob("raised-*"))) == 1  # one attempt: it would fail again
    assert time.monotonic() - started < 60


def test_checkpoint_files_hold_no_code(tmp_path) -> None:
    import pickle

    from sparkdl.executor.checkpoint import CheckpointStore, Manifest, StepRecord

    store = CheckpointStore(str(tmp_path), "run", rank=0)
    path = tmp_path / "run" / "step-000000001"
    path.mkdir(parents=True)
    # A pickle that would run code on load: torch.load(weights_only=True) refuses it.
    (path / "rank-0.pt").write_bytes(pickle.dumps(os.system))
    store.write_manifest(Manifest(1, (StepRecord(1, (0,), (0,)),)))
    with pytest.raises(Exception, match="(?i)weights_only|unsupported|global"):
        store.read_part(1, 0)


def test_checkpoint_options_are_checked() -> None:
    from sparkdl.config import RunConfig

    with pytest.raises(ConfigError, match="train.checkpoint_dir"):
        RunConfig.from_kwargs(feature_cols=["a"], checkpoint_every=10).validate()
    with pytest.raises(ConfigError, match="train.keep_checkpoints"):
        RunConfig.from_kwargs(feature_cols=["a"], checkpoint_dir="/tmp/x", keep_checkpoints=0).validate()


def _write_forever(root: str, ready: str) -> None:
    from sparkdl.executor.checkpoint import CheckpointStore

    store = CheckpointStore(root, "run", rank=0)
    Path(ready).touch()
    store.write_part(20, {"w": torch.zeros(64 << 20)})  # 256 MB: killed long before it is done


def test_a_kill_during_a_checkpoint_write_leaves_the_previous_one_loadable(tmp_path) -> None:
    import multiprocessing

    from sparkdl.executor.checkpoint import CheckpointStore, Manifest, StepRecord

    store = CheckpointStore(str(tmp_path), "run", rank=0)
    store.write_part(10, {"w": torch.ones(4)})
    store.write_manifest(Manifest(1, (StepRecord(10, (0,), (0,)),)))
    ready = tmp_path / "ready"
    writer = multiprocessing.get_context("spawn").Process(target=_write_forever, args=(str(tmp_path), str(ready)))
    writer.start()
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # inside torch.save or the write of the temporary file
    os.kill(writer.pid, signal.SIGKILL)
    writer.join()
    assert writer.exitcode == -signal.SIGKILL
    assert [s.step for s in store.read_manifest().steps] == [10]
    assert torch.equal(store.read_part(10, 0)["w"], torch.ones(4))
    assert not (tmp_path / "run" / "step-000000020" / "rank-0.pt").exists()
