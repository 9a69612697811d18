"""What travels by value (driver/shipping.py) and how an executor tells it can import a module
(spark/importable.py): by reference an installed library the executors import, wherever the driver
found it; by value what they cannot import and the user's own files; by path only where no executor
can be asked. Real modules in temporary folders (one a real `pip install --target`), located
without running them."""
from __future__ import annotations

import ast
import importlib
import sys
import textwrap
from pathlib import Path
from typing import Iterator

import pytest
import torch
from torch import nn

from sparkdl.driver.shipping import is_library, modules_to_decide, travels_by_value
from sparkdl.spark.importable import importable, locate, top_level_names

from shipping_libs import pip_install_target

BLOCKS = """
import torch
from torch import nn


class Block(nn.Module):
    registry = torch.classes  # a library global cloudpickle cannot copy by value

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        return self.fc(x)


def make():
    return Block()
"""


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


@pytest.fixture
def on_path(tmp_path: Path) -> Iterator[Path]:
    """tmp_path on sys.path (as a `pip install --target` folder on PYTHONPATH), cleaned up after."""
    sys.path.insert(0, str(tmp_path))
    before = set(sys.modules)
    importlib.invalidate_caches()
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        for name in set(sys.modules) - before:
            del sys.modules[name]


def test_an_installed_library_outside_site_packages_travels_by_reference_when_the_executors_import_it(
        tmp_path: Path) -> None:
    target = pip_install_target(tmp_path, "targetlib_a", unpicklable=True)  # a real `pip install --target`
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    try:
        blocks = importlib.import_module("targetlib_a.layers")
        model = nn.Sequential(blocks.Block(), nn.ReLU())
        asked = modules_to_decide(model)
        assert asked == {"targetlib_a.layers": {"Block"}}  # torch's own modules are never asked about
        assert is_library(blocks) and is_library(sys.modules["targetlib_a"])  # its dist-info claims it
        assert travels_by_value(blocks, None)  # by path (no session): outside site-packages, so by value
        assert not travels_by_value(blocks, frozenset({"targetlib_a.layers"}))  # the executors import it
        assert travels_by_value(blocks, frozenset({"something.else"}))  # they cannot: by value
    finally:
        sys.path.remove(str(target))
        for name in [m for m in sys.modules if m.split(".")[0] == "targetlib_a"]:
            del sys.modules[name]


def test_the_users_own_files_travel_by_value_even_where_the_executors_import_them(on_path: Path) -> None:
    # Python workers keep the module they imported first: a helper edited between fits must travel.
    write(on_path, {"helper_own/__init__.py": "", "helper_own/net.py": BLOCKS})
    net = importlib.import_module("helper_own.net")
    assert not is_library(net)
    assert travels_by_value(net, frozenset({"helper_own.net"}))
    # sparkdl, torch and the standard library are never shipped, whatever the answer
    assert is_library(torch.nn.modules.linear) and is_library(ast)
    assert not travels_by_value(torch.nn.modules.linear, frozenset())
    assert not travels_by_value(ast, frozenset())


def test_a_function_and_the_modules_it_names_are_decided_with_the_names_looked_up(on_path: Path) -> None:
    write(on_path, {"helper_b.py": BLOCKS})
    helper = importlib.import_module("helper_b")
    namespace = {"helper_b": helper, "__name__": "__main__"}
    exec("def factory():\n    return helper_b.make()\n", namespace)  # a notebook's cell
    assert modules_to_decide(namespace["factory"]) == {"helper_b": set()}  # the module itself, by name
    # a function by reference is looked up by its name, and so is the class its code names
    assert modules_to_decide(helper.make) == {"helper_b": {"make", "Block"}}


def test_located_without_running_the_package(on_path: Path) -> None:
    write(on_path, {"boom_c/__init__.py": "raise RuntimeError('never run')\n",
                    "boom_c/inner/__init__.py": "raise RuntimeError('never run')\n",
                    "boom_c/inner/layers.py": BLOCKS})
    assert importable([("boom_c.inner.layers", ("Block",))]) == ["boom_c.inner.layers"]
    assert "boom_c" not in sys.modules
    assert importable([("boom_c.inner.missing", ())]) == []
    assert importable([("boom_c.inner.layers.deeper", ())]) == []  # a plain module has no submodules
    assert locate("no_such_top_level_module_c") is None


def test_a_same_named_module_without_the_class_is_not_the_drivers_module(on_path: Path) -> None:
    # The driver's helper `utils_d.py` defines Net; an unrelated `utils_d` the executors have does not.
    write(on_path, {"utils_d.py": "def unrelated():\n    pass\n"})
    assert importable([("utils_d", ("Net",))]) == []
    assert importable([("utils_d", ("unrelated",))]) == ["utils_d"]
    assert importable([("utils_d", ())]) == ["utils_d"]


def test_legacy_namespace_packages_span_every_path_entry(on_path: Path, tmp_path_factory) -> None:  # type: ignore[no-untyped-def]
    other = tmp_path_factory.mktemp("second-entry")
    init = "__path__ = __import__('pkgutil').extend_path(__path__, __name__)\n"
    write(on_path, {"ns_e/__init__.py": init, "ns_e/one.py": "A = 1\n"})
    write(other, {"ns_e/__init__.py": init, "ns_e/two.py": "B = 2\n"})
    sys.path.append(str(other))
    try:
        assert importable([("ns_e.one", ("A",)), ("ns_e.two", ("B",))]) == ["ns_e.one", "ns_e.two"]
    finally:
        sys.path.remove(str(other))


@pytest.mark.parametrize("source, names", [
    ("class A: pass\ndef f(): x = 1\nif True:\n    B = 2\ntry:\n    import c.d as e\nexcept ImportError:\n"
     "    from g import h\nfor i in range(2): pass\n", {"A", "f", "B", "e", "h", "i"}),
    ("from os import *\n", None),
    ("def __getattr__(name): ...\n", None),
    ("import sys\nsys.modules[__name__] = object()\n", None),
    ("globals()['A'] = 1\n", None),
])
def test_top_level_names(source: str, names: set[str] | None) -> None:
    assert top_level_names(ast.parse(source)) == names
