"""The layering rules of DESIGN.md, checked on the source with `ast` (nothing is imported).

- config.py, config/values.py, config/training.py and errors.py import nothing from sparkdl
  (config.py may import sparkdl.errors, sparkdl.config.values and sparkdl.config.training,
  config/training.py errors and config_values, config/values.py only sparkdl.errors);
- planner/cost.py and planner/plan.py import only the standard library (and each other);
- worker-side modules (comm/*, strategies/*, data/batches.py, executor/worker.py,
  executor/rendezvous.py) never import pyspark.sql, directly or through other sparkdl modules;
- strategies/* import from sparkdl.comm only sparkdl.comm.base, never a backend;
- no module imports horovod or mlflow at module top level (`import sparkdl` works without them);
- no import cycle inside sparkdl, lazy imports (inside functions) included; a package's __init__
  importing its own submodules, and a submodule importing its package, is not a cycle;
- composition happens in api, estimator, cli and planning: any other module imports a driver-side
  module (data/feed, driver/job, driver/attempts, driver/probe, tracking, planning, checks,
  scoring) only from its own subpackage, lazy imports included, save the deliberate edges of
  COMPOSITION_EXCEPTIONS (none today);
- planner/* never imports sparkdl.api, sparkdl.driver.job or pyspark at module top level
  (measurements reach the planner as data);
- no module imports another module's `_private` name (`from sparkdl.x import _helper`).

Imports under `if TYPE_CHECKING:` are never executed, so they count only for the first rule and
the private-name rule.
"""
from __future__ import annotations

import ast
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

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
    name: str = ""  # the imported name of `from a import name` ("" for `import a`)


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
                found.append(Import(target, (base, full), node.lineno, top, tc, alias.name))
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


WORKER_SIDE = _modules("comm/*.py", "strategies/*.py", "data/batches.py", "data/epochs.py", "model/layouts.py",
                       "data/stream.py", "data/streaming_spool.py", "data/parquet_shards.py",
                       "executor/worker.py", "executor/rendezvous.py", "executor/context.py", "executor/loop.py",
                       "wire/codec.py", "executor/checkpoint.py", "executor/memory.py")
STRATEGIES = _modules("strategies/*.py")
PURE_PLANNER = _modules("planner/cost.py", "planner/plan.py", "planner/overlap.py", "planner/steps_to_loss.py")


# Standard library only (imports under TYPE_CHECKING aside), with the few stdlib-only sparkdl modules
# each may use: they travel in the TrainSpec or a saved plan and must load without torch or Spark.
STDLIB_ONLY = {
    "sparkdl.model.layouts": set(),
    "sparkdl.data.epochs": {"sparkdl.config.values", "sparkdl.errors"},
    "sparkdl.data.layout": set(),
    "sparkdl.planner.cluster": set(),
    "sparkdl.planner.embeddings": {"sparkdl.embeddings.placement", "sparkdl.errors", "sparkdl.planner.cost"},
    "sparkdl.planner.resolved": {"sparkdl.config", "sparkdl.errors", "sparkdl.model.layouts", "sparkdl.planner.plan"},
}


@pytest.mark.parametrize("module", sorted(STDLIB_ONLY))
def test_stdlib_only_modules(module: str) -> None:
    bad = [_where(module, i) for i in SOURCES[module][1] if not i.type_checking
           and i.target.split(".")[0] not in STDLIB and i.target not in STDLIB_ONLY[module]]
    assert not bad, f"{module} must stay standard-library only: {bad}"


def test_every_module_parses() -> None:
    assert "sparkdl.config" in SOURCES and "sparkdl.errors" in SOURCES


def test_errors_imports_nothing_from_sparkdl() -> None:
    bad = [_where("sparkdl.errors", i) for i in SOURCES["sparkdl.errors"][1] if _under(i.target, "sparkdl")]
    assert not bad, bad


@pytest.mark.parametrize("module", _modules("config/*.py"))
def test_config_imports_only_errors_from_sparkdl(module: str) -> None:
    bad = [_where(module, i) for i in SOURCES[module][1] if _under(i.target, "sparkdl")
           and not _under(i.target, "sparkdl.config") and i.target != "sparkdl.errors"]
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


# Loaded only by MLflow, as the code of a logged model ("models from code"); nothing in sparkdl imports it.
MLFLOW_CODE_MODULES = frozenset({"sparkdl.tracking.pyfunc"})


