"""A real Spark Connect server on 127.0.0.1 for tests: pyspark's own bin/spark-submit running
org.apache.spark.sql.connect.service.SparkConnectServer (the class sbin/start-connect-server.sh
starts), in its own process group, over a local-cluster master so barrier tasks run in executor
processes of their own.

It must be a separate process: pytest holds a classic SparkContext, and creating a Connect session
sets SPARK_CONNECT_MODE_ENABLED for the whole process (pyspark.sql.utils.is_remote), which would
turn the classic tests' pyspark.ml and functions calls into Connect calls. Clients run as
subprocesses too (tests/support/connect_client.py, `sparkdl train --remote`).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pyspark
from standalone import environment, free_port

SPARK_SUBMIT = Path(pyspark.__file__).parent / "bin" / "spark-submit"
SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
READY_LINE = "Spark Connect server started at"
BOUND = re.compile(r"Spark Connect server started at:?\s*\S*?:(\d+)")


class ConnectServer:
    def __init__(self, workdir: Path, master: str = "local-cluster[2,2,1024]") -> None:
        self.workdir, self.master = workdir, master
        self.port = free_port()
        self.url = f"sc://127.0.0.1:{self.port}"
        self.log = workdir / "connect-server.log"
        self._process: subprocess.Popen[Any] | None = None

    def command(self) -> list[str]:
        return [str(SPARK_SUBMIT), "--class", SERVER_CLASS, "--master", self.master, "--name", "sparkdl-connect-tests",
                "--conf", f"spark.connect.grpc.binding.port={self.port}",
                "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
                "--conf", "spark.ui.enabled=false", "--conf", "spark.executor.memory=1g",
                "--conf", "spark.sql.shuffle.partitions=4", "spark-internal"]

    def start(self, timeout_s: float = 120.0) -> ConnectServer:
        with open(self.log, "wb") as log:
            self._process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                             env=environment(), start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.log.read_text(errors="replace")
            if READY_LINE in text:
                # Spark binds the next port up when the one asked for was taken meanwhile: read where it is.
                bound = BOUND.search(text)
                if bound is not None and int(bound.group(1)) != self.port:
                    self.port = int(bound.group(1))
                    self.url = f"sc://127.0.0.1:{self.port}"
                return self
            if self._process.poll() is not None:
                break
            time.sleep(0.3)
        text = self.log.read_text(errors="replace")[-3000:]
        self.stop()
        raise RuntimeError(f"the Spark Connect server did not start within {timeout_s:g} s:\n{text}")

    def client_env(self) -> dict[str, str]:
        """The environment of a client process: this Python for executors, no inherited SPARK_REMOTE."""
        env = environment()
        env.pop("SPARK_REMOTE", None)
        return env

    def stop(self) -> None:
        process = self._process
        if process is None or process.poll() is not None:
            return
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
