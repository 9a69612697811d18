"""Shared, Spark-free test setup (Spark fixtures live in tests/spark/conftest.py).

Executors must run the same Python as the driver (DESIGN.md): set it before anything imports
pyspark, so `pytest` works the same whether or not it was started through `make test`.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import pytest

os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable

REPO_ROOT = Path(__file__).resolve().parent.parent

# Fits log to MLflow by default; keep the suite's runs out of the working directory. Tests of
# tracking itself start a real server (tests/support/mlflow_server.py) and pass its URI.
_MLFLOW_DIR = tempfile.mkdtemp(prefix="sparkdl-tests-mlflow-")
os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{_MLFLOW_DIR}/mlflow.db")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository root (holds conf/, sparkdl/, tests/)."""
    return REPO_ROOT


# -- Horovod's build beside the tests (`make test`) ---------------------------------------------------
# `make test` builds Horovod in the background while the lanes start (the Makefile's `test` target):
# SPARKDL_HOROVOD_BUILD_STATUS names the file the build writes its exit status to when it ends. Modules
# holding a `horovod` test run last in their lane and wait for that file first; the wait sits outside
# pytest-timeout's clock (tryfirst wrapper), so a slow build cannot time out the module's first test.
BUILD_STATUS_ENV = "SPARKDL_HOROVOD_BUILD_STATUS"
BUILD_WAIT_S = 45 * 60  # far above a cold 2-core build (~11 min); the lane goes on and Horovod's tests then fail
_build: dict[str, str] = {}
_horovod_modules: set[str] = set()  # node ids of the modules that hold a `horovod` test


def _module_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules that hold a `horovod` test after the others (a stable sort: order within kept), so a
    lane started before the build ends runs everything else first."""
    if not os.environ.get(BUILD_STATUS_ENV):
        return
    _horovod_modules.update(_module_of(item) for item in items if item.get_closest_marker("horovod"))
    items.sort(key=lambda item: _module_of(item) in _horovod_modules)


def _wait_for_build(path: Path, item: pytest.Item) -> str:
    """The build's exit status once it ended ('' if it did not within BUILD_WAIT_S), said once."""
    started = time.monotonic()
    while not path.exists() and time.monotonic() - started < BUILD_WAIT_S:
        time.sleep(2)
    status = path.read_text().strip() if path.exists() else ""
    said = (f"[make test] Horovod build {'exit ' + status if status else 'not ended'}; waited "
            f"{time.monotonic() - started:.0f} s for it before {_module_of(item)}")
    capture = item.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\n{said}", file=sys.stderr)
    return status


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # type: ignore[no-untyped-def]
    status_file = os.environ.get(BUILD_STATUS_ENV)
    if status_file and "status" not in _build and _module_of(item) in _horovod_modules:
        _build["status"] = _wait_for_build(Path(status_file), item)
    yield


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A `horovod` test where `make test` built Horovod (SPARKDL_REQUIRE_HOROVOD) fails when Horovod
    does not import, rather than skipping: a broken build must not pass as green."""
    if item.get_closest_marker("horovod") is None:
        return
    try:
        import horovod.torch  # noqa: F401
        return
    except ImportError as exc:
        problem = str(exc)
    if not os.environ.get("SPARKDL_REQUIRE_HOROVOD"):
        pytest.skip("Horovod is not installed: run `make horovod`")
    pytest.fail(f"Horovod is required here (SPARKDL_REQUIRE_HOROVOD) but does not import ({problem}); the build's "
                f"exit status: {_build.get('status', 'unknown')} (its log: .horovod-build.log under `make test`; "
                "or run `make horovod`)", pytrace=False)
