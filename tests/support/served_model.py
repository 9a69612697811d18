"""`mlflow models serve` started on a logged model's files and asked over REST (tests that check
what the scoring server answers)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request


def served_answers(model_dir: str, split: dict) -> list:  # type: ignore[type-arg]
    """The predictions `mlflow models serve` on `model_dir` answers for one dataframe_split body."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ.get('PATH', '')}"}
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "models", "serve", "-m", model_dir, "-h", "127.0.0.1",
                               "-p", str(port), "--env-manager", "local", "-w", "1"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        body = json.dumps({"dataframe_split": split}, default=int).encode()  # numpy integers as JSON numbers
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=body,
                                                 headers={"Content-Type": "application/json"})
                return json.loads(urllib.request.urlopen(request, timeout=30).read())["predictions"]
            except OSError:
                assert server.poll() is None, "mlflow models serve exited"
                time.sleep(1)
        raise AssertionError("the scoring server did not answer within 180 s")
    finally:
        server.terminate()
        server.wait(timeout=30)
