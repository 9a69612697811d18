"""Peak memory of one rank, measured by the rank itself: the resident set's high-water mark since
the task started (Linux VmHWM, reset at the start: Spark reuses Python workers, whose earlier
tasks' peaks would otherwise count) and, training on a GPU, CUDA's peak allocation."""
from __future__ import annotations

import sys
from typing import Any

_STATUS, _CLEAR_REFS = "/proc/self/status", "/proc/self/clear_refs"
_AT_START = {"rss": 0, "model": 0}  # the rank's RSS when its task started, and before its model was built


def reset_peak() -> bool:
    """Start the RSS high-water mark from now; False where the kernel does not let us (then the
    peak is the process's since it started: ru_maxrss)."""
    _return_free_memory()
    _AT_START["rss"] = _status_bytes("VmRSS:") or 0
    try:
        with open(_CLEAR_REFS, "w") as refs:
            refs.write("5")  # "5": reset the peak RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _return_free_memory() -> None:
    """Hand what earlier tasks of this (reused) worker freed back to the kernel first: memory the
    allocator keeps would otherwise be reused unseen, and the growth from the start mean nothing."""
    import ctypes
    import gc

    gc.collect()
    # What survives this collection outlives the task (modules, a reused worker's caches): frozen, so
    # that the next task's collection skips it. A full collection of torch's ~300k objects cost every
    # task 0.2 s (a no-op sparkdl.run took 0.25 s longer for it).
    gc.freeze()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc


def mark_model_start() -> None:
    """The RSS before the model is built (after the data path, the backend and its threads started):
    what the model, its training state and its activations grow the rank by is measured from here."""
    _AT_START["model"] = _status_bytes("VmRSS:") or 0


def reset_cuda_peak(device: Any) -> None:
    if _is_cuda(device):
        import torch

        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: Any = None) -> dict[str, float]:
    """{"peak_rss_bytes", "start_rss_bytes" (at the task's start), "model_start_rss_bytes" (before the
    model was built), and "cuda_peak_bytes" on a GPU}."""
    peak: dict[str, float] = {"peak_rss_bytes": float(_high_water_mark()), "start_rss_bytes": float(_AT_START["rss"]),
                              "model_start_rss_bytes": float(_AT_START["model"])}
    if _is_cuda(device):
        import torch

        peak["cuda_peak_bytes"] = float(torch.cuda.max_memory_allocated(device))
    return peak


def _high_water_mark() -> int:
    peak = _status_bytes("VmHWM:")
    if peak:
        return peak
    try:
        import resource  # not on Windows
    except ImportError:
        return 0
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024  # bytes on macOS, KiB elsewhere


def _status_bytes(field: str) -> int | None:
    try:
        with open(_STATUS) as status:
            for line in status:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _is_cuda(device: Any) -> bool:
    return device is not None and getattr(device, "type", str(device).split(":")[0]) == "cuda"
