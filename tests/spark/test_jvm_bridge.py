"""The JVM bridge on local-cluster: the jar compiled with javac against pyspark's jars, Preflight from
Python and through spark-submit (exit code 2 on problems), BarrierWatch events of a failed rank."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import sparkdl
from sparkdl.spark import jvm
from sparkdl.errors import TrainingError


@pytest.fixture(scope="session")
def bridge_jar(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return jvm.build_jar(tmp_path_factory.mktemp("jvm") / jvm.JAR_NAME)


@pytest.fixture(scope="session")
def attached(spark, bridge_jar: Path):  # type: ignore[no-untyped-def]
    assert jvm.attach(spark, bridge_jar)
    return spark


def test_the_jar_holds_the_bridge_classes(bridge_jar: Path) -> None:
    import zipfile

    names = set(zipfile.ZipFile(bridge_jar).namelist())
    assert {"ai/sparkdl/bridge/BarrierWatch.class", "ai/sparkdl/bridge/Preflight.class"} <= names


def test_preflight_from_python_names_requested_and_available_slots(attached) -> None:  # type: ignore[no-untyped-def]
    report = jvm.preflight(attached, 100)
    assert report is not None and report["requested"] == 100 and report["slots"] == 4
    (problem,) = report["problems"]
    assert problem["code"] == "slots" and "100 task slots" in problem["message"] and "only 4" in problem["message"]
    assert jvm.preflight(attached, 2)["problems"] == []


def test_preflight_under_spark_submit_exits_2_on_problems(bridge_jar: Path) -> None:
    import pyspark

    submit = Path(pyspark.__file__).parent / "bin" / "spark-submit"
    base = [str(submit), "--master", "local[2]", "--conf", "spark.ui.enabled=false",
            "--class", "ai.sparkdl.bridge.Preflight", str(bridge_jar)]
    bad = subprocess.run(base + ["8"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2, bad.stderr[-2000:]
    report = json.loads(bad.stdout.strip().splitlines()[-1])
    assert report["requested"] == 8 and report["slots"] == 2 and report["problems"][0]["code"] == "slots"
    good = subprocess.run(base + ["2"], capture_output=True, text=True, timeout=120)
    assert good.returncode == 0 and json.loads(good.stdout.strip().splitlines()[-1])["problems"] == []
    usage = subprocess.run(base + ["two"], capture_output=True, text=True, timeout=120)
    assert usage.returncode == 2 and "usage" in usage.stderr
    dynamic = subprocess.run(base[:3] + ["--conf", "spark.dynamicAllocation.enabled=true"] + base[3:] + ["1"],
                             capture_output=True, text=True, timeout=120)
    assert dynamic.returncode == 2, dynamic.stderr[-2000:]
    codes = [p["code"] for p in json.loads(dynamic.stdout.strip().splitlines()[-1])["problems"]]
    assert codes == ["dynamic_allocation"]


def test_barrier_watch_reports_the_failed_rank_and_its_exception_line(attached) -> None:  # type: ignore[no-untyped-def]
    jvm.drain_events(attached)

    def train_fn(ctx):  # type: ignore[no-untyped-def]
        if ctx.rank == 1:
            raise KeyError("no such column on purpose")
        ctx.comm.barrier()

    with pytest.raises(TrainingError, match="rank 1") as info:
        sparkdl.run(train_fn, num_workers=2, progress=False)
    events = info.value.events  # the job's events, drained by the driver when it failed
    failed = [e for e in events if e["event"] == "task_failed" and e["kind"] == "exception"]
    assert any(e["rank"] == 1 and "KeyError" in e["line"] and "no such column on purpose" in e["line"]
               for e in failed), events
    assert all(e["executor"] and e["host"] for e in failed)
    assert any(e["event"] == "stage_failed" and e["barrier"] for e in events), events


def test_without_the_bridge_everything_degrades_to_none(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    class Connect:  # a Spark Connect session has no JVM on the client side
        @property
        def sparkContext(self):  # type: ignore[no-untyped-def]
            raise RuntimeError("[JVM_ATTRIBUTE_NOT_SUPPORTED] not supported in Spark Connect")

    assert jvm.preflight(Connect(), 2) is None and jvm.drain_events(Connect()) == [] and not jvm.attach(Connect())
    monkeypatch.setenv("SPARKDL_BRIDGE_JAR", str(tmp_path / "missing.jar"))
    monkeypatch.setattr(jvm, "packaged_jar", lambda: tmp_path / "also-missing.jar")
    assert jvm.jar_path() is None and jvm.session_options() == {}
    assert sys.modules["sparkdl.spark.jvm"] is jvm
