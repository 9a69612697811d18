"""Through Spark Connect (a real Connect server over local-cluster, tests/support/connect_server.py,
and a client process, tests/support/shipping_connect_client.py): the executors are asked which
modules they import by a job the client runs, so a `pip install --target` library on the server's
executors' PYTHONPATH (and the client's) travels by reference and trains although it cannot be
pickled by value, and a library only the client has is shipped by value and trains."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from connect_server import ConnectServer
from shipping_libs import pip_install_target

SUPPORT = Path(__file__).resolve().parents[1] / "support"
REPO = Path(__file__).resolve().parents[2]
SHARED, CLIENT = "sparkdl_connect_lib_shared", "sparkdl_connect_lib_client"


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    shared = pip_install_target(tmp_path_factory.mktemp("shared-lib"), SHARED, unpicklable=True)
    client = pip_install_target(tmp_path_factory.mktemp("client-lib"), CLIENT, unpicklable=False)
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(shared), before) if p)  # the server's executors inherit it
    try:
        server = ConnectServer(tmp_path_factory.mktemp("connect-server")).start()
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = before
    out = tmp_path_factory.mktemp("connect-client") / "results.json"
    try:
        done = subprocess.run([sys.executable, str(SUPPORT / "shipping_connect_client.py"), server.url, str(shared),
                               SHARED, str(client), CLIENT, str(out)], cwd=REPO, env=server.client_env(),
                              capture_output=True, text=True, timeout=900)
    finally:
        server.stop()
    results = json.loads(out.read_text()) if out.exists() else {}
    assert results, f"the client wrote nothing (rc {done.returncode}):\n{done.stderr[-4000:]}"
    return results


def test_a_library_the_executors_import_travels_by_reference_under_connect(seen) -> None:  # type: ignore[no-untyped-def]
    assert seen["connect"] is True
    assert "shared_error" not in seen, seen["shared_error"]
    assert seen["shared"] == {"executors_import": [f"{SHARED}.layers"], "registered": [], "by_value": False,
                              "epochs": 1}


def test_a_library_only_the_client_has_travels_by_value_under_connect(seen) -> None:  # type: ignore[no-untyped-def]
    assert "client_error" not in seen, seen["client_error"]
    assert seen["client"] == {"executors_import": [], "registered": [f"{CLIENT}.layers"], "by_value": True,
                              "epochs": 1}
