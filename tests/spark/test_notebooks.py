"""Every notebook in notebooks/ runs top to bottom with nbclient on tiny settings
(SPARKDL_NOTEBOOK_SMALL=1); a cell error fails the test. Each kernel starts its own local[2]
session, as a notebook outside Databricks would."""
from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


def test_the_notebooks_exist() -> None:
    assert {p.name for p in NOTEBOOKS} >= {"quickstart.ipynb", "planner.ipynb", "hybrid.ipynb", "ist.ipynb",
                                           "diloco.ipynb", "cnn_images.ipynb", "language_model.ipynb"}


@pytest.fixture(scope="module")
def calibration_cache(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    """One planner calibration cache for every kernel: all run the same local[2] session, so the
    first notebook's measurement serves the others (each would otherwise run the probe job again)."""
    return tmp_path_factory.mktemp("notebook-calibration")


@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory) -> str:  # type: ignore[no-untyped-def]
    """One sqlite MLflow store for every kernel: creating one runs MLflow's schema migrations (seconds),
    and the notebooks' runs do not interfere (each has its own experiment or run ids)."""
    return f"sqlite:///{tmp_path_factory.mktemp('notebook-mlflow')}/mlflow.db"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, calibration_cache: Path,
                       mlflow_store: str) -> None:
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("SPARKDL_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("SPARKDL_CACHE_DIR", str(calibration_cache))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_store)
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError naming the cell on the first error
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
