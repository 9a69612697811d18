"""The flat layout's module paths (sparkdl 0.1, before issue 41's move) keep importing with no warning,
as the very modules of the new layout; a model saved before the move loads and predicts as it did;
and nothing in the tree itself still uses an old path."""
from __future__ import annotations

import ast
import importlib
import json
import pickle
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from sparkdl.old_paths import MOVED, OLD_PACKAGES

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURE = REPO_ROOT / "tests" / "fixtures" / "saved_0_1"
OLD = frozenset(MOVED) | OLD_PACKAGES


def _file_of(module: str) -> Path:
    path = REPO_ROOT / Path(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def test_every_old_path_names_a_module_of_the_new_layout_and_no_file_of_its_own() -> None:
    for old, new in MOVED.items():
        assert _file_of(new).is_file(), f"{old} -> {new}: no such module"
        assert not _file_of(old).exists(), f"{old} is still a file: the alias would never be used"


@pytest.mark.parametrize("old", ["sparkdl.trained_model", "sparkdl.serving", "sparkdl.session", "sparkdl.checks",
                                 "sparkdl.launch.objectives", "sparkdl.launch.worker", "sparkdl.config_values",
                                 "sparkdl.resolved_plan", "sparkdl.launch.spec"])
def test_an_old_path_is_the_new_module_itself_with_no_warning(old: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module = importlib.import_module(old)
    new = importlib.import_module(MOVED[old])
    assert module is new
    assert module.__spec__.name == MOVED[old]  # the real spec is kept: reload, pickling by value, tools
    assert importlib.import_module("sparkdl.launch").__name__ == "sparkdl.launch"


def test_old_from_imports_of_the_public_api_work() -> None:
    code = ("import warnings; warnings.simplefilter('error')\n"
            "from sparkdl import fit, run, plan, predict, TorchEstimator, TorchModel, RunConfig, ResolvedPlan\n"
            "from sparkdl.config import RunConfig as R, TrainConfig, DataConfig, LaunchConfig, parse_bytes\n"
            "from sparkdl.resolved_plan import ResolvedPlan as P\n"
            "from sparkdl.launch.objectives import build_model\n"
            "from sparkdl.trained_model import module_from_files\n"
            "from sparkdl.serving import ServedModel\n"
            "import sparkdl.launch.wire as w\n"
            "assert R is RunConfig and P is ResolvedPlan and ServedModel.__module__ == 'sparkdl.tracking.serving'\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_class_pickled_under_its_old_path_loads() -> None:
    from sparkdl.model.layouts import HybridLayout

    data = pickle.dumps(HybridLayout, protocol=0).replace(b"sparkdl.model.layouts", b"sparkdl.layouts")
    assert b"sparkdl.layouts" in data and pickle.loads(data) is HybridLayout


def test_the_mlflow_pyfunc_saved_before_the_move_loads_and_predicts_as_it_did() -> None:
    mlflow = pytest.importorskip("mlflow")
    pd = pytest.importorskip("pandas")
    code = (FIXTURE / "mlflow_model" / "mlflow_pyfunc.py").read_text()
    assert "from sparkdl.trained_model import" in code  # the old path, as the saved copy holds it
    model = mlflow.pyfunc.load_model(str(FIXTURE / "mlflow_model"))
    rows = pd.read_json(FIXTURE / "rows.json", orient="records")
    predicted = model.predict(rows)
    expected = json.loads((FIXTURE / "expected.json").read_text())["predictions"]
    assert [int(v) for v in predicted["prediction"]] == expected


OLD_IMPORT = re.compile(r"\b(?:from|import)\s+(" + "|".join(re.escape(o) for o in sorted(OLD, key=len, reverse=True))
                        + r")\b(?!\.)")


def _old_imports_in(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    bad = []
    if path.suffix == ".py":
        for node in ast.walk(ast.parse(text)):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            bad += [f"{path.relative_to(REPO_ROOT)}:{node.lineno} {n}" for n in names if n in OLD]
    else:
        bad += [f"{path.relative_to(REPO_ROOT)}: {m.group(0)}" for m in OLD_IMPORT.finditer(text)]
    return bad


def test_nothing_in_the_tree_uses_an_old_path() -> None:
    roots = ["sparkdl", "tests", "examples", "benchmarks", "scripts", "notebooks", "docs", "conf"]
    files = [p for r in roots for p in (REPO_ROOT / r).rglob("*") if p.is_file()
             and p.suffix in (".py", ".md", ".ipynb", ".toml") and "fixtures" not in p.parts
             and p.name not in ("test_old_paths.py", "old_paths.py") and "__pycache__" not in p.parts]
    files += [REPO_ROOT / "README.md", REPO_ROOT / "Makefile"]
    bad = [b for f in files for b in _old_imports_in(f)]
    assert not bad, f"use the new paths (sparkdl/old_paths.py maps each old one): {bad}"
