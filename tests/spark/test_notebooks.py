"""Every notebook in notebooks/ runs top to bottom with nbclient on tiny settings
(SPARKDL_NOTEBOOK_SMALL=1); a cell error fails the test. They share one kernel, run one after the
other as a user runs several notebooks on one cluster: the first starts the local[2] session the
others' getOrCreate() reuse (a kernel each cost 10-20 s of Python, torch and JVM start apiece)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


def test_the_notebooks_exist() -> None:
    assert {p.name for p in NOTEBOOKS} >= {"quickstart.ipynb", "planner.ipynb", "hybrid.ipynb", "ist.ipynb",
                                           "diloco.ipynb", "cnn_images.ipynb", "language_model.ipynb",
                                           "recommender.ipynb", "transformers.ipynb"}


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


@pytest.fixture(scope="module")
def kernel(calibration_cache: Path, mlflow_store: str) -> Iterator[Any]:
    """One python3 kernel for every notebook, started with the notebooks' environment."""
    from jupyter_client.manager import KernelManager

    env = {**os.environ, "SPARKDL_NOTEBOOK_SMALL": "1", "MPLBACKEND": "Agg",
           "SPARKDL_CACHE_DIR": str(calibration_cache), "MLFLOW_TRACKING_URI": mlflow_store}
    manager = KernelManager(kernel_name="python3")
    manager.start_kernel(env=env)
    try:
        yield manager
    finally:
        manager.shutdown_kernel(now=True)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, tmp_path: Path, kernel: Any) -> None:
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    # Each notebook works in a directory of its own, as it would opened from there.
    notebook.cells.insert(0, nbformat.v4.new_code_cell(f"import os; os.chdir({str(tmp_path)!r})"))
    client = NotebookClient(notebook, timeout=600, km=kernel)
    client.execute()  # raises CellExecutionError naming the cell on the first error
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
