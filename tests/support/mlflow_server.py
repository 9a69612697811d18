"""A real MLflow tracking server for tests, run as a subprocess.

    from mlflow_server import MlflowServer          # tests/support is on pytest's pythonpath

    with MlflowServer(tmp_path) as server:          # blocks until GET /health answers
        client = mlflow.MlflowClient(tracking_uri=server.uri)
        ...
        server.kill()                               # simulate the server dying mid-run

Session-scoped fixture for a conftest (one server start for the whole session; a start costs
~7-10 s and ~520 MiB RSS in two processes on a 2-core machine):

    from mlflow_server import mlflow_server_fixture

    @pytest.fixture(scope="session")
    def mlflow_server(tmp_path_factory):
        yield from mlflow_server_fixture(tmp_path_factory)

A test that kills the shared server should call ``server.start()`` afterwards: it starts again on
the same port with the same SQLite store and artifact folder, so runs logged before survive
(the restart path is not exercised by tests/unit/test_mlflow_server.py, which starts one server).

Command line (see ``MlflowServer.command``)::

    <sys.executable> -m mlflow server --host 127.0.0.1 --port <port>
        --backend-store-uri sqlite:///<root>/mlflow.db
        --serve-artifacts --artifacts-destination <root>/artifacts --workers 1

with ``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false`` in its environment. Notes (mlflow 3.x):

- Artifacts are *proxied*: new experiments get ``mlflow-artifacts:/`` as artifact location, so
  clients upload/download through the server over HTTP (as a remote server would) and the files
  land under ``<root>/artifacts``. With ``--default-artifact-root <local dir>`` clients would write
  to the directory themselves and a dead server would not affect artifact logging.
- ``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false`` stops the server from spawning its job runner and
  seven huey consumer processes (about +6 s of startup and +0.75 GB RSS, plus a temp dir left in
  /dev/shm when the group is SIGKILLed). Training runs do not need jobs.
- ``--workers 1``: uvicorn runs a single process instead of four.
- The default security middleware accepts Host ``127.0.0.1:<port>`` / ``localhost``; no
  ``--allowed-hosts`` needed for loopback clients.

Clients: MLflow's HTTP client retries a refused connection ``MLFLOW_HTTP_REQUEST_MAX_RETRIES``
times (default 7) with exponential backoff (``MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR``, default 2) and
``MLFLOW_HTTP_REQUEST_TIMEOUT`` (default 120 s) per attempt, so a call to a dead server blocks for
minutes (measured: ~247 s before MlflowException on a refused port). ``FAST_FAIL_CLIENT_ENV``
(retries 0, timeout 2 s) makes a refused connection fail in ~0 s (a hung server should time out
after 2 s; not measured); both are read on every request, so monkeypatch.setenv just before a call works.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["FAST_FAIL_CLIENT_ENV", "MlflowServer", "mlflow_server_fixture"]

#: Client-side env vars that make MLflow calls to an unreachable server fail in ~0 s instead of
#: retrying with backoff for minutes.
FAST_FAIL_CLIENT_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "2"}

_SERVER_ENV = {
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    "MLFLOW_SERVER_JOB_ENABLE_PERIODIC_TASKS": "false",
    "PYTHONUNBUFFERED": "1",
}
_LOG_TAIL_BYTES = 4000
_PORT_RETRIES = 3


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


class MlflowServer:
    """A real ``mlflow server`` (SQLite store, proxied artifacts) in its own process group."""

    def __init__(
        self,
        root: Path,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        start_timeout: float = 90.0,
    ) -> None:
        self.root = Path(root).resolve()
        self.host = host
        self.port = port
        self.start_timeout = start_timeout
        self.db_path = self.root / "mlflow.db"
        self.artifacts_dir = self.root / "artifacts"
        self.log_path = self.root / "server.log"
        #: Seconds the last start() took until /health answered.
        self.startup_seconds: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._fixed_port = port is not None
        self._atexit_registered = False

    # -- public API -----------------------------------------------------------------------------

    @property
    def uri(self) -> str:
        if self.port is None:
            raise RuntimeError("MlflowServer has no port yet: call start() first")
        return f"http://{self._client_host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """PID of the ``mlflow server`` process, which is also the process-group id."""
        return None if self._proc is None else self._proc.pid

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "mlflow", "server",
            "--host", self.host,
            "--port", str(self.port),
            "--backend-store-uri", f"sqlite:///{self.db_path}",
            "--serve-artifacts",
            "--artifacts-destination", str(self.artifacts_dir),
            "--workers", "1",
        ]  # fmt: skip

    def start(self) -> MlflowServer:
        """Start the server (or restart it after kill()/stop(), on the same port and store) and
        wait until it answers; raises RuntimeError with the log tail if it does not."""
        if self.running:
            return self
        self.root.mkdir(parents=True, exist_ok=True)
        self.artifacts_dir.mkdir(parents=True, exist_ok=True)
        if not self._atexit_registered:
            atexit.register(self.stop)
            self._atexit_registered = True
        for attempt in range(_PORT_RETRIES):
            if self.port is None:
                self.port = _free_port(self.host if self.host != "0.0.0.0" else "127.0.0.1")
            log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
            try:
                self._launch_and_wait()
                return self
            except RuntimeError:
                in_use = "address already in use" in self._log_tail(log_offset).lower()
                if self._fixed_port or not in_use or attempt == _PORT_RETRIES - 1:
                    raise
                self.port = None  # lost a race for the free port: pick another one
        raise AssertionError("unreachable")

    def kill(self) -> None:
        """SIGKILL the whole process group (simulates the server dying); returns once the port
        no longer accepts connections. Idempotent."""
        proc = self._proc
        if proc is None:
            return
        self._signal_group(proc, signal.SIGKILL)
        self._reap(proc, timeout=10.0)

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it after 10 s. Idempotent."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            self._signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                pass
        # The group leader may be gone while a worker lingers: always finish with SIGKILL.
        self._signal_group(proc, signal.SIGKILL)
        self._reap(proc, timeout=10.0)

    def log_tail(self, max_bytes: int = _LOG_TAIL_BYTES) -> str:
        return self._log_tail(0, max_bytes)

    def __enter__(self) -> MlflowServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"MlflowServer(uri={self.uri if self.port else None!r}, root={str(self.root)!r}, {state})"

    # -- internals ------------------------------------------------------------------------------

    @property
    def _client_host(self) -> str:
        return "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host

    def _launch_and_wait(self) -> None:
        env = {**os.environ, **_SERVER_ENV}
        started = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {time.strftime('%H:%M:%S')} {' '.join(self.command())}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                self.command(),
                cwd=self.root,  # mlflow may create ./mlruns or ./mlartifacts relative to cwd
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own session => own process group (pgid == pid)
            )
        proc = self._proc
        deadline = started + self.start_timeout
        health = f"{self.uri}/health"
        while True:
            if proc.poll() is not None:
                self._reap(proc, timeout=5.0)
                raise RuntimeError(
                    f"mlflow server exited with code {proc.returncode} before answering "
                    f"{health}; log {self.log_path}:\n{self.log_tail()}"
                )
            if self._healthy(health):
                self.startup_seconds = time.monotonic() - started
                return
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"mlflow server did not answer {health} within {self.start_timeout:.0f} s; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.2)

    @staticmethod
    def _healthy(url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2.0) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError, ValueError):
            return False

    @staticmethod
    def _signal_group(proc: subprocess.Popen[Any], sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _reap(self, proc: subprocess.Popen[Any], timeout: float) -> None:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        # Workers are reparented when the leader dies; their sockets close when they die, so
        # wait for the port to refuse connections rather than for the processes to be reaped.
        if self.port is not None:
            deadline = time.monotonic() + timeout
            while _port_open(self._client_host, self.port) and time.monotonic() < deadline:
                time.sleep(0.05)
        self._proc = None

    def _log_tail(self, offset: int, max_bytes: int = _LOG_TAIL_BYTES) -> str:
        try:
            with open(self.log_path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(offset, size - max_bytes))
                return f.read().decode(errors="replace")
        except OSError as e:
            return f"<could not read {self.log_path}: {e}>"


def mlflow_server_fixture(tmp_path_factory: Any) -> Iterator[MlflowServer]:
    """Body of a pytest fixture: one server under a fresh tmp dir, stopped at teardown.

    Wrap it in a conftest as
    ``@pytest.fixture(scope="session") def mlflow_server(tmp_path_factory): yield from
    mlflow_server_fixture(tmp_path_factory)``.
    """
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    with server:
        yield server
