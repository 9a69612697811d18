"""Driver side of live callbacks: train.callbacks, each `fn(record: dict) -> None | "stop"`, called
on the driver with every epoch record as it arrives over the driver channel (driver/monitor.py),
so a notebook can plot or decide while training runs. Rank 0 waits for the verdict."""
from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

from sparkdl.errors import ConfigError

log = logging.getLogger("sparkdl")
Callback = Callable[[dict[str, Any]], Any]


def resolve_callbacks(specs: Sequence[Any]) -> tuple[Callback, ...]:
    """Callables as given; "package.module:function" paths (TOML, the CLI) imported."""
    from sparkdl.model.objectives import import_callable

    return tuple(spec if callable(spec) else
                 import_callable(spec, "train.callbacks entry", ConfigError, "a 'package.module:function' importable "
                                 "on the driver") for spec in specs)


def callback_name(callback: Callback) -> str:
    return str(getattr(callback, "__qualname__", None) or getattr(callback, "__name__", None) or repr(callback))


def run_callbacks(callbacks: Sequence[Callback], record: Mapping[str, Any]) -> dict[str, Any]:
    """Every callback sees the record (a copy each); the first "stop" decides the verdict. A
    callback that raises stops training too (cleanly, after this epoch: the model so far is kept),
    with the exception as the reason, rather than letting a broken plot hide a failure."""
    verdict: dict[str, Any] = {"stop": False}
    for callback in callbacks:
        try:
            answer = callback(dict(record))
        except Exception as exc:  # noqa: BLE001 - the user's code: reported, never crashes the channel
            log.exception("sparkdl: callback %s raised on epoch %s; training stops after it",
                          callback_name(callback), record.get("epoch"))
            answer, reason = "stop", f"raised {type(exc).__name__}: {exc}"
        else:
            reason = "returned 'stop'"
            if answer is not None and answer != "stop":
                log.warning("sparkdl: callback %s returned %r; only None or 'stop' mean anything",
                            callback_name(callback), answer)
        if answer == "stop" and not verdict["stop"]:
            verdict = {"stop": True, "stopped_by": f"callback:{callback_name(callback)}",
                       "reason": f"{callback_name(callback)} {reason} after epoch {record.get('epoch')}"}
    return verdict