def test_horovod_and_mlflow_are_imported_lazily() -> None:
    bad = [_where(module, i) for module, (_, imps) in SOURCES.items() for i in imps
           if i.top_level and not i.type_checking and i.target.split(".")[0] in ("horovod", "mlflow")
           and module not in MLFLOW_CODE_MODULES]
    assert not any(_under(i.target, m) for _, (_, imps) in SOURCES.items() for i in imps for m in MLFLOW_CODE_MODULES), \
        "sparkdl.tracking.pyfunc is MLflow's to load, never imported by sparkdl"
    assert not bad, f"import horovod/mlflow inside the function that needs them: {bad}"


# --- no import cycles -----------------------------------------------------------------------

PACKAGES = frozenset(m for m, (path, _) in SOURCES.items() if path.name == "__init__.py")


def _known_module(name: str, known: Iterable[str]) -> str | None:
    """`name`, or its longest dotted prefix that is one of the `known` modules."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph(modules: Mapping[str, list[Import]], packages: Iterable[str]) -> dict[str, dict[str, Import]]:
    """sparkdl module -> {sparkdl module it imports: the first statement that makes that edge}.

    Lazy imports count, imports under TYPE_CHECKING do not (never executed). An edge to a package
    is an edge to its __init__ only, and a package's __init__ importing its own descendants makes
    no edge: that `strategies/__init__` imports `strategies.base` while `strategies/ist.py` does
    `from sparkdl.strategies import strategy_class` is the normal package pattern, not a cycle."""
    packages = frozenset(packages)
    graph: dict[str, dict[str, Import]] = {m: {} for m in modules}
    for module, imps in modules.items():
        for imp in imps:
            if imp.type_checking:
                continue
            target = _known_module(imp.target, graph)
            if target is None or target == module:
                continue
            if module in packages and _under(target, module):
                continue
            graph[module].setdefault(target, imp)
    return graph


def strongly_connected_components(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Tarjan's algorithm; each component sorted, in a deterministic order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return components


def _cycle_through(component: list[str], graph: Mapping[str, Iterable[str]]) -> list[str]:
    """A shortest cycle through the component's first module, as [a, b, ..., a]."""
    start, members = component[0], set(component)
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph.get(v, ())):
            if w == start and v != start:
                path = [v]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if w in members and w != start and w not in parent:
                parent[w] = v
                queue.append(w)
    raise AssertionError(f"not a cycle: {component}")  # pragma: no cover - Tarjan guarantees one


def import_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (self-loops ignored)."""
    return [_cycle_through(c, graph) for c in strongly_connected_components(graph) if len(c) > 1]


def test_no_import_cycles() -> None:
    graph = import_graph({m: imps for m, (_, imps) in SOURCES.items()}, PACKAGES)
    bad = []
    for component in strongly_connected_components(graph):
        if len(component) < 2:
            continue
        cycle = _cycle_through(component, graph)
        edges = "; ".join(_where(a, graph[a][b]) for a, b in zip(cycle, cycle[1:]))
        others = sorted(set(component) - set(cycle))
        also = f" [same component: {', '.join(others)}]" if others else ""
        bad.append(f"{' -> '.join(cycle)} ({edges}){also}")
    assert not bad, ("import cycles inside sparkdl (lazy imports count; move the shared code down a "
                     "layer or pass it in): " + " | ".join(bad))


# --- composition only in api, estimator, cli and planning ------------------------------------

DRIVER_SIDE = sorted(m for m in {"sparkdl.data.feed", "sparkdl.driver.job", "sparkdl.driver.attempts",
                                 "sparkdl.driver.probe", "sparkdl.tracking.mlflow_run", "sparkdl.driver.planning",
                                 "sparkdl.driver.checks", "sparkdl.scoring"} if sparkdl_module_exists(m))
COMPOSERS = frozenset({"sparkdl.api", "sparkdl.fit_stages", "sparkdl.estimator", "sparkdl.estimator_params",
                       "sparkdl.estimator_io", "sparkdl.cli", "sparkdl.driver.planning", "sparkdl.driver.calibration",
                       "sparkdl.__main__", "sparkdl", "sparkdl.compat.launcher"})
# Deliberate driver-side edges outside COMPOSERS, importer -> imported modules, each with its reason.
# Keep it minimal: an edge that is not a design decision is fixed in the code, not listed here.
# Deliberate edges that break the rule, each with its reason (none today: the probe job and custom
# loops run untracked through driver.attempts.Untracked instead of a disabled tracking.RunTracker).
COMPOSITION_EXCEPTIONS: dict[str, set[str]] = {}


def _subpackage(module: str) -> str:
    """The package a module belongs to: a package's __init__ belongs to the package itself."""
    return module if module in PACKAGES else module.rpartition(".")[0]


