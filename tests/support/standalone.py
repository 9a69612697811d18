"""A real Spark standalone cluster on 127.0.0.1 for tests: a Master and Workers started with the
pyspark wheel's own bin/spark-class (no SPARK_HOME), each in its own process group, stopped (and
their executors with them) at the end. The pytest process keeps its local-cluster session, so
applications on this cluster run in subprocesses (spark-submit, or a Python driver script)."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyspark

SPARK_CLASS = Path(pyspark.__file__).parent / "bin" / "spark-class"


MASTER_URL = re.compile(r"Starting Spark master at (spark://\S+:(\d+))")


def free_port() -> int:
    """A port the OS says is free now, for a server that takes a number and says where it bound
    (callers read the bound port back; never rely on this one staying free)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def environment() -> dict[str, str]:
    """Executors run this Python; pyspark's scripts are found next to it."""
    return {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
            "SPARK_LOCAL_IP": "127.0.0.1"}


class StandaloneCluster:
    def __init__(self, workdir: Path, cores: int = 1, memory: str = "1g") -> None:
        self.workdir = workdir
        self.cores, self.memory = cores, memory
        self.port = 0  # the master binds a port the OS assigns; start_master reads it from the master's log
        self.url = ""
        self._processes: list[subprocess.Popen[Any]] = []

    def _start(self, name: str, *args: str) -> subprocess.Popen[Any]:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        process = subprocess.Popen([str(SPARK_CLASS), *args], stdout=log, stderr=subprocess.STDOUT,
                                   env=environment(), start_new_session=True)
        self._processes.append(process)
        return process

    def start_master(self) -> "StandaloneCluster":
        # Port 0 everywhere: the OS assigns them, so no picked port can be taken before it is bound.
        self._start("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", "0",
                    "--webui-port", "0")
        self._wait_for("master", "I have been elected leader")
        found = MASTER_URL.search((self.workdir / "master.log").read_text(errors="replace"))
        if found is None:
            raise RuntimeError(f"the master logged no URL:\n{(self.workdir / 'master.log').read_text()[-3000:]}")
        self.url, self.port = found.group(1), int(found.group(2))
        return self

    def start_worker(self, index: int) -> None:
        work = self.workdir / f"worker-{index}"
        work.mkdir(exist_ok=True)
        self._start(f"worker-{index}", "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1", "--cores",
                    str(self.cores), "--memory", self.memory, "--work-dir", str(work), "--webui-port",
                    "0", self.url)
        self._wait_for(f"worker-{index}", "Successfully registered with master")

    def _wait_for(self, name: str, line: str, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        log = self.workdir / f"{name}.log"
        while time.monotonic() < deadline:
            if log.exists() and line in log.read_text(errors="replace"):
                return
            time.sleep(0.3)
        raise TimeoutError(f"{name} did not log {line!r} within {timeout_s:g} s:\n{log.read_text()[-3000:]}")

    def stop(self) -> None:
        # Executors are children of the workers but in sessions of their own: none may outlive the
        # test. Found by parent PID before the workers go, and stopped by PID.
        executors = [pid for process in self._processes for pid in descendants(process.pid)]
        for pid in executors:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for process in reversed(self._processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self._processes:
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)


def descendants(pid: int) -> list[int]:
    """PIDs of every process below `pid` (children, their children, ...)."""
    listing = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in listing.split("\n"):
        fields = line.split()
        if len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit():
            children.setdefault(int(fields[1]), []).append(int(fields[0]))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
