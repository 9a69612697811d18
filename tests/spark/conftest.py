"""One session-scoped SparkSession for every Spark test: two real executors of two cores each
(local-cluster; four barrier slots, for hybrid 2 x 2), so
barrier tasks, rendezvous and result collection cross process boundaries as on a cluster.
One multi-host bed (`bed`) for every bed module, started by the first that asks for it."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Iterator

import pytest

MASTER = os.environ.get("SPARKDL_TEST_MASTER", "local-cluster[2,2,1024]")


@pytest.fixture(scope="session")
def spark() -> Iterator["SparkSession"]:  # noqa: F821
    from pyspark.sql import SparkSession

    os.environ["PYSPARK_PYTHON"] = sys.executable
    from s3_server import CREDENTIALS_ENV

    for key, value in CREDENTIALS_ENV.items():  # executors inherit the environment the session starts with
        os.environ.setdefault(key, value)
    session = (
        SparkSession.builder.master(MASTER)
        .appName("sparkdl-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.default.parallelism", "2")
        .config("spark.executor.memory", "1g")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def digits_df(spark):  # type: ignore[no-untyped-def]
    from sparkdl.datasets import digits_dataframe

    return digits_dataframe(spark).cache()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):  # type: ignore[no-untyped-def]
    """A real `mlflow server` (sqlite backend, served artifacts) on 127.0.0.1 at a free port."""
    from mlflow_server import mlflow_server_fixture

    yield from mlflow_server_fixture(tmp_path_factory)


@pytest.fixture(scope="session")
def s3_server(spark, tmp_path_factory):  # type: ignore[no-untyped-def]
    """moto's S3 on 127.0.0.1 at a free port with one bucket (tests/support/s3_server.py); after
    `spark`, whose executors got the credentials it needs in their environment."""
    from s3_server import s3_server_fixture

    yield from s3_server_fixture(tmp_path_factory)


@pytest.fixture(scope="session", autouse=True)
def calibration_cache(tmp_path_factory) -> Iterator[None]:  # type: ignore[no-untyped-def]
    """The planner's calibration cache goes to a temporary directory, not the user's home."""
    previous = os.environ.get("SPARKDL_CACHE_DIR")
    os.environ["SPARKDL_CACHE_DIR"] = str(tmp_path_factory.mktemp("sparkdl-cache"))
    yield
    if previous is None:
        os.environ.pop("SPARKDL_CACHE_DIR", None)
    else:
        os.environ["SPARKDL_CACHE_DIR"] = previous


@pytest.fixture(scope="session")
def bed():  # type: ignore[no-untyped-def]
    """The multi-host bed (tests/support/multihost.py): a standalone master, a driver host, a client
    host and three worker hosts of two cores, shared by test_multihost and test_multihost_elastic
    (each asks for the cores per host its scenarios need: bed.use_worker_cores). Needs root."""
    import multihost

    reason = multihost.why_not()
    if reason is not None:
        pytest.skip(reason)
    # Outside /tmp: every emulated host mounts a /tmp of its own; the bed's shared directory is here.
    root = Path("/var/tmp") / f"sparkdl-bed-{os.getpid()}"
    shutil.rmtree(root, ignore_errors=True)
    with multihost.Bed(root, workers=3, worker_cores=2) as started:
        yield started
    shutil.rmtree(root, ignore_errors=True)
