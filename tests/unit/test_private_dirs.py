"""Private temp roots, private files and the sweep of dead runs' directories (storage/private_dirs.py),
through the real writers: the executors' spool, the driver's parts directory and receiver, local
checkpoint files. Real processes hold the locks and are SIGKILLed; no Spark."""
from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pytest

from sparkdl.data.batches import SPOOL_PREFIX, Spool
from sparkdl.data.layout import FeedLayout
from sparkdl.errors import SparkdlError
from sparkdl.storage.files import atomic_output, locate
from sparkdl.storage.private_dirs import (LOCK_SUFFIX, create_private_file, hold_new_directory, private_root,
                                          sweep)
from sparkdl.wire.handshake import StreamTag
from sparkdl.wire.model_transfer import (ModelSink, PartReceiver, deliver, part_name, parts_directory,
                                         remove_directory)

REPO = Path(__file__).resolve().parents[2]
LAYOUT = FeedLayout(num_features=3, label_dtype="int64")
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def _batches(rows: int = 20) -> list[pa.RecordBatch]:
    values = np.arange(rows * 3, dtype=np.float32)
    return [pa.record_batch([pa.FixedSizeListArray.from_arrays(pa.array(values), 3), pa.array(np.arange(rows))],
                            names=[LAYOUT.feature_column, LAYOUT.label_column])]


