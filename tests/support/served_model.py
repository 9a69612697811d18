"""`mlflow models serve` started on a logged model's files and asked over REST (tests that check
what the scoring server answers). One server answers many requests: start it once per model
(`scoring_server`), it takes seconds to come up."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Iterator

STARTUP_S = 180


class ScoringServer:
    """A running `mlflow models serve` on 127.0.0.1; `ask` posts one JSON body to /invocations."""

    def __init__(self, process: subprocess.Popen, port: int) -> None:  # type: ignore[type-arg]
        self.process = process
        self.port = port

    def ask(self, body: dict[str, Any]) -> tuple[int, Any]:
        """(HTTP status, the decoded JSON answer) for one body ({"dataframe_split": ...},
        {"dataframe_records": ...}, {"inputs": ...}); the first call waits for the server to come up."""
        data = json.dumps(body, default=_json_default).encode()
        deadline = time.monotonic() + STARTUP_S
        while True:
            request = urllib.request.Request(f"http://127.0.0.1:{self.port}/invocations", data=data,
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=30) as answer:
                    return answer.status, json.loads(answer.read())
            except urllib.error.HTTPError as error:  # the server answered: a refused body
                return error.code, json.loads(error.read() or b"null")
            except OSError:
                assert self.process.poll() is None, "mlflow models serve exited"
                if time.monotonic() > deadline:
                    raise AssertionError(f"the scoring server did not answer within {STARTUP_S} s") from None
                time.sleep(0.5)

    def predictions(self, body: dict[str, Any]) -> list:  # type: ignore[type-arg]
        status, answer = self.ask(body)
        assert status == 200, f"HTTP {status}: {answer}"
        return answer["predictions"]


@contextlib.contextmanager
def scoring_server(model_dir: str) -> Iterator[ScoringServer]:
    """`mlflow models serve` on `model_dir` (the local copy of a logged model), stopped on exit."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ.get('PATH', '')}"}
    process = subprocess.Popen([sys.executable, "-m", "mlflow", "models", "serve", "-m", model_dir, "-h", "127.0.0.1",
                                "-p", str(port), "--env-manager", "local", "-w", "1"], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield ScoringServer(process, port)
    finally:
        process.terminate()
        process.wait(timeout=30)


def served_answers(model_dir: str, split: dict) -> list:  # type: ignore[type-arg]
    """The predictions `mlflow models serve` on `model_dir` answers for one dataframe_split body."""
    with scoring_server(model_dir) as server:
        return server.predictions({"dataframe_split": split})


def _json_default(value: Any) -> Any:
    """numpy integers and floats as JSON numbers (what any JSON client sends)."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON")
