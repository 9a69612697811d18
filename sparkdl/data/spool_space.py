"""Disk space for the spool: how many bytes a rank's partition takes, checked against what its
spool directory has free before writing, and a full disk met while writing named as such (the
directory, the bytes needed and free, the fixes) instead of a bare `[Errno 28]`. No pyspark here."""
from __future__ import annotations

import errno
import math
import shutil
from pathlib import Path

from sparkdl.data.arrow_rows import spool_columns
from sparkdl.data.layout import FeedLayout
from sparkdl.errors import SpoolSpaceError

HEADROOM = 1.05  # IPC framing, the footer and alignment padding on top of the values themselves
_FULL = (errno.ENOSPC, errno.EDQUOT)


def spool_bytes(layout: FeedLayout, rows: int) -> int:
    """Bytes `rows` rows take in the spool, counting fixed-width columns only (binary and
    variable-length columns are known only once read): a lower bound for such layouts."""
    row_bytes = sum(column.row_bytes for column in spool_columns(layout))
    return math.ceil(rows * row_bytes * HEADROOM)


def free_bytes(directory: str | Path) -> int:
    """Free bytes on the filesystem holding `directory` (or its nearest existing parent)."""
    path = Path(directory)
    while not path.exists() and path != path.parent:
        path = path.parent
    return int(shutil.disk_usage(path).free)


def _error(directory: str | Path, needed: int, free: int, written: int | None = None) -> SpoolSpaceError:
    wrote = f" after writing {_size(written)}" if written is not None else ""
    return SpoolSpaceError(
        f"data.spool_dir {str(directory)!r} has {_size(free)} free{wrote}, but this rank's partition needs "
        f"about {_size(needed)} there to train",
        hint="set data.spool_dir to a local disk with more room on every executor, train one pass without a "
             "spool (data.spool='none', epochs=1), or spread the rows over more workers (num_workers) so that "
             "each partition is smaller")


def check_free_space(directory: str | Path, needed: int) -> None:
    """Raise SpoolSpaceError before writing when `needed` bytes will not fit in `directory`."""
    free = free_bytes(directory)
    if needed > free:
        raise _error(directory, needed, free)


def out_of_space(exc: BaseException, directory: str | Path, needed: int, written: int) -> SpoolSpaceError | None:
    """The SpoolSpaceError a write failure stands for (a full disk or quota), else None."""
    full = isinstance(exc, OSError) and (exc.errno in _FULL or "No space left on device" in str(exc)
                                         or "Disk quota exceeded" in str(exc))
    return _error(directory, max(needed, written), free_bytes(directory), written) if full else None


def _size(n: int | None) -> str:
    value = float(n or 0)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
