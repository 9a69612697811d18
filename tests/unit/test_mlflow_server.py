"""The MlflowServer test helper against a real server (one start for the whole module)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

mlflow = pytest.importorskip("mlflow")

from mlflow_server import FAST_FAIL_CLIENT_ENV, MlflowServer, mlflow_server_fixture  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    yield from mlflow_server_fixture(tmp_path_factory)


def test_round_trip_then_kill_fails_fast(
    server: MlflowServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert server.running
    assert server.uri == f"http://127.0.0.1:{server.port}"
    print(f"mlflow server started in {server.startup_seconds:.1f} s")

    client = mlflow.MlflowClient(tracking_uri=server.uri)
    exp_id = client.create_experiment("sparkdl-helper-test")
    assert client.get_experiment(exp_id).artifact_location.startswith("mlflow-artifacts:")
    run = client.create_run(exp_id)
    run_id = run.info.run_id
    client.log_param(run_id, "lr", "0.1")
    for step, loss in enumerate([1.0, 0.5, 0.25]):
        client.log_metric(run_id, "loss", loss, step=step)
    src = tmp_path / "note.txt"
    src.write_text("hello from the test\n")
    client.log_artifact(run_id, str(src), artifact_path="notes")
    client.set_terminated(run_id)

    got = client.get_run(run_id)
    assert got.data.params == {"lr": "0.1"}
    assert got.info.status == "FINISHED"
    history = client.get_metric_history(run_id, "loss")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [
        (0, 1.0),
        (1, 0.5),
        (2, 0.25),
    ]
    assert [a.path for a in client.list_artifacts(run_id, "notes")] == ["notes/note.txt"]
    local = client.download_artifacts(run_id, "notes/note.txt", str(tmp_path / "dl"))
    assert Path(local).read_text() == "hello from the test\n"
    # Proxied artifacts: the server stored the file under its own artifacts folder.
    stored = list(server.artifacts_dir.rglob("note.txt"))
    assert len(stored) == 1 and stored[0].read_text() == "hello from the test\n"

    server.kill()
    assert not server.running
    server.kill()  # idempotent
    for name, value in FAST_FAIL_CLIENT_ENV.items():
        monkeypatch.setenv(name, value)
    t0 = time.monotonic()
    with pytest.raises(mlflow.exceptions.MlflowException):
        client.log_metric(run_id, "loss", 0.1, step=3)
    elapsed = time.monotonic() - t0
    print(f"client call to the killed server failed after {elapsed:.2f} s")
    assert elapsed < 10.0

    server.stop()  # idempotent after kill


def test_start_failure_raises_with_log_tail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No real server here: a stand-in command that dies at once exercises the error path.
    bad = MlflowServer(tmp_path / "bad", start_timeout=30.0)
    cmd = [sys.executable, "-c", "print('boom: cannot start'); raise SystemExit(3)"]
    monkeypatch.setattr(bad, "command", lambda: cmd)
    with pytest.raises(RuntimeError, match="(?s)exited with code 3.*boom: cannot start"):
        bad.start()
    assert not bad.running
    bad.stop()
    bad.kill()
