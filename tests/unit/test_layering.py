"""The layering rules of DESIGN.md, checked on the source with `ast` (nothing is imported).

- config.py, config_values.py and errors.py import nothing from sparkdl (config.py may import
  sparkdl.errors and sparkdl.config_values, config_values.py only sparkdl.errors);
- planner/cost.py and planner/plan.py import only the standard library (and each other);
- worker-side modules (comm/*, strategies/*, data/batches.py, launch/worker.py,
  launch/rendezvous.py) never import pyspark.sql, directly or through other sparkdl modules;
- strategies/* import from sparkdl.comm only sparkdl.comm.base, never a backend;
- no module imports horovod or mlflow at module top level (`import sparkdl` works without them).

Imports under `if TYPE_CHECKING:` are never executed, so they count only for the first rule.
"""
from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = REPO_ROOT / "sparkdl"
STDLIB = frozenset(sys.stdlib_module_names) | {"__future__"}


@dataclass(frozen=True)
class Import:
    """One imported module (`from a import b` gives `a.b` when that is a sparkdl module, else `a`)."""

    target: str
    candidates: tuple[str, ...]  # every dotted name the statement may bind, for prefix rules
    lineno: int
    top_level: bool  # executed when the module is imported
    type_checking: bool  # inside `if TYPE_CHECKING:`


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sparkdl_module_exists(name: str) -> bool:
    rel = Path(*name.split("."))
    return (REPO_ROOT / rel).with_suffix(".py").is_file() or (REPO_ROOT / rel / "__init__.py").is_file()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_in_source(source: str, module: str, is_package: bool = False,
                      exists=sparkdl_module_exists) -> list[Import]:
    """Every import statement of `source`, resolved to absolute dotted names."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[Import] = []

    def resolve_from(node: ast.ImportFrom) -> str:
        if node.level == 0:
            return node.module or ""
        base = package.split(".")
        if node.level - 1 > 0:
            base = base[: -(node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def visit(node: ast.AST, top: bool, tc: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(alias.name, (alias.name,), node.lineno, top, tc))
            return
        if isinstance(node, ast.ImportFrom):
            base = resolve_from(node)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                is_module = base.split(".")[0] == "sparkdl" and exists(full)
                target = full if is_module else base
                found.append(Import(target, (base, full), node.lineno, top, tc))
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            top = False
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            visit(node.test, top, tc)
            for child in node.body:
                visit(child, False, True)
            for child in node.orelse:
                visit(child, top, tc)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, top, tc)

    visit(ast.parse(source), True, False)
    return found


def _sources() -> dict[str, tuple[Path, list[Import]]]:
    out: dict[str, tuple[Path, list[Import]]] = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        out[module_name(path)] = (path, imports_in_source(path.read_text(encoding="utf-8"), module_name(path),
                                                          path.name == "__init__.py"))
    return out


SOURCES = _sources()


def _modules(*patterns: str) -> list[str]:
    """Module names of the files matching glob patterns relative to sparkdl/ (packages' own
    __init__ included)."""
    names = {module_name(p) for pattern in patterns for p in PACKAGE_DIR.glob(pattern) if p.is_file()}
    return sorted(names)


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _where(module: str, imp: Import) -> str:
    path = SOURCES[module][0].relative_to(REPO_ROOT)
    return f"{path}:{imp.lineno} imports {imp.target}"


WORKER_SIDE = _modules("comm/*.py", "strategies/*.py", "data/batches.py", "launch/worker.py",
                       "launch/rendezvous.py")
STRATEGIES = _modules("strategies/*.py")
PURE_PLANNER = _modules("planner/cost.py", "planner/plan.py")


def test_every_module_parses() -> None:
    assert "sparkdl.config" in SOURCES and "sparkdl.errors" in SOURCES


def test_errors_imports_nothing_from_sparkdl() -> None:
    bad = [_where("sparkdl.errors", i) for i in SOURCES["sparkdl.errors"][1] if _under(i.target, "sparkdl")]
    assert not bad, bad


@pytest.mark.parametrize("module, allowed", [("sparkdl.config", {"sparkdl.errors", "sparkdl.config_values"}),
                                             ("sparkdl.config_values", {"sparkdl.errors"})])
def test_config_imports_only_errors_from_sparkdl(module: str, allowed: set[str]) -> None:
    bad = [_where(module, i) for i in SOURCES[module][1] if _under(i.target, "sparkdl") and i.target not in allowed]
    assert not bad, bad


@pytest.mark.parametrize("module", PURE_PLANNER or [pytest.param("-", marks=pytest.mark.skip("no planner yet"))])
def test_pure_planner_modules_import_only_stdlib(module: str) -> None:
    allowed_sparkdl = set(PURE_PLANNER)
    bad = []
    for imp in SOURCES[module][1]:
        if imp.type_checking:
            continue
        root = imp.target.split(".")[0]
        if root in STDLIB or imp.target in allowed_sparkdl:
            continue
        bad.append(_where(module, imp))
    assert not bad, f"{module} must stay stdlib-only (pure cost functions): {bad}"


def _pyspark_sql_path(module: str, seen: set[str]) -> list[str] | None:
    """The chain of sparkdl modules from `module` to one that imports pyspark.sql, if any."""
    if module in seen or module not in SOURCES:
        return None
    seen.add(module)
    for imp in SOURCES[module][1]:
        if imp.type_checking:
            continue
        if any(_under(c, "pyspark.sql") for c in imp.candidates):
            return [_where(module, imp)]
        if _under(imp.target, "sparkdl"):
            rest = _pyspark_sql_path(imp.target, seen)
            if rest is not None:
                return [_where(module, imp), *rest]
    return None


@pytest.mark.parametrize("module", WORKER_SIDE or [pytest.param("-", marks=pytest.mark.skip("no worker modules yet"))])
def test_worker_side_never_imports_pyspark_sql(module: str) -> None:
    chain = _pyspark_sql_path(module, set())
    assert chain is None, "worker-side code must not import pyspark.sql: " + " -> ".join(chain or [])


@pytest.mark.parametrize("module", STRATEGIES or [pytest.param("-", marks=pytest.mark.skip("no strategies yet"))])
def test_strategies_use_only_the_communicator_interface(module: str) -> None:
    bad = [_where(module, i) for i in SOURCES[module][1]
           if _under(i.target, "sparkdl.comm") and not _under(i.target, "sparkdl.comm.base")]
    assert not bad, f"strategies may import only sparkdl.comm.base, never a backend: {bad}"


def test_horovod_and_mlflow_are_imported_lazily() -> None:
    bad = [_where(module, i) for module, (_, imps) in SOURCES.items() for i in imps
           if i.top_level and not i.type_checking and i.target.split(".")[0] in ("horovod", "mlflow")]
    assert not bad, f"import horovod/mlflow inside the function that needs them: {bad}"


# --- the checker itself ---------------------------------------------------------------------

def _fake_exists(name: str) -> bool:
    return name in {"sparkdl.comm.base", "sparkdl.comm.torch_dist", "sparkdl.errors", "sparkdl.data.feed"}


def test_checker_resolves_relative_and_from_imports() -> None:
    source = "\n".join([
        "from ..comm.base import Communicator",
        "from ..comm import torch_dist",
        "from .. import errors",
        "from . import data_parallel",
        "import torch.nn as nn",
    ])
    imps = imports_in_source(source, "sparkdl.strategies.hybrid", exists=_fake_exists)
    assert [i.target for i in imps] == ["sparkdl.comm.base", "sparkdl.comm.torch_dist", "sparkdl.errors",
                                        "sparkdl.strategies", "torch.nn"]
    package_init = imports_in_source("from .base import Communicator", "sparkdl.comm", is_package=True,
                                     exists=_fake_exists)
    assert package_init[0].target == "sparkdl.comm.base"


def test_checker_tells_top_level_lazy_and_type_checking_imports_apart() -> None:
    source = "\n".join([
        "from typing import TYPE_CHECKING",
        "if TYPE_CHECKING:",
        "    from pyspark.sql import DataFrame",
        "try:",
        "    import mlflow",
        "except ImportError:",
        "    mlflow = None",
        "class Tracker:",
        "    import horovod.torch as hvd",
        "    def start(self):",
        "        from pyspark import sql",
        "        import mlflow.pytorch",
    ])
    imps = {(i.lineno, i.target): i for i in imports_in_source(source, "sparkdl.tracking")}
    assert imps[(3, "pyspark.sql")].type_checking and not imps[(3, "pyspark.sql")].top_level
    assert imps[(5, "mlflow")].top_level
    assert imps[(9, "horovod.torch")].top_level
    assert "pyspark.sql" in imps[(11, "pyspark")].candidates and not imps[(11, "pyspark")].top_level
    assert not imps[(12, "mlflow.pytorch")].top_level
