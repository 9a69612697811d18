"""The main of a compat rank's child process: `python -m sparkdl.executor.child_main <workdir>`.

Loads (fn, args, kwargs) from <workdir>/call.pkl, calls it, and writes the return value
(result.pkl, cloudpickle) or why it failed (error.json: type, module, message, traceback), each
atomically. Imports neither torch nor sparkdl's heavy modules: the function imports what it uses.
"""
from __future__ import annotations

import json
import os
import pickle
import sys
import traceback
from typing import Any

from sparkdl.executor.child_process import CALL_FILE, ERROR_FILE, RESULT_FILE


def _write_atomically(path: str, data: bytes) -> None:
    partial = path + ".partial"
    with open(partial, "wb") as f:
        f.write(data)
    os.replace(partial, path)


def _error(exc: BaseException) -> dict[str, str]:
    kind = type(exc)
    return {"type": kind.__qualname__, "module": kind.__module__, "message": str(exc),
            "traceback": "".join(traceback.format_exception(kind, exc, exc.__traceback__))}


def main(workdir: str) -> int:
    try:
        with open(os.path.join(workdir, CALL_FILE), "rb") as f:
            fn, args, kwargs = pickle.load(f)
        result: Any = fn(*args, **kwargs)
    except SystemExit as exc:
        if exc.code in (0, None):
            result = None
        else:
            _write_atomically(os.path.join(workdir, ERROR_FILE), json.dumps(_error(exc)).encode())
            return 1
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, KeyboardInterrupt included
        _write_atomically(os.path.join(workdir, ERROR_FILE), json.dumps(_error(exc)).encode())
        return 1
    from pyspark import cloudpickle

    try:
        data = cloudpickle.dumps(result)
    except Exception as exc:  # noqa: BLE001
        failure = _error(exc)
        failure["message"] = f"the function's return value cannot be pickled: {failure['message']}"
        _write_atomically(os.path.join(workdir, ERROR_FILE), json.dumps(failure).encode())
        return 1
    _write_atomically(os.path.join(workdir, RESULT_FILE), data)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    # A function may leave non-daemon threads (a DataLoader's, a process group's watchdog) behind.
    os._exit(code)
