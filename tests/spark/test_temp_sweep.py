"""What a killed process leaves on a host's disk is swept by the next run there (storage/private_dirs.py):
a worker SIGKILLed mid-epoch leaves its spool, a driver SIGKILLed while receiving leaves the model's
parts; the next fit on local-cluster removes both, by the locks their dead owners no longer hold."""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from sparkdl import TorchEstimator
from sparkdl.errors import TrainingError
from sparkdl.storage.private_dirs import LOCK_SUFFIX

FEATURES = ["a", "b", "c"]
MARKER = {"path": ""}  # shipped by value with the loss; set before each fit
REPO = Path(__file__).resolve().parents[2]


def dying_loss(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Rank 1 writes the spool files its process has open to the marker file, then SIGKILLs its own
    process (no clean-up of any kind) at its 6th step, once per marker file."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    MARKER.setdefault("calls", 0)
    MARKER["calls"] += 1  # type: ignore[operator]
    if rank == 1 and MARKER["calls"] == 6 and MARKER["path"] and not os.path.exists(MARKER["path"]):
        Path(MARKER["path"]).write_text(json.dumps(_open_spool_files()))
        os.kill(os.getpid(), signal.SIGKILL)
    return nn.functional.cross_entropy(output, labels)


def _open_spool_files() -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "sparkdl-spool" in target and ".arrow" in os.path.basename(target):
            found.append(target)
    return sorted(set(found))


def _df(spark):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(3)
    x = rng.normal(size=(160, 3))
    data = [(*map(float, r), int(r[0] > 0)) for r in x]
    return spark.sparkContext.parallelize(data, 2).toDF(FEATURES + ["label"])


def _fit(df, **options):  # type: ignore[no-untyped-def]
    settings = dict(model=lambda: nn.Linear(3, 2), feature_cols=FEATURES, label_col="label", batch_size=8,
                    epochs=2, num_workers=2, optimizer="sgd", lr=0.1, strategy="data_parallel", spool="disk",
                    tracking=False, progress=False, loss=dying_loss, peer_failure_delay_s=0.5)
    settings.update(options)
    return TorchEstimator(**settings).fit(df)


@pytest.mark.parametrize("own_dir", [False, True], ids=["private_root", "spool_dir"])
def test_a_killed_workers_spool_is_swept_by_the_next_run(spark, tmp_path, own_dir) -> None:  # type: ignore[no-untyped-def]
    df = _df(spark).cache()
    options = {"spool_dir": str(tmp_path / "spool")} if own_dir else {}
    MARKER.update(path=str(tmp_path / "killed"))
    with pytest.raises(TrainingError):
        _fit(df, **options)  # no checkpoint_dir: one attempt, the kill ends the fit
    left = json.loads(Path(MARKER["path"]).read_text())
    assert left, "the killed rank had no spool file open"
    assert all(os.path.exists(path) for path in left), left  # what SIGKILL leaves behind
    modes = {stat.S_IMODE(os.stat(path).st_mode) for path in left}
    own = [str(Path(path).parent) for path in left]  # the killed worker's own directory

    model = _fit(df, **options)  # the next run on this host (the marker exists: nobody dies)
    assert [h["steps"] for h in model.history] == [10, 10]
    assert not any(os.path.lexists(path) for path in left + own), left
    assert not any(os.path.lexists(path + LOCK_SUFFIX) for path in own), own
    assert modes == {0o600}
    root = tmp_path / "spool" if own_dir else Path(tempfile.gettempdir(), f"sparkdl-{os.getuid()}", "spool")
    assert all(Path(path).parent == root for path in own), own
    if own_dir:  # the user's spool_dir holds nothing of sparkdl's once the run is over
        assert os.listdir(tmp_path / "spool") == []


HOLDER = """
import time, torch
from sparkdl.wire.model_transfer import ModelSink, PartReceiver, deliver, parts_directory
path = parts_directory("killed-driver")
receiver = PartReceiver("127.0.0.1", path)
deliver(ModelSink("channel", receiver.address, timeout_s=30, fallback=False), 0, {"w": torch.ones(1000)})
print(path, flush=True)
time.sleep(300)
"""


def test_a_killed_drivers_model_parts_are_swept_by_the_next_run(spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The killed driver is a process that opened the real parts directory and received a real part
    into it over the real receiver, as a fit's driver does, then was SIGKILLed; the next run is a
    real fit in this driver process."""
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout is not None
        dead = holder.stdout.readline().strip()
        assert dead and os.listdir(dead) == ["rank-0.safetensors"], dead
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
    assert os.path.isdir(dead)  # what SIGKILL leaves behind

    MARKER.update(path="")
    model = _fit(_df(spark), epochs=1, spool="none", loss="cross_entropy")
    assert [h["steps"] for h in model.history] == [10]
    assert not os.path.lexists(dead) and not os.path.lexists(dead + LOCK_SUFFIX)
