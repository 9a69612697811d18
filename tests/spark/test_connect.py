"""Through a Spark Connect session only: a real Connect server (pyspark's spark-submit of
SparkConnectServer over local-cluster[2,2,1024], tests/support/connect_server.py) and a client
process (tests/support/connect_client.py, which ends with `sparkdl train --remote`). The digits
fit reaches the classic test's accuracy, transform and save/load work, the MLflow run is FINISHED with its metrics,
a custom loop returns rank 0's value, the planner and the CLI work, metrics reach MLflow when the
executors cannot reach the client's channel, and three concurrent fits each get their own run."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from connect_server import ConnectServer

SUPPORT = Path(__file__).resolve().parents[1] / "support"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def connect_server(tmp_path_factory):  # type: ignore[no-untyped-def]
    server = ConnectServer(tmp_path_factory.mktemp("connect-server")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(connect_server, mlflow_server, tmp_path_factory) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """What connect_client.py saw, with its stderr under "stderr" and its workdir under "workdir"."""
    workdir = tmp_path_factory.mktemp("connect-client")
    out = workdir / "results.json"
    done = subprocess.run([sys.executable, str(SUPPORT / "connect_client.py"), connect_server.url, mlflow_server.uri,
                           str(workdir), str(out)], cwd=REPO, env=connect_server.client_env(),
                          capture_output=True, text=True, timeout=900)
    results = json.loads(out.read_text()) if out.exists() else {}
    return {**results, "stderr": done.stderr, "returncode": done.returncode, "workdir": str(workdir)}


def step(client: dict[str, Any], name: str) -> Any:
    assert f"{name}_error" not in client, client[f"{name}_error"]
    assert name in client, f"the client stopped before {name!r} (rc {client['returncode']}):\n{client['stderr'][-4000:]}"
    return client[name]


def run_of(mlflow_server, run_id: str) -> Any:  # type: ignore[no-untyped-def]
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=mlflow_server.uri).get_run(run_id)


def metric_steps(mlflow_server, run_id: str, key: str) -> list[int]:  # type: ignore[no-untyped-def]
    from mlflow import MlflowClient

    return sorted(m.step for m in MlflowClient(tracking_uri=mlflow_server.uri).get_metric_history(run_id, key))


def test_the_session_is_a_connect_session(client) -> None:  # type: ignore[no-untyped-def]
    assert client.get("connect") is True
    assert client["returncode"] == 0, client["stderr"][-4000:]
    # what the JVM bridge cannot do under Connect is said once, in one line, never as a stack
    assert client["stderr"].count("the JVM bridge is off") == 1
    assert "Traceback" not in client["stderr"]


def test_digits_fit_and_transform_reach_the_classic_accuracy(client, mlflow_server) -> None:  # type: ignore[no-untyped-def]
    fit = step(client, "fit")
    assert fit["accuracy"] >= 0.93
    assert "prediction" in fit["columns"]
    assert fit["epochs"] == list(range(15))
    run = run_of(mlflow_server, fit["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["world.master"] == "local-cluster[2,2,1024]"
    assert metric_steps(mlflow_server, fit["run_id"], "epoch_loss") == list(range(15))
    assert run.data.metrics["loss"] > 0  # step metrics arrived live over the channel


def test_save_load_round_trips(client) -> None:  # type: ignore[no-untyped-def]
    assert step(client, "save_load") == {"same_predictions": True, "same_weights": True, "same_history": True}


def test_a_custom_loop_returns_rank_zeros_value(client) -> None:  # type: ignore[no-untyped-def]
    assert step(client, "run") == {"rank": 0, "size": 2, "sum": 3.0}


def test_the_planner_plans_with_its_calibration_probe(client) -> None:  # type: ignore[no-untyped-def]
    plan = step(client, "plan")
    assert plan["strategy"] in {"data_parallel", "diloco", "hybrid", "ist"} and plan["explained"]


def test_metrics_reach_mlflow_when_executors_cannot_reach_the_client(client, mlflow_server) -> None:  # type: ignore[no-untyped-def]
    lost = step(client, "unreachable_channel")
    assert lost["epochs"] == 3
    run = run_of(mlflow_server, lost["run_id"])
    assert run.info.status == "FINISHED"
    assert metric_steps(mlflow_server, lost["run_id"], "epoch_loss") == [0, 1, 2]
    assert "3 of 3 epoch records did not arrive live (channel 203.0.113.1:" in client["stderr"]


def test_three_concurrent_fits_each_get_their_own_run(client, mlflow_server) -> None:  # type: ignore[no-untyped-def]
    run_ids = step(client, "concurrent")
    assert not [r for r in run_ids if r.startswith("error")], run_ids
    assert len(set(run_ids)) == 3
    for index, run_id in enumerate(run_ids):
        run = run_of(mlflow_server, run_id)
        assert run.info.status == "FINISHED" and run.data.metrics["epoch_loss"] > 0
        assert run.data.tags["mlflow.runName"] == f"concurrent-{index}"


def test_the_slot_probe_counts_tasks_that_ran_at_once(client) -> None:  # type: ignore[no-untyped-def]
    # 4 slots: 2 probe tasks all run at once; of 6, only 4 can
    assert step(client, "probe_slots") == [2, 4]


def test_cli_train_with_remote_saves_a_model_the_classic_reader_loads(client, spark) -> None:  # type: ignore[no-untyped-def]
    from sparkdl.datasets import digits_dataframe
    from sparkdl.estimator import TorchModel

    assert step(client, "cli_train") == 0
    out = Path(client["workdir"]) / "cli-model"
    # written by the Connect server (metadata) and the client (model files); read by a classic driver
    scored = TorchModel.load(str(out)).transform(digits_dataframe(spark).limit(20))
    assert {r["prediction"] for r in scored.select("prediction").collect()} <= set(range(10))
