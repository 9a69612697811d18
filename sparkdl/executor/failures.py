"""How a rank's failure is told: at once over the driver channel (before its communicator goes down),
and whether it is the rank's own error or an echo of a peer's (a collective that broke because
another rank died). Shared by the in-task main (worker.py) and compat ranks (child_process.py).
"""
from __future__ import annotations

import traceback
from typing import Any

PEER_FAILURE_SIGNS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "gloo/transport",
                      "NCCL communicator was aborted", "Socket Timeout", "HorovodInternalError",
                      "Horovod has been shut down", "DistNetworkError", "DistBackendError")


def is_peer_text(text: str) -> bool:
    return any(sign in text for sign in PEER_FAILURE_SIGNS)


def is_peer_failure(exc: BaseException) -> bool:
    """A collective that broke because another rank died: an echo, not the cause."""
    import torch.distributed as dist

    peer_types = tuple(t for t in (getattr(dist, "DistNetworkError", None), getattr(dist, "DistBackendError", None))
                       if t is not None)
    text = f"{type(exc).__name__}: {exc}"
    return isinstance(exc, peer_types) or is_peer_text(text)


def report_error(client: Any, exc: BaseException) -> None:
    """Tell the driver this rank's error at once, before tearing down the communicator: once a
    backend shuts down, peers fail fast and Spark may kill this task before it says anything."""
    if client is None or getattr(exc, "_sparkdl_reported", False):
        return
    detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    # A compat rank's child failed: its own traceback, not this task's (executor/child_process.py)
    trace = getattr(exc, "rank_traceback", "") or "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    import socket

    # retryable: every rank's same error that another attempt may not meet (checkpoint_fallback.py)
    client.send_now("error", text=f"{detail}\n{trace}", peer_failure=is_peer_failure(exc), host=socket.gethostname(),
                    hint=getattr(exc, "hint", None), retryable=getattr(exc, "retryable", False) is True)
    try:
        exc._sparkdl_reported = True  # type: ignore[attr-defined]
    except AttributeError:  # some C-level exceptions take no attributes
        pass
