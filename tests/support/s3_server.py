"""A real S3 endpoint for tests: moto's server as a subprocess on 127.0.0.1 at a free port.

    from s3_server import S3Server                  # tests/support is on pytest's pythonpath

    with S3Server(tmp_path) as server:              # blocks until the endpoint answers; bucket made
        uri = server.uri("some/prefix")             # s3://sparkdl-tests/some/prefix?endpoint_override=...

pyarrow opens the URI directly (`endpoint_override`, `scheme=http`, `region` are query options it
reads); it refuses credentials in the URI, so they come from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY.
Executors of a local-cluster are separate processes started with the environment of the driver's JVM
when the SparkContext began: the credentials must be in os.environ before the session starts, which
`CREDENTIALS_ENV` is for (tests/spark/conftest.py sets it ahead of the `spark` fixture). moto accepts
any credentials; they only keep the AWS SDK from probing for instance metadata.
"""
from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Iterator

__all__ = ["BUCKET", "CREDENTIALS_ENV", "S3Server", "s3_server_fixture"]

BUCKET = "sparkdl-tests"
CREDENTIALS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                   "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
START_TIMEOUT_S = 60.0
PORT_RETRIES = 3  # moto exits on a port lost to another process: try another


class S3Server:
    """moto's S3 on 127.0.0.1, with one bucket (BUCKET); stopped by its process handle."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def uri(self, prefix: str) -> str:
        return (f"s3://{BUCKET}/{prefix.strip('/')}?endpoint_override={self.endpoint}&scheme=http"
                f"&region={CREDENTIALS_ENV['AWS_DEFAULT_REGION']}")

    def filesystem(self) -> tuple["object", str]:
        """(pyarrow S3FileSystem, BUCKET) to look at what a test wrote."""
        import pyarrow.fs as pafs

        fs, _ = pafs.FileSystem.from_uri(self.uri("x"))
        return fs, BUCKET

    def start(self) -> "S3Server":
        for attempt in range(PORT_RETRIES):
            # moto takes a port number only: one the OS said was free may be taken before moto binds
            # it (another suite, a parallel job); then it exits saying so, and another port is tried.
            self.port = _free_port()
            log = open(self.root / "moto.log", "ab")  # noqa: SIM115 - the child holds it open
            self._process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                                              str(self.port)], stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL)
            log.close()
            try:
                self._wait_ready()
                break
            except RuntimeError as exc:
                if "address already in use" not in str(exc).lower() or attempt == PORT_RETRIES - 1:
                    raise
        import pyarrow.fs as pafs

        fs, _ = pafs.FileSystem.from_uri(self.uri("x") + "&allow_bucket_creation=true")
        fs.create_dir(BUCKET)
        return self

    def stop(self) -> None:
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(10)
        self._process = None

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self._process is not None
            if self._process.poll() is not None:
                raise RuntimeError(f"moto server exited with {self._process.returncode}: {self._log_tail()}")
            try:
                urllib.request.urlopen(f"http://{self.endpoint}/moto-api/", timeout=2).close()
                return
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)  # polling the endpoint until it answers
        self.stop()
        raise RuntimeError(f"moto server did not answer within {START_TIMEOUT_S:g} s: {self._log_tail()}")

    def _log_tail(self) -> str:
        path = self.root / "moto.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""


def s3_server_fixture(tmp_path_factory: "object") -> Iterator[S3Server]:
    """For a session-scoped fixture: one server for the session, stopped at its end."""
    with S3Server(tmp_path_factory.mktemp("s3")) as server:  # type: ignore[attr-defined]
        yield server


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
