"""One rank's child process: a fresh interpreter that runs a compat function or script.

Why a child and not the task's own interpreter: a function written for TorchDistributor or Horovod
owns its process: it calls init_process_group/hvd.init, sets os.environ, torch's threads and seeds,
may call sys.exit, and Lightning or accelerate read the torchrun variables at import. Spark reuses
its Python workers for later tasks, so none of that may happen in the worker; and a child that dies
(a segfault, the OOM killer) leaves the task alive to say so. The cost is one interpreter start and
the function's own imports per rank per run (torch: ~1.5 s), which TorchDistributor pays twice
(torchrun's agent, then its worker).

Standard library only on the task's side (cloudpickle is pyspark's, imported to load results).
"""
from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable

from sparkdl.executor.failures import is_peer_text
from sparkdl.wire.child import ChildCall

CALL_FILE, RESULT_FILE, ERROR_FILE = "call.pkl", "result.pkl", "error.json"
TAIL_LINES = 50  # of the child's stderr, for a script that failed without our error file
LineSink = Callable[[str, str], None]  # (stream name, line)


@dataclass(frozen=True)
class ChildOutcome:
    returncode: int
    result: bytes | None  # the function's return value, pickled; None for a script or a failure
    error: dict[str, str] | None  # {"type", "module", "message", "traceback"}: why it failed, or None


class ChildRankError(Exception):
    """A rank's function or script failed in its child process. Subclassed at run time under the
    user's exception type name (`rank_failure`), so the driver's message reads `ValueError: ...`."""

    rank_traceback: str = ""
    rank: int = -1


def rank_failure(rank: int, error: dict[str, str]) -> ChildRankError:
    """An exception whose type prints as the user's (module.Qualname) and which carries the child's
    traceback, raised by the rank's task."""
    name = error.get("type") or "Exception"
    module = error.get("module") or "builtins"
    kind = type(name.rsplit(".", 1)[-1], (ChildRankError,), {"__module__": module, "__qualname__": name})
    exc = kind(error.get("message", ""))
    exc.rank_traceback = error.get("traceback", "")
    exc.rank = rank
    return exc


def child_env(variables: dict[str, str], use_gpu: bool) -> dict[str, str]:
    """The task's environment, the rank's variables over it, unbuffered output, and the task's
    import path (Spark adds pyspark's zip and --py-files to sys.path, not to PYTHONPATH)."""
    env = dict(os.environ)
    if "OMP_NUM_THREADS" in env:
        variables = {k: v for k, v in variables.items() if k != "OMP_NUM_THREADS"}
    env.update(variables)
    env["PYTHONUNBUFFERED"] = "1"
    paths = [p for p in sys.path if p and os.path.exists(p)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    if not use_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def command(call: ChildCall, workdir: str) -> list[str]:
    if call.script:
        return [sys.executable, "-u", call.script, *call.script_args]
    return [sys.executable, "-u", "-m", "sparkdl.executor.child_main", workdir]


def run_child(call: ChildCall, env: dict[str, str], workdir: str, on_line: LineSink,
              stop: threading.Event | None = None) -> ChildOutcome:
    """Run the call in a child (its own session, so its DataLoader workers go with it), every line
    of its stdout/stderr handed to `on_line` as it comes; killed if this process is interrupted or
    `stop` is set (a sibling rank failed: this one may wait for it in a collective forever)."""
    if call.function:
        with open(os.path.join(workdir, CALL_FILE), "wb") as f:
            f.write(call.function)
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    process = subprocess.Popen(command(call, workdir), env=env, cwd=workdir, stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                               preexec_fn=_die_with_parent)
    pumps = [threading.Thread(target=_pump, args=(process.stdout, "stdout", on_line, None), daemon=True),
             threading.Thread(target=_pump, args=(process.stderr, "stderr", on_line, tail), daemon=True)]
    for pump in pumps:
        pump.start()
    stopped = False
    try:
        while True:
            try:
                returncode = process.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                if stop is not None and stop.is_set():
                    stopped = True
                    _kill_group(process)
    finally:
        if process.poll() is None:
            _kill_group(process)
        for pump in pumps:
            pump.join(timeout=10)
    if stopped:
        return ChildOutcome(returncode, None, {"type": "ChildProcessError", "module": "builtins", "traceback": "",
                                               "message": "stopped: another rank failed", "echo": "1"})
    return _outcome(call, workdir, returncode, list(tail))


def first_failure(outcomes: list[ChildOutcome], ranks: list[int] | None = None) -> tuple[int, dict[str, str]] | None:
    """(rank, error) of the failure to report: a rank's own error before the echoes of it (a peer's
    broken collective, a sibling stopped because of it), lowest rank first; None if all succeeded."""
    ranks = ranks if ranks is not None else list(range(len(outcomes)))
    failed = [(rank, o.error) for rank, o in zip(ranks, outcomes) if o.error is not None]
    if not failed:
        return None

    def echo(error: dict[str, str]) -> bool:
        text = f"{error.get('type')}: {error.get('message')}"
        return bool(error.get("echo")) or is_peer_text(text)

    own = [f for f in failed if not echo(f[1])]
    return (own or failed)[0]


def _outcome(call: ChildCall, workdir: str, returncode: int, tail: list[str]) -> ChildOutcome:
    error_path, result_path = os.path.join(workdir, ERROR_FILE), os.path.join(workdir, RESULT_FILE)
    if os.path.exists(error_path):
        with open(error_path, encoding="utf-8") as f:
            return ChildOutcome(returncode, None, json.load(f))
    if returncode != 0:
        return ChildOutcome(returncode, None, _exit_error(call, returncode, tail))
    if call.script:
        return ChildOutcome(0, None, None)
    if not os.path.exists(result_path):
        return ChildOutcome(returncode, None, {"type": "RuntimeError", "module": "builtins", "traceback": "",
                                               "message": "the function's process ended without its result"})
    with open(result_path, "rb") as f:
        return ChildOutcome(0, f.read(), None)


def _exit_error(call: ChildCall, returncode: int, tail: list[str]) -> dict[str, str]:
    what = f"the script {call.script}" if call.script else "the function's process"
    if returncode < 0:
        name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else str(-returncode)
        why = " (the kernel's OOM killer sends it when memory runs out)" if name == "SIGKILL" else ""
        message = f"{what} died of signal {name}{why}"
    else:
        message = f"{what} exited with code {returncode}"
    return {"type": "ChildProcessError", "module": "builtins", "message": message,
            "traceback": "\n".join(tail[-TAIL_LINES:])}


def _pump(stream: Any, name: str, on_line: LineSink, tail: collections.deque[str] | None) -> None:
    with stream:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if tail is not None:
                tail.append(line)
            try:
                on_line(name, line)
            except Exception:  # noqa: BLE001 - output must never stop the child (a full pipe would block it)
                pass


def _die_with_parent() -> None:
    """Linux: the child gets SIGKILL when the task's process dies (Spark kills a cancelled task's worker)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()
