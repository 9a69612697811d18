"""Checkpoints and resume on local-cluster: a worker killed with SIGKILL mid-epoch makes Spark retry
the barrier stage, every rank resumes from the last complete checkpoint, and the weights equal
those of an uninterrupted run."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from sparkdl import TorchEstimator
from sparkdl.errors import ConfigError

FEATURES = [f"f{i}" for i in range(6)]


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 3))


class KillOnce(nn.Module):
    """The same network; the second rank's process kills itself (SIGKILL, no clean-up) at its 8th
    training step, once per marker file: the retried attempt trains through."""

    marker = ""

    def __init__(self) -> None:
        super().__init__()
        self.body = net()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            if rank == 1 and self.calls == 8 and not os.path.exists(self.marker):
                Path(self.marker).touch()
                os.kill(os.getpid(), signal.SIGKILL)
        return self.body(x)


def rows_df(spark):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(11)
    x = rng.normal(size=(160, 6))
    y = (x[:, 0] + x[:, 1] > 0).astype(int) + (x[:, 2] > 1).astype(int)
    data = [(*map(float, r), int(t)) for r, t in zip(x, y)]
    # Exactly two partitions: each rank's shard is the same in every attempt and every run.
    return spark.sparkContext.parallelize(data, 2).toDF(FEATURES + ["label"]).cache()


def fit(df, model, **options):  # type: ignore[no-untyped-def]
    settings = dict(feature_cols=FEATURES, label_col="label", batch_size=8, epochs=2, num_workers=2,
                    optimizer="sgd", lr=0.1, momentum=0.9, seed=5, strategy="data_parallel", tracking=False,
                    progress=False)
    settings.update(options)
    return TorchEstimator(model=model, **settings).fit(df)


def test_a_killed_worker_resumes_from_the_last_checkpoint(spark, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    df = rows_df(spark)
    KillOnce.marker = str(tmp_path / "killed")
    Path(KillOnce.marker).touch()  # present: the uninterrupted reference run never kills
    reference = fit(df, KillOnce)
    os.remove(KillOnce.marker)

    checkpoints = tmp_path / "checkpoints"
    resumed = fit(df, KillOnce, checkpoint_dir=str(checkpoints), checkpoint_every=3)
    assert os.path.exists(KillOnce.marker), "the worker was never killed"
    captured = capsys.readouterr()
    assert "resumed from the checkpoint of step 6" in captured.out + captured.err
    assert resumed.history[0]["resumed_from_step"] == 6  # at most one interval (3 steps) redone
    assert [h["steps"] for h in resumed.history] == [h["steps"] for h in reference.history] == [10, 10]
    # the epoch's loss includes the steps before the failure (their sums were checkpointed too)
    assert resumed.history[0]["loss"] == pytest.approx(reference.history[0]["loss"], rel=1e-5)
    got, want = resumed.torch_module().state_dict(), reference.torch_module().state_dict()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0, msg=key)
    # the last two complete checkpoints are kept, nothing half-written is left
    (run_dir,) = [p for p in checkpoints.iterdir()]
    kept = sorted(p.name for p in run_dir.iterdir())
    assert len(kept) == 2 and all((run_dir / name / "COMPLETE").exists() for name in kept)
    assert not list(checkpoints.rglob("*.tmp-*"))


def test_a_step_without_its_complete_marker_is_never_loaded(tmp_path) -> None:
    from sparkdl.launch.checkpoint import CheckpointStore

    store = CheckpointStore(str(tmp_path), "run", rank=0, keep=2)
    store.write_rank(3, {"w": torch.ones(2)})
    store.mark_complete(3)
    store.write_rank(6, {"w": torch.zeros(2)})  # killed before rank 0 marked step 6 complete
    assert store.latest() == 3
    assert torch.equal(store.read_rank(3, 0)["w"], torch.ones(2))
    (tmp_path / "run" / "step-000000009").mkdir()
    (tmp_path / "run" / "step-000000009" / "rank-0.pt.tmp-dead").write_bytes(b"half a file")
    assert store.latest() == 3
    store.write_rank(9, {"w": torch.full((2,), 9.0)})
    store.mark_complete(9)
    assert store.complete_steps() == [3, 9]


def test_checkpoint_files_hold_no_code(tmp_path) -> None:
    import pickle

    from sparkdl.launch.checkpoint import CheckpointStore

    store = CheckpointStore(str(tmp_path), "run", rank=0)
    path = tmp_path / "run" / "step-000000001"
    path.mkdir(parents=True)
    # A pickle that would run code on load: torch.load(weights_only=True) refuses it.
    (path / "rank-0.pt").write_bytes(pickle.dumps(os.system))
    (path / "COMPLETE").write_bytes(b"ok\n")
    with pytest.raises(Exception, match="(?i)weights_only|unsupported|global"):
        store.read_rank(1, 0)


def test_checkpoint_options_are_checked() -> None:
    from sparkdl.config import RunConfig

    with pytest.raises(ConfigError, match="train.checkpoint_dir"):
        RunConfig.from_kwargs(feature_cols=["a"], checkpoint_every=10).validate()
    with pytest.raises(ConfigError, match="train.keep_checkpoints"):
        RunConfig.from_kwargs(feature_cols=["a"], checkpoint_dir="/tmp/x", keep_checkpoints=0).validate()
