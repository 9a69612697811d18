"""Held directories beyond the basics of test_private_dirs.py (storage/private_dirs.py): a garbage
collection that finalizes a Spool while the registry's guard is held, a host without fcntl or uids
(Windows), lock names per host on a shared spool_dir, the warning for a spool_dir others can write,
and the rank's partition copy and the driver's model copy swept once their SIGKILLed owner is gone.
Real processes hold the locks and are killed; no Spark."""
from __future__ import annotations

import json
import logging
import os
import platform
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pytest

from sparkdl.data.batches import Spool
from sparkdl.data.layout import FeedLayout
from sparkdl.storage.private_dirs import LOCK_SUFFIX, hold_new_directory, host_tag, private_root, sweep

REPO = Path(__file__).resolve().parents[2]
LAYOUT = FeedLayout(num_features=3, label_dtype="int64")
SPOOL_SETUP = """
import numpy as np, pyarrow as pa
from sparkdl.data.batches import Spool
from sparkdl.data.layout import FeedLayout
layout = FeedLayout(num_features=3, label_dtype="int64")
values = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(30, dtype=np.float32)), 3)
batch = pa.record_batch([values, pa.array(np.arange(10))], names=[layout.feature_column, layout.label_column])
"""


def _batches() -> list[pa.RecordBatch]:
    values = pa.FixedSizeListArray.from_arrays(pa.array(np.arange(60, dtype=np.float32)), 3)
    return [pa.record_batch([values, pa.array(np.arange(20))], names=[LAYOUT.feature_column, LAYOUT.label_column])]


def _python(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.fixture
def temp_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """tempfile.gettempdir() here and TMPDIR of child processes: a fresh directory."""
    base = tmp_path / "tmp"
    base.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    monkeypatch.setenv("TMPDIR", str(base))
    monkeypatch.delenv("SPARK_LOCAL_DIRS", raising=False)
    yield base


# -- a collection under the guard ----------------------------------------------------------------
def test_a_spool_finalized_by_a_collection_under_the_guard_does_not_hang(tmp_path: Path) -> None:
    """The registry's guard is held while a collection runs (as when an allocation under it starts
    one) and finalizes Spools caught in reference cycles, whose finalizers close their held
    directories on this same thread: with a plain lock that thread waited for itself for ever."""
    code = SPOOL_SETUP + textwrap.dedent("""
    import gc, json, os, sys
    from sparkdl.storage import private_dirs
    gc.disable()
    paths = []
    for _ in range(3):
        spool = Spool.write([batch], layout, sys.argv[1])
        spool.cycle = spool  # only a collection can finalize it
        paths.append(str(spool.path.parent))
        del spool
    with private_dirs._held_guard:
        gc.collect()
    print(json.dumps([os.path.lexists(p) for p in paths]))
    """)
    result = _python(code, str(tmp_path), timeout=30)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [False, False, False]  # finalized: directories removed
    assert os.listdir(tmp_path) == []  # their lock files too


# -- Windows: no fcntl, no uids ------------------------------------------------------------------
WITHOUT_FCNTL = """
import json, os, sys
sys.modules["fcntl"] = None  # `import fcntl` fails, as on Windows
del os.geteuid               # and there are no uids
import sparkdl.storage.files  # imports private_dirs at its top
from sparkdl.storage.private_dirs import LOCK_SUFFIX, check_private_dir, hold_new_directory, private_root, sweep
root = private_root("spool")
os.chmod(root, 0o777)  # what os.stat reports for any directory on Windows
check_private_dir(root)
dead = os.path.join(root, "w-0123456789abcdef")  # a dead owner's, as far as anyone can tell
os.mkdir(dead)
open(dead + LOCK_SUFFIX, "wb").close()
held = hold_new_directory(root, "w-")  # sweeps first: without locks, nothing
print(json.dumps({"root": root, "made": os.path.isdir(held.path), "swept": sweep(root, "w-"),
                  "kept": os.path.isdir(dead)}))
held.close()
print(json.dumps({"closed": not os.path.lexists(held.path)}))
"""


def test_a_host_without_fcntl_or_uids_imports_and_holds_without_locks(temp_root: Path) -> None:
    result = _python(WITHOUT_FCNTL)
    assert result.returncode == 0, result.stderr
    first, second = (json.loads(line) for line in result.stdout.splitlines())
    assert Path(first["root"]).parent.parent == temp_root
    assert Path(first["root"]).parent.name.startswith("sparkdl-") and first["root"].endswith("spool")
    assert first["made"] and first["swept"] == [] and first["kept"] and second["closed"]


# -- hosts sharing a spool_dir -----------------------------------------------------------------------
def test_host_tags_have_no_dots_and_stay_short() -> None:
    assert host_tag("node-7.cluster.example.com") == "node-7-cluster-example-com"
    assert host_tag("") == "host" and "/" not in host_tag("a/b")
    long_a, long_b = "n" * 80 + ".a", "n" * 80 + ".b"
    assert len(host_tag(long_a)) <= 64 and host_tag(long_a) != host_tag(long_b)
    assert LOCK_SUFFIX == f".{host_tag(platform.node())}.lock"


def test_only_this_hosts_dead_directories_are_swept(tmp_path: Path) -> None:
    """On a spool_dir shared over NFS without locks, another host's live directory has a lock this
    host can take: the sweep leaves every entry whose lock is named for another host."""
    held = hold_new_directory(str(tmp_path), "x-")
    assert held.lock_path == held.path + f".{host_tag(platform.node())}.lock"
    others = []
    for host in ("node-2", "node-2.example", f"x{host_tag(platform.node())}"):
        directory = tmp_path / f"x-{len(others)}0badc0de"
        directory.mkdir()
        (directory / "rows.arrow").write_bytes(b"rows")
        Path(f"{directory}.{host_tag(host)}.lock").write_bytes(b"")  # nobody holds it here
        others.append(directory)
    ours = tmp_path / "x-feedfacefeedface"  # this host's, its owner dead
    ours.mkdir()
    Path(str(ours) + LOCK_SUFFIX).write_bytes(b"")
    assert sweep(str(tmp_path), "x-") == [str(ours)]
    assert all((d / "rows.arrow").exists() for d in others) and len(list(tmp_path.glob("*.lock"))) == 4
    held.close()


def test_a_spool_dir_others_can_write_is_warned_about_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    shared, sticky = tmp_path / "shared", tmp_path / "sticky"
    for directory, mode in ((shared, 0o777), (sticky, 0o1777)):
        directory.mkdir()
        os.chmod(directory, mode)
    with caplog.at_level(logging.WARNING, logger="sparkdl"):
        for directory in (shared, shared, sticky):
            with Spool.write(_batches(), LAYOUT, directory) as spool:
                assert spool.num_rows == 20
    warned = [r.getMessage() for r in caplog.records if "sticky" in r.getMessage()]
    assert len(warned) == 1 and str(shared) in warned[0] and "0777" in warned[0], warned


# -- the rank's partition copy and the driver's model copy ------------------------------------------
def _holder(code: str, env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    script = textwrap.dedent(code) + "\nprint(path, flush=True)\nimport time\ntime.sleep(120)\n"
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO), **env})
    assert process.stdout is not None
    line = process.stdout.readline().strip()
    assert line, "the holder died before making its directory"
    return process, line