def test_only_composers_compose_driver_side_modules() -> None:
    bad = []
    for module, (_, imps) in SOURCES.items():
        if module in COMPOSERS:
            continue
        for imp in imps:
            if imp.type_checking:
                continue
            driver = next((d for d in DRIVER_SIDE if _under(imp.target, d)), None)
            if driver is None or _under(module, driver):
                continue
            if _subpackage(module) == driver.rpartition(".")[0]:
                continue
            if driver in COMPOSITION_EXCEPTIONS.get(module, set()):
                continue
            if _where(module, imp) not in bad:  # `from sparkdl.data.feed import a, b` is one edge
                bad.append(_where(module, imp))
    assert not bad, (f"only {', '.join(sorted(COMPOSERS))} compose driver-side modules "
                     f"({', '.join(DRIVER_SIDE)}) across subpackages (lazy imports count): {bad}")


PLANNER = _modules("planner/*.py")
NOT_AT_PLANNER_TOP_LEVEL = ("sparkdl.api", "sparkdl.driver.job", "pyspark")


@pytest.mark.parametrize("module", PLANNER or [pytest.param("-", marks=pytest.mark.skip("no planner yet"))])
def test_planner_imports_no_launcher_or_pyspark_at_top_level(module: str) -> None:
    bad = [_where(module, i) for i in SOURCES[module][1]
           if i.top_level and not i.type_checking
           and any(_under(name, f) for name in (i.target, *i.candidates) for f in NOT_AT_PLANNER_TOP_LEVEL)]
    assert not bad, (f"the planner never launches jobs (measurements reach it as data); "
                     f"{module} must not import {', '.join(NOT_AT_PLANNER_TOP_LEVEL)} at top level: {bad}")


# --- no private names across modules --------------------------------------------------------

def private_name_imports(module: str, imps: Iterable[Import], exists=sparkdl_module_exists) -> list[Import]:
    """The `from X import _name` of `module` where X is another sparkdl module (dunders are public).

    A private submodule imported from inside its own package (`from sparkdl.comm import _impl` in
    sparkdl/comm/x.py) is package-internal and allowed."""
    bad = []
    for imp in imps:
        if not imp.name.startswith("_") or imp.name.startswith("__"):
            continue
        source = imp.candidates[0]
        if not _under(source, "sparkdl") or source == module:
            continue
        if _under(module, source) and exists(f"{source}.{imp.name}"):
            continue
        bad.append(imp)
    return bad


def test_no_module_imports_another_modules_private_names() -> None:
    by_line: dict[tuple[Path, int, str], list[str]] = {}
    for module, (path, imps) in SOURCES.items():
        for imp in private_name_imports(module, imps):
            by_line.setdefault((path.relative_to(REPO_ROOT), imp.lineno, imp.candidates[0]), []).append(imp.name)
    bad = [f"{path}:{line} imports {', '.join(names)} from {source}" for (path, line, source), names in by_line.items()]
    assert not bad, f"make the name public (drop the underscore) or move it where it is used: {bad}"


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
    imps = {(i.lineno, i.target): i for i in imports_in_source(source, "sparkdl.tracking.mlflow_run")}
    assert imps[(3, "pyspark.sql")].type_checking and not imps[(3, "pyspark.sql")].top_level
    assert imps[(5, "mlflow")].top_level
    assert imps[(9, "horovod.torch")].top_level
    assert "pyspark.sql" in imps[(11, "pyspark")].candidates and not imps[(11, "pyspark")].top_level
    assert not imps[(12, "mlflow.pytorch")].top_level


def _graph_of(sources: dict[str, str], exists) -> dict[str, dict[str, Import]]:
    """The import graph of synthetic modules (a name ending in `/` is a package's __init__)."""
    modules = {m.rstrip("/"): imports_in_source(src, m.rstrip("/"), m.endswith("/"), exists=exists)
               for m, src in sources.items()}
    return import_graph(modules, {m.rstrip("/") for m in sources if m.endswith("/")})