def _mode(path: str | Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def temp_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """tempfile.gettempdir() of this process (and TMPDIR of its children) is a fresh directory, with
    the umask most hosts have (022: what made the old files 0644)."""
    base = tmp_path / "tmp"
    base.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    monkeypatch.setenv("TMPDIR", str(base))
    previous = os.umask(0o022)
    yield base
    os.umask(previous)


# -- roots someone else made first -----------------------------------------------------------------
@ROOT_ONLY
def test_a_root_made_by_another_user_is_refused(temp_root: Path) -> None:
    root = temp_root / f"sparkdl-{os.geteuid()}"
    root.mkdir(mode=0o700)
    os.chown(root, 65534, 65534)
    with pytest.raises(SparkdlError) as raised:
        parts_directory("run1")
    text = str(raised.value)
    assert str(root) in text and "uid 65534" in text and "HINT" in text and "TMPDIR" in text
    assert os.listdir(root) == []  # nothing was written into it


@pytest.mark.parametrize("hostile", ["open_to_all", "symlink", "file", "open_kind"])
def test_a_root_open_to_others_or_not_a_real_directory_is_refused(temp_root: Path, tmp_path: Path,
                                                                   hostile: str) -> None:
    root = temp_root / f"sparkdl-{os.geteuid()}"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    if hostile == "open_to_all":
        root.mkdir()
        os.chmod(root, 0o777)
    elif hostile == "symlink":  # even to a private directory of our own: the link itself can be swapped
        root.symlink_to(elsewhere)
    elif hostile == "file":
        root.write_bytes(b"")
    else:
        root.mkdir(mode=0o700)
        (root / "spool").mkdir()
        os.chmod(root / "spool", 0o755)
    with pytest.raises(SparkdlError, match="private directory") as raised:
        private_root("spool")
    assert "HINT" in str(raised.value)
    if hostile != "open_kind":
        with pytest.raises(SparkdlError, match=str(root)):
            parts_directory("run1")
    assert os.listdir(elsewhere) == []


def test_the_old_shared_names_are_not_used(temp_root: Path, tmp_path: Path) -> None:
    """Another user who made (or linked) the old fixed names first sees nothing of ours."""
    trap = tmp_path / "trap"
    trap.mkdir()
    (temp_root / "sparkdl-models").symlink_to(trap)
    (temp_root / "sparkdl-spool").symlink_to(trap)
    directory = parts_directory("run1")
    assert Path(directory).parent == temp_root / f"sparkdl-{os.geteuid()}" / "models"
    assert Path(private_root("spool")).parent == Path(directory).parent.parent
    assert os.listdir(trap) == []
    remove_directory(directory)


# -- links at predictable names ----------------------------------------------------------------------
def test_a_planted_link_at_a_file_name_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    link = tmp_path / "rank-0.safetensors.part"
    link.symlink_to(target)
    with pytest.raises(FileExistsError):
        create_private_file(link)
    (tmp_path / "dangling").symlink_to(tmp_path / "would-be-created")
    with pytest.raises(FileExistsError):
        create_private_file(tmp_path / "dangling")
    assert target.read_bytes() == b"precious" and not (tmp_path / "would-be-created").exists()


def test_the_part_receiver_does_not_write_through_a_planted_link(tmp_path: Path) -> None:
    """The receiver's file writer, fed by a real socket, refuses a name that is already a link."""
    from sparkdl.wire.model_transfer import _copy_exactly

    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    name = tmp_path / ".rank-0.safetensors.abcd1234"
    name.symlink_to(target)
    sender, receiver = socket.socketpair()
    with sender, receiver:
        sender.sendall(b"x" * 64)
        with pytest.raises(FileExistsError):
            _copy_exactly(receiver, str(name), 64, StreamTag("k" * 64, b"c" * 32))
    assert target.read_bytes() == b"precious"


def test_a_local_checkpoint_file_replaces_a_planted_link_and_is_private(temp_root: Path, tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    user_dir = tmp_path / "ckpt"  # the user's own directories: their modes stay theirs
    step = user_dir / "run" / "step-3"
    os.makedirs(step, mode=0o755)
    planted, final = step / "rank-0.pt", step / "rank-1.pt"
    planted.symlink_to(target)
    for where in (planted, final):
        with atomic_output(locate(str(where))) as stream:
            stream.write(b"state")
    nested = user_dir / "run" / "new" / "deeper" / "manifest.json"
    with atomic_output(locate(str(nested))) as stream:
        stream.write(b"{}")
    assert target.read_bytes() == b"precious" and not planted.is_symlink() and planted.read_bytes() == b"state"
    assert _mode(planted) == _mode(final) == _mode(nested) == 0o600
    assert _mode(nested.parent) == _mode(nested.parent.parent) == 0o700  # made by sparkdl
    assert _mode(user_dir) == _mode(step) == 0o755  # the user's, left alone


# -- modes of what the real writers make ----------------------------------------------------------------
@pytest.mark.parametrize("user_dir", [False, True], ids=["private_root", "spool_dir"])
def test_the_spool_is_private(temp_root: Path, tmp_path: Path, user_dir: bool) -> None:
    directory = tmp_path / "mine" / "spool" if user_dir else Path(private_root("spool"))
    with Spool.write(_batches(), LAYOUT, directory) as spool:
        assert spool.num_rows == 20
        assert _mode(spool.path) == 0o600 and _mode(spool.path.parent) == 0o700
        assert spool.path.parent.parent == directory and spool.path.parent.name.startswith(SPOOL_PREFIX)
        lock = Path(str(spool.path.parent) + LOCK_SUFFIX)
        assert _mode(lock) == 0o600
    assert not spool.path.parent.exists() and not lock.exists()
    # the private root and its spool/, or the missing parts of spool_dir that sparkdl made
    assert _mode(directory) == _mode(directory.parent) == 0o700


def test_received_parts_are_private(temp_root: Path) -> None:
    import torch

    directory = parts_directory("run7")
    assert _mode(directory) == _mode(Path(directory).parent) == _mode(Path(directory).parent.parent) == 0o700
    with PartReceiver("127.0.0.1", directory) as receiver:
        record = deliver(ModelSink("channel", receiver.address, timeout_s=30, fallback=False), 0,
                         {"w": torch.ones(10)})
    assert record["via"] == "channel"
    part = Path(directory) / part_name(0)
    assert _mode(part) == 0o600
    assert [p.name for p in Path(directory).iterdir()] == [part.name]  # the lock file is a sibling
    remove_directory(directory)
    assert not os.path.lexists(directory) and not os.path.lexists(directory + LOCK_SUFFIX)


# -- the sweep: by locks ---------------------------------------------------------------------------
def _holder(code: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    """A real process that makes something under a lock, prints its path, then waits to be killed."""
    script = textwrap.dedent(code) + "\nprint(path, flush=True)\nimport time\ntime.sleep(120)\n"
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    assert process.stdout is not None
    line = process.stdout.readline().strip()
    assert line, "the holder died before making its directory"
    return process, line


def _kill(process: subprocess.Popen[str]) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait(30)


SPOOL_HOLDER = """
import numpy as np, pyarrow as pa
from sparkdl.data.batches import Spool
from sparkdl.data.layout import FeedLayout
layout = FeedLayout(num_features=3, label_dtype="int64")
values = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(30, dtype=np.float32)), 3)
spool = Spool.write([pa.record_batch([values, pa.array(np.arange(10))], names=[layout.feature_column,
                    layout.label_column])], layout, {directory!r})
path = str(spool.path.parent)
"""


@pytest.mark.parametrize("user_dir", [False, True], ids=["private_root", "spool_dir"])
def test_a_killed_workers_spool_is_swept_and_a_live_ones_kept(temp_root: Path, tmp_path: Path,
                                                              user_dir: bool) -> None:
    directory = str(tmp_path / "spool") if user_dir else private_root("spool")
    alive, alive_dir = _holder(SPOOL_HOLDER.format(directory=directory))
    dead, dead_dir = _holder(SPOOL_HOLDER.format(directory=directory))
    try:
        _kill(dead)
        assert os.path.isdir(dead_dir) and os.listdir(dead_dir) == ["rows.arrow"]  # what a kill leaves
        with Spool.write(_batches(), LAYOUT, directory) as spool:  # the next worker on this host
            assert not os.path.lexists(dead_dir) and not os.path.lexists(dead_dir + LOCK_SUFFIX)
            assert os.listdir(alive_dir) == ["rows.arrow"]
            assert sorted(os.listdir(directory)) == sorted(
                name for d in (alive_dir, str(spool.path.parent)) for name in (
                    os.path.basename(d), os.path.basename(d) + LOCK_SUFFIX))
    finally:
        _kill(alive)
        if dead.poll() is None:
            _kill(dead)


def test_a_killed_drivers_parts_are_swept_by_the_next_run(temp_root: Path) -> None:
    dead, dead_dir = _holder("""
        from sparkdl.wire.model_transfer import parts_directory, part_name
        path = parts_directory("killedrun")
        open(path + "/" + part_name(0), "wb").write(b"weights" * 1000)
        """)
    alive, alive_dir = _holder("""
        from sparkdl.wire.model_transfer import parts_directory
        path = parts_directory("liverun")
        """)
    try:
        assert Path(dead_dir).parent == Path(private_root("models"))
        _kill(dead)
        assert os.listdir(dead_dir) == [part_name(0)]
        mine = parts_directory("nextrun")
        assert not os.path.lexists(dead_dir) and not os.path.lexists(dead_dir + LOCK_SUFFIX)
        assert os.path.isdir(alive_dir) and os.path.isdir(mine)
        remove_directory(mine)
    finally:
        _kill(alive)
        if dead.poll() is None:
            _kill(dead)


def test_this_processs_own_directories_are_never_swept(tmp_path: Path) -> None:
    held = hold_new_directory(str(tmp_path), "x-")
    (Path(held.path) / "data").write_bytes(b"1")
    assert sweep(str(tmp_path), "x-") == []
    other = hold_new_directory(str(tmp_path), "x-")  # sweeps first
    assert os.path.isdir(held.path) and os.path.isdir(other.path)
    held.close()
    other.close()
    assert os.listdir(tmp_path) == []


def test_directories_that_are_not_sparkdls_are_left_alone(tmp_path: Path) -> None:
    (tmp_path / "sparkdl-spool-mine").mkdir()  # no lock file: not made by the protocol
    (tmp_path / "other.lock").write_bytes(b"")  # another prefix
    (tmp_path / "x-link.lock").symlink_to(tmp_path / "other.lock")
    (tmp_path / "x-link").mkdir()
    assert sweep(str(tmp_path), "x-") == [] and sweep(str(tmp_path), SPOOL_PREFIX) == []
    assert sorted(os.listdir(tmp_path)) == ["other.lock", "sparkdl-spool-mine", "x-link", "x-link.lock"]


RACER = """
import os, sys
from sparkdl.storage.private_dirs import hold_new_directory
root = sys.argv[1]
for _ in range(300):
    held = hold_new_directory(root, "race-")
    assert os.path.isdir(held.path), held.path   # never swept under its owner
    open(os.path.join(held.path, "f"), "wb").close()
    held.close()
path = "done"
"""


def test_owners_and_sweepers_racing_never_lose_a_live_directory(tmp_path: Path) -> None:
    """Two processes and a thread each make, fill and remove directories while sweeping the same
    root: the lock protocol never removes one under its owner, and nothing is left at the end."""
    script = RACER + "\nprint(path, flush=True)\n"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    racers = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    errors: list[BaseException] = []

    def local() -> None:
        try:
            for _ in range(300):
                held = hold_new_directory(str(tmp_path), "race-")
                assert os.path.isdir(held.path)
                held.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=local)
    thread.start()
    outputs = [racer.communicate(timeout=120) for racer in racers]
    thread.join(120)
    assert not errors, errors
    for racer, (out, err) in zip(racers, outputs):
        assert racer.returncode == 0 and out.strip() == "done", err
    assert os.listdir(tmp_path) == []
