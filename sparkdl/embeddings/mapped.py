"""Embedding tables too large to hold in memory comfortably, backed by files instead.

The driver gets a trained model's tables piece by piece (model/trained.py); a table of
MAPPED_TABLE_BYTES or more is written into a file-backed tensor (a shared mapping of a private file
in a directory this process holds), so the whole set never sits in the driver's anonymous memory:
the kernel pages it in and out like any file. Scoring processes that can see the same file (the
driver, executors on the driver's host: local and local-cluster masters, or a shared mount) map it
read-only instead of receiving the table in a pickle (the file goes with the last tensor on it); a process that cannot see it gets the table as
a meta tensor, which loading the model's files fills (module_from_files).
"""
from __future__ import annotations

import errno
import os
import threading
import weakref
from typing import Any

import torch

MAPPED_TABLE_BYTES = 64 << 20
_LOCK = threading.Lock()
_HELD: list[Any] = []
_COUNT = [0]  # this process's held directory of table files (storage/private_dirs.py)


def _directory() -> str:
    from sparkdl.storage.private_dirs import hold_new_directory, private_root

    with _LOCK:
        if not _HELD:  # held while this process lives; a later one sweeps it once this one is gone
            _HELD.append(hold_new_directory(private_root("models"), "sparkdl-tables-"))
        return str(_HELD[0].path)


def mapped_table(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed tensor of `shape` backed by a new private file (shared mapping: writes reach the file)."""
    from sparkdl.storage.private_dirs import create_private_file

    numel = 1
    for n in shape:
        numel *= int(n)
    directory = _directory()
    with _LOCK:
        _COUNT[0] += 1
        path = os.path.join(directory, f"table-{_COUNT[0]}.bin")
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    fd = create_private_file(path)
    try:
        # Reserved now: a mapping of a sparse file that outgrows the disk kills the process (SIGBUS).
        os.posix_fallocate(fd, 0, max(nbytes, 1))
    except OSError as exc:
        os.close(fd)
        os.unlink(path)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            from sparkdl.errors import ResourceError

            raise ResourceError(f"no room for an embedding table of {nbytes / 2**30:.2f} GiB under {directory}",
                                hint="free space there, or point TMPDIR at a larger disk") from None
        raise
    os.close(fd)
    tensor = torch.from_file(path, shared=True, size=numel, dtype=dtype).view(*shape)
    weakref.finalize(tensor.untyped_storage(), _unlink, path)  # with the last tensor on it (torch keeps one storage object)
    return tensor


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def mapped_path(tensor: torch.Tensor) -> str | None:
    """The file behind a table mapped_table (or map_readonly) made; None for any other tensor."""
    if tensor.is_meta or tensor.device.type != "cpu":
        return None
    return tensor.untyped_storage().filename


def map_readonly(path: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """The table in `path` mapped privately (copy on write: this process never changes the file);
    None when the file is not here or not of this size."""
    numel = 1
    for n in shape:
        numel *= int(n)
    try:
        if os.path.getsize(path) != numel * torch.empty(0, dtype=dtype).element_size():
            return None
    except OSError:
        return None
    return torch.from_file(path, shared=False, size=numel, dtype=dtype).view(*shape)