def test_checker_finds_cycles_and_ignores_self_loops() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "c"}, "d": {"a", "d"}, "e": {"f"}, "f": set()}
    assert import_cycles(graph) == [["a", "b", "c", "a"]]
    assert import_cycles({"a": {"b", "c"}, "b": {"a"}, "c": {"b"}}) == [["a", "b", "a"]]  # one per component
    assert import_cycles({"x": {"x"}}) == []


def test_checker_does_not_report_the_package_init_pattern() -> None:
    names = {"sparkdl", "sparkdl.api", "sparkdl.strategies", "sparkdl.strategies.base", "sparkdl.strategies.ist"}
    graph = _graph_of({
        "sparkdl/": "from sparkdl.config import RunConfig\ndef run():\n    from sparkdl import api",
        "sparkdl.api": "import sparkdl\nfrom sparkdl import __version__",
        "sparkdl.strategies/": "from sparkdl.strategies.base import Strategy\nfrom . import ist",
        "sparkdl.strategies.base": "from sparkdl.strategies import strategy_class",
        "sparkdl.strategies.ist": "from sparkdl.strategies import strategy_class\nfrom .base import Strategy",
    }, names.__contains__)
    assert set(graph["sparkdl.strategies.ist"]) == {"sparkdl.strategies", "sparkdl.strategies.base"}
    assert set(graph["sparkdl.api"]) == {"sparkdl"}
    assert graph["sparkdl"] == {} and graph["sparkdl.strategies"] == {}
    assert import_cycles(graph) == []


def test_checker_ignores_type_checking_edges_but_counts_lazy_ones() -> None:
    names = {"sparkdl.executor.loop", "sparkdl.executor.worker"}
    worker = "def run(ctx):\n    from sparkdl.executor.loop import train\n    return train(ctx)"
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from sparkdl.executor.worker import WorkerContext"
    lazy = "def train(ctx):\n    from sparkdl.executor.worker import WorkerContext"
    assert import_cycles(_graph_of({"sparkdl.executor.loop": typed, "sparkdl.executor.worker": worker},
                                   names.__contains__)) == []
    assert import_cycles(_graph_of({"sparkdl.executor.loop": lazy, "sparkdl.executor.worker": worker},
                                   names.__contains__)) == [["sparkdl.executor.loop", "sparkdl.executor.worker",
                                                             "sparkdl.executor.loop"]]


def test_checker_finds_private_name_imports() -> None:
    names = {"sparkdl.comm", "sparkdl.comm.base", "sparkdl.comm._impl", "sparkdl.config.values"}
    source = "\n".join([
        "from sparkdl.config.values import _check_types, parse_bytes",
        "from .base import _helper, Communicator",
        "from . import _impl",
        "from sparkdl import __version__",
        "from mlflow.tracking.fluent import _get_experiment_id",
        "from sparkdl.comm.torch_dist import _own_helper",
        "if TYPE_CHECKING:",
        "    from sparkdl.comm.base import _Proto",
        "def f():",
        "    from sparkdl.executor.worker import _dumps_any",
    ])
    imps = imports_in_source(source, "sparkdl.comm.torch_dist", exists=names.__contains__)
    found = [(i.lineno, i.name) for i in private_name_imports("sparkdl.comm.torch_dist", imps, names.__contains__)]
    assert found == [(1, "_check_types"), (2, "_helper"), (8, "_Proto"), (10, "_dumps_any")]
    init = imports_in_source("from ._impl import _private", "sparkdl.comm", is_package=True, exists=names.__contains__)
    assert [i.name for i in private_name_imports("sparkdl.comm", init, names.__contains__)] == ["_private"]


# --- the package table of docs/architecture.md ----------------------------------------------

ARCHITECTURE = REPO_ROOT / "docs" / "architecture.md"
ENTRY_MODULES = frozenset({"sparkdl", "sparkdl.api", "sparkdl.fit_stages", "sparkdl.estimator", "sparkdl.estimator_params",
                           "sparkdl.estimator_io", "sparkdl.cli", "sparkdl.submit",
                           "sparkdl.__main__"})
EVERY = "every package"


def package_of(module: str) -> str:
    """The table's row a module belongs to: `entry` for the public surface, else its top package."""
    return "entry" if module in ENTRY_MODULES else module.split(".")[1]


