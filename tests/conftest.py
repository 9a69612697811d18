"""Shared, Spark-free test setup (Spark fixtures live in tests/spark/conftest.py).

Executors must run the same Python as the driver (DESIGN.md): set it before anything imports
pyspark, so `pytest` works the same whether or not it was started through `make test`.
"""
from __future__ import annotations

import os
import sys
import tempfile
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