def _kill_all(processes: list[subprocess.Popen[str]]) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait(30)


RANK_HOLDER = """
import pyarrow as pa
from sparkdl.executor.child_rank import rank_workdir, write_partition
from sparkdl.wire.child import ChildCall
held = rank_workdir(1)
write_partition(ChildCall(function=b"x", partition_schema='{"type":"struct","fields":[]}'),
                iter([pa.record_batch({"x": pa.array([1.0, 2.0])})]), held.path, 1)
path = held.path
"""


@pytest.mark.parametrize("spark_dirs", [True, False], ids=["spark_local_dirs", "private_root"])
def test_a_killed_ranks_partition_copy_is_swept_by_the_next_rank(temp_root: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 spark_dirs: bool) -> None:
    from sparkdl.executor.child_rank import RANK_PREFIX, rank_workdir

    env = {}
    if spark_dirs:
        (tmp_path / "local").mkdir(mode=0o700)
        env["SPARK_LOCAL_DIRS"] = str(tmp_path / "local")
        monkeypatch.setenv("SPARK_LOCAL_DIRS", env["SPARK_LOCAL_DIRS"])
    root = env.get("SPARK_LOCAL_DIRS") or private_root("spool")
    dead, dead_dir = _holder(RANK_HOLDER, env)
    alive, alive_dir = _holder(RANK_HOLDER, env)
    try:
        assert Path(dead_dir).parent == Path(root) and Path(dead_dir).name.startswith(RANK_PREFIX + "1-")
        _kill_all([dead])
        assert sorted(os.listdir(dead_dir)) == ["data.arrow", "schema.json"]  # what a kill leaves
        with rank_workdir(0) as mine:  # the next rank task on this host
            assert not os.path.lexists(dead_dir) and not os.path.lexists(dead_dir + LOCK_SUFFIX)
            assert sorted(os.listdir(alive_dir)) == ["data.arrow", "schema.json"] and os.path.isdir(mine.path)
        assert not os.path.lexists(mine.path)
    finally:
        _kill_all([dead, alive])


MODEL_COPY_HOLDER = """
import os, sys
from sparkdl.model.trained import ModelParts
first, second = sys.argv[1:3]
parts = ModelParts((first, second))  # in two directories: local_directory() copies them here
copy = parts.local_directory()
assert os.listdir(copy) and parts.owned_directory
path = parts.owned_directory
"""


def test_a_killed_drivers_model_copy_is_swept_by_the_next_copy(temp_root: Path, tmp_path: Path) -> None:
    from sparkdl.model.trained import MODEL_COPY_PREFIX, ModelParts

    sources = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        sources.append(tmp_path / name / f"rank-{len(sources)}.safetensors")
        sources[-1].write_bytes(b"weights" * 100)
    holder = MODEL_COPY_HOLDER.replace("sys.argv[1:3]", repr(tuple(map(str, sources))))
    dead, dead_dir = _holder(holder, {})
    try:
        assert Path(dead_dir).parent == Path(private_root("models"))
        assert Path(dead_dir).name.startswith(MODEL_COPY_PREFIX)
        _kill_all([dead])
        assert os.path.isdir(dead_dir)  # what a kill leaves
        parts = ModelParts(tuple(map(str, sources)))
        copy = parts.local_directory()  # the next copy on this host
        assert not os.path.lexists(dead_dir) and not os.path.lexists(dead_dir + LOCK_SUFFIX)
        assert sorted(os.listdir(copy)) == ["part-0.safetensors", "part-1.safetensors"]
        owned = parts.owned_directory
        assert owned is not None
        parts.remove()
        assert not os.path.lexists(owned) and not os.path.lexists(owned + LOCK_SUFFIX)
    finally:
        _kill_all([dead])