def _marked_rows(text: str, marker: str) -> list[list[str]]:
    start, end = f"<!-- {marker}", f"<!-- /{marker} -->"
    if start not in text or end not in text:
        raise AssertionError(f"docs/architecture.md lost its {marker} markers")
    body = text[text.index(start):text.index(end)]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in body.splitlines() if line.startswith("|")]
    return [r for r in rows[2:]]  # past the header and its --- line


def layering_table(text: str) -> dict[str, frozenset[str] | None]:
    """package -> the packages it may import (None: every package), from the doc's table."""
    table: dict[str, frozenset[str] | None] = {}
    for package, _runs_in, may in _marked_rows(text, "layering-table"):
        name = package.split("`")[1]
        if may == EVERY:
            table[name] = None
        elif may.startswith("(nothing"):
            table[name] = frozenset()
        else:
            table[name] = frozenset(p.strip() for p in may.split(","))
    return table


def layering_exceptions(text: str) -> frozenset[tuple[str, str]]:
    return frozenset((a.strip("`"), b.strip("`")) for a, b, _why in _marked_rows(text, "layering-exceptions"))


def leaf_modules(sources: Mapping[str, tuple[Path, list[Import]]]) -> frozenset[str]:
    """Modules that import nothing but the standard library (lazy imports included): anyone may use them."""
    return frozenset(m for m, (_, imps) in sources.items()
                     if all(i.type_checking or i.target.split(".")[0] in STDLIB for i in imps))


def layering_violations(sources: Mapping[str, tuple[Path, list[Import]]], table: Mapping[str, frozenset[str] | None],
                        exceptions: frozenset[tuple[str, str]]) -> list[str]:
    leaves = leaf_modules(sources)
    bad: list[str] = []
    for module, (path, imps) in sorted(sources.items()):
        source = package_of(module)
        if source not in table:
            bad.append(f"{path.relative_to(REPO_ROOT)}: package {source!r} has no row in the table")
            continue
        allowed = table[source]
        for imp in imps:
            if imp.type_checking or not _under(imp.target, "sparkdl"):
                continue
            target = _known_module(imp.target, sources) or imp.target
            if target == "sparkdl":  # the root package, for __version__
                continue
            dest = package_of(target)
            if dest == source or allowed is None or dest in allowed or target in leaves \
                    or (module, target) in exceptions:
                continue
            where = f"{path.relative_to(REPO_ROOT)}:{imp.lineno} ({source}) imports {target} ({dest})"
            if where not in bad:
                bad.append(where)
    return bad


TABLE_TEXT = ARCHITECTURE.read_text(encoding="utf-8")


def test_every_import_follows_the_architecture_table() -> None:
    bad = layering_violations(SOURCES, layering_table(TABLE_TEXT), layering_exceptions(TABLE_TEXT))
    assert not bad, ("imports against the table in docs/architecture.md (\"Layering\"): move the code to the "
                     "package that may use it, or change the table with a reason: " + " | ".join(bad))


def test_the_table_names_every_package_and_only_those() -> None:
    packages = {package_of(m) for m in SOURCES}
    assert set(layering_table(TABLE_TEXT)) == packages
    for importer, imported in layering_exceptions(TABLE_TEXT):
        assert importer in SOURCES and imported in SOURCES, (importer, imported)


def test_every_package_says_what_it_owns_and_may_import() -> None:
    for init in sorted(PACKAGE_DIR.rglob("__init__.py")):
        if "__pycache__" in init.parts:
            continue
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        assert len(doc) > 80, f"{init.relative_to(REPO_ROOT)} needs a docstring: what it owns, what it may import"
        if init.parent != PACKAGE_DIR and init.parent.name != "datasets":
            assert "import" in doc.lower(), f"{init.relative_to(REPO_ROOT)}: say what the package may import"


def _planted(module: str, source: str) -> dict[str, tuple[Path, list[Import]]]:
    """SOURCES with `source` appended to `module`'s own file."""
    path, _ = SOURCES[module]
    text = path.read_text(encoding="utf-8") + "\n" + source + "\n"
    return {**SOURCES, module: (path, imports_in_source(text, module, path.name == "__init__.py"))}


