"""Whether this Python could import a module, found without running any of its code.

Run on the executors (spark/session.py asks them with one small job) to decide what the driver
ships by value (driver/shipping.py): a module an executor can import travels by reference. Nothing
is imported here: a package's __init__ may be slow (transformers), have side effects, or fail,
and a name alone is not enough either, since an unrelated module of the same name (a stray `utils`
or `tests` package in site-packages) would take the place of the driver's helper file. So the
module is located the way the import system would, and its source must define the names the
pickles will look up in it.
"""
from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import os
import sys
from typing import Any, Iterable

ModuleQuestion = tuple[str, tuple[str, ...]]  # (dotted module name, top-level names looked up in it)


def importable(questions: Iterable[ModuleQuestion]) -> list[str]:
    """The module names of `questions` this interpreter can import with every named attribute."""
    return [name for name, needed in questions if defines(locate(name), needed)]


def locate(name: str) -> Any:
    """The module spec of `name` (None when not found), found level by level without executing
    any package on the way: the top level through importlib.util.find_spec (which only locates),
    each submodule through the import system's finders on its parent's search locations."""
    parts = name.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):  # ValueError: a module in sys.modules without a __spec__
        return None
    for depth in range(1, len(parts)):
        if spec is None or spec.submodule_search_locations is None:
            return None  # a plain module has no submodules
        spec = _find_child(".".join(parts[: depth + 1]), list(spec.submodule_search_locations))
    return spec


def _find_child(child: str, locations: list[str]) -> Any:
    loaded = sys.modules.get(child)
    if loaded is not None and getattr(loaded, "__spec__", None) is not None:
        return loaded.__spec__
    # Legacy namespace packages (pkgutil.extend_path) span the same relative folder of every
    # sys.path entry, which their __init__ would add to __path__ when run.
    relative = os.path.join(*child.split(".")[:-1])
    spread = locations + [p for p in (os.path.join(e, relative) for e in sys.path if e) if p not in locations
                          and os.path.isdir(p)]
    for finder in sys.meta_path:  # what importlib does for a submodule, minus the parent's import
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec = find(child, spread, None)
        except Exception:  # noqa: BLE001 - a third-party finder may fail on a path it does not own
            continue
        if spec is not None:
            return spec
    return None


def defines(spec: Any, needed: Iterable[str]) -> bool:
    """Whether the module of `spec` binds every name of `needed` at its top level, read from its
    source (a compiled or extension module, or source that computes its names, counts as yes)."""
    if spec is None:
        return False
    needed = set(needed)
    origin = getattr(spec, "origin", None)
    if not needed or not isinstance(origin, str) or not origin.endswith(".py") or not os.path.isfile(origin):
        return True
    try:
        with open(origin, "rb") as source:
            tree = ast.parse(source.read(), origin)
    except (OSError, SyntaxError, ValueError):
        return True  # the import itself will say what is wrong with it, not a by-value copy
    bound = top_level_names(tree)
    return bound is None or needed <= bound


def top_level_names(tree: ast.Module) -> set[str] | None:
    """Names bound at a module's top level (inside if/try/with/for blocks too, not inside functions
    or classes); None when the module may bind any name (`from x import *`, a module __getattr__,
    writes to globals() or sys.modules)."""
    bound: set[str] = set()
    pending: list[ast.AST] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
            if node.name == "__getattr__":
                return None
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                bound.add(alias.asname or alias.name.split(".")[0])
            continue
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("globals", "vars"):
            return None
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and _is_sys_modules(node.value):
            return None  # sys.modules[__name__] = a lazy module object
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            if node.id == "__getattr__":
                return None
            bound.add(node.id)
        pending.extend(ast.iter_child_nodes(node))
    return bound


def _is_sys_modules(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "modules" and isinstance(node.value, ast.Name) \
        and node.value.id == "sys"
