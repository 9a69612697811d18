"""Spool disk space: the bytes a partition needs, the check before writing, a full disk named."""
from __future__ import annotations

import errno
import shutil

import numpy as np
import pyarrow as pa
import pytest

from sparkdl.data.batches import Spool
from sparkdl.data.layout import FeedLayout
from sparkdl.data.spool_space import check_free_space, free_bytes, out_of_space, spool_bytes
from sparkdl.errors import SpoolSpaceError

LAYOUT = FeedLayout(feature_column="features", num_features=64, label_column="label", label_dtype="int64")


def test_spool_bytes_counts_every_fixed_column() -> None:
    # 64 float32 features + one int64 label per row, plus the headroom for IPC framing
    assert spool_bytes(LAYOUT, 1000) == int(np.ceil(1000 * (64 * 4 + 8) * 1.05))
    assert spool_bytes(LAYOUT, 0) == 0


def test_free_bytes_of_a_directory_not_made_yet(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert free_bytes(tmp_path / "not" / "yet") == shutil.disk_usage(tmp_path).free


def test_too_little_space_is_refused_before_writing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    needed = free_bytes(tmp_path) + (1 << 40)
    with pytest.raises(SpoolSpaceError) as raised:
        check_free_space(tmp_path, needed)
    text = str(raised.value)
    assert "data.spool_dir" in text and str(tmp_path) in text and "free" in text and "needs about" in text
    assert "HINT" in text and "num_workers" in text
    check_free_space(tmp_path, 1)


def test_spool_write_checks_first_and_leaves_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    batch = pa.RecordBatch.from_pydict({"features": pa.array([[0.0] * 64] * 4, pa.list_(pa.float32(), 64)),
                                        "label": pa.array([0, 1, 0, 1], pa.int64())})
    with pytest.raises(SpoolSpaceError):
        Spool.write(iter([batch]), LAYOUT, tmp_path / "spool", expected_bytes=free_bytes(tmp_path) + (1 << 40))
    assert list((tmp_path / "spool").iterdir()) == []
    with Spool.write(iter([batch]), LAYOUT, tmp_path / "spool", expected_bytes=spool_bytes(LAYOUT, 4)) as spool:
        assert spool.num_rows == 4


def test_a_full_disk_while_writing_is_named(tmp_path) -> None:  # type: ignore[no-untyped-def]
    error = out_of_space(OSError(errno.ENOSPC, "No space left on device"), tmp_path, 10 << 30, 3 << 30)
    assert isinstance(error, SpoolSpaceError)
    assert "after writing 3.0 GiB" in str(error) and "needs about 10.0 GiB" in str(error)
    arrow_style = OSError("[Errno 28] Error writing bytes to file. Detail: [errno 28] No space left on device")
    assert out_of_space(arrow_style, tmp_path, 0, 5) is not None
    assert out_of_space(OSError(errno.EACCES, "Permission denied"), tmp_path, 1, 1) is None
    assert out_of_space(ValueError("bad"), tmp_path, 1, 1) is None


def test_writing_to_a_full_device_is_named(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A real ENOSPC: /dev/full refuses every write with it."""
    import os

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    try:
        with pa.OSFile("/dev/full", "wb") as sink:
            sink.write(b"x" * 1024)
            sink.flush()
        pytest.skip("/dev/full accepted a write")
    except OSError as exc:
        assert out_of_space(exc, tmp_path, 2048, 0) is not None, str(exc)