@pytest.mark.parametrize("module, planted, expected", [
    ("sparkdl.model.losses", "from sparkdl.driver.job import submit", "sparkdl.driver.job (driver)"),
    ("sparkdl.executor.loop", "def f():\n    from sparkdl.driver.attempts import tracked_submit",
     "sparkdl.driver.attempts (driver)"),
    ("sparkdl.comm.base", "import sparkdl.strategies.base", "sparkdl.strategies.base (strategies)"),
    ("sparkdl.config.values", "from sparkdl.spark import session", "sparkdl.spark.session (spark)"),
])
def test_the_table_check_finds_a_planted_wrong_import(module: str, planted: str, expected: str) -> None:
    table, exceptions = layering_table(TABLE_TEXT), layering_exceptions(TABLE_TEXT)
    assert not any(expected in b for b in layering_violations(SOURCES, table, exceptions))
    bad = layering_violations(_planted(module, planted), table, exceptions)
    assert any(expected in b for b in bad), bad


def test_a_leaf_that_grows_an_import_stops_being_a_leaf() -> None:
    table, exceptions = layering_table(TABLE_TEXT), layering_exceptions(TABLE_TEXT)
    assert "sparkdl.tracking.phases" in leaf_modules(SOURCES)
    bad = layering_violations(_planted("sparkdl.tracking.phases", "import torch"), table, exceptions)
    assert any("imports sparkdl.tracking.phases (tracking)" in b and "sparkdl/data/" in b for b in bad), bad


def test_the_table_parser_reads_rows_and_the_every_package_row() -> None:
    text = ("<!-- layering-table -->\n| package | runs in | may import |\n|---|---|---|\n"
            "| `a` | both | (nothing) |\n| `b` | driver | a, c |\n| `entry` (x) | driver | every package |\n"
            "<!-- /layering-table -->")
    assert layering_table(text) == {"a": frozenset(), "b": frozenset({"a", "c"}), "entry": None}


# --- the whole RunConfig stops at the entry points -------------------------------------------

def run_config_takers(source: str) -> list[str]:
    """The functions whose parameters, and the classes whose fields, are typed RunConfig, and the
    functions with a parameter named `config` (a RunConfig passed untyped, as `config: Any`)."""
    def is_run_config(annotation: ast.expr | None) -> bool:
        if annotation is None:
            return False
        text = annotation.value if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str) \
            else ast.unparse(annotation)
        return "RunConfig" in text

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            if any(is_run_config(a.annotation) or a.arg == "config" for a in args):
                found.append(f"{node.name}()")
        elif isinstance(node, ast.ClassDef):
            if any(isinstance(s, ast.AnnAssign) and is_run_config(s.annotation) for s in node.body):
                found.append(node.name)
    return found


# Below the entry points, modules that still take the whole RunConfig (the list may only shrink; it is
# empty since the planning stage works on sections and the TrainSpec carries the four a rank reads).
STILL_TAKE_RUN_CONFIG: frozenset[str] = frozenset()
TAKE_SECTIONS = ("sparkdl.data", "sparkdl.tracking", "sparkdl.model", "sparkdl.storage", "sparkdl.strategies",
                 "sparkdl.comm", "sparkdl.spark")


def test_below_the_entry_points_only_the_listed_modules_take_a_whole_run_config() -> None:
    takers = {m: run_config_takers(path.read_text(encoding="utf-8")) for m, (path, _) in SOURCES.items()
              if package_of(m) not in ("entry", "config")}
    takers = {m: t for m, t in takers.items() if t}
    new = {m: t for m, t in takers.items() if m not in STILL_TAKE_RUN_CONFIG}
    assert not new, f"pass the config sections a function needs, not the whole RunConfig: {new}"
    done = STILL_TAKE_RUN_CONFIG - set(takers)
    assert not done, f"these take sections now: drop them from STILL_TAKE_RUN_CONFIG: {sorted(done)}"
    assert not any(_under(m, p) for m in takers for p in TAKE_SECTIONS)


def test_the_run_config_check_sees_parameters_fields_and_string_annotations() -> None:
    source = ("def a(config: RunConfig) -> None: ...\ndef b(cfg: 'RunConfig | None' = None) -> None: ...\n"
              "def c(data: DataConfig) -> None: ...\nclass S:\n    config: RunConfig\n"
              "def d(spark, config: Any) -> None: ...\n")
    assert run_config_takers(source) == ["a()", "b()", "S", "d()"]
