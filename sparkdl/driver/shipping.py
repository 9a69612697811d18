"""Make user code reach the executors: what the executors cannot import (a notebook's helper file,
a test module, a library only the driver has) is pickled by value; an installed library they can
import travels by reference, wherever the driver found it (site-packages, a `pip install --target`
folder on PYTHONPATH), since a library pickled by value drags along module-level objects that
cannot be pickled (torch.classes: `cannot pickle '_Classes' object`).

The user's own source files (no installed distribution owns them) stay by value even where the
executors could import them (a shared folder, a Databricks repo): Python workers are reused and
keep the module they imported first, so a file edited between two fits would train its old code."""
from __future__ import annotations

import functools
import logging
import sys
import sysconfig
import types
from pathlib import Path
from typing import Any, Collection

log = logging.getLogger("sparkdl")

_INSTALLED_ROOTS = tuple(
    str(Path(p).resolve()) for p in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                                     sysconfig.get_paths()["stdlib"]})
# Always by reference: the executors run these themselves (stdlib aside, checked by name).
_EVERYWHERE = frozenset({"sparkdl", "torch", "pyspark"})
_by_us: set[str] = set()  # modules this process registered by value, and may take back


def _module_of(obj: Any) -> str | None:
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return None
    name = getattr(obj, "__module__", None)
    if not isinstance(name, str) or name == "__main__":
        return None  # cloudpickle already ships __main__ by value
    return name


def _looked_up(obj: Any) -> str | None:
    """The top-level name unpickling looks `obj` up by in its module (a class or function by
    reference), or None (an instance, a module, a local definition cloudpickle copies anyway)."""
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(qualname, str) or "<locals>" in qualname or not isinstance(obj, (type, types.FunctionType)):
        return None
    return qualname.split(".")[0]


def installed_by_path(module: types.ModuleType) -> bool:
    """The rule when no executor can be asked: a module under this interpreter's site-packages or
    standard library (or one without a file: builtins, namespace packages) is installed."""
    path = getattr(module, "__file__", None)
    if path is None:
        return True
    return str(Path(path).resolve()).startswith(_INSTALLED_ROOTS)


def is_library(module: types.ModuleType) -> bool:
    """Installed code: under site-packages or the standard library, or in a folder where an
    installed distribution's metadata claims it (`pip install --target`, `--prefix`, a shared
    library folder); not the user's own source files (nor an editable install's source tree)."""
    if installed_by_path(module):
        return True
    path = Path(module.__file__ or "").resolve()
    try:  # the sys.path folder holding the top-level package or module
        root = path.parents[module.__name__.count(".") + (path.name == "__init__.py")]
    except IndexError:
        return False
    return module.__name__.split(".")[0] in _distributions_in(str(root))


@functools.lru_cache(maxsize=256)
def _distributions_in(folder: str) -> frozenset[str]:
    """Top-level names the *.dist-info folders of `folder` install (their RECORD's first parts)."""
    names: set[str] = set()
    for info in Path(folder).glob("*.dist-info"):
        try:
            lines = (info / "RECORD").read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            entry = line.split(",", 1)[0]
            names.add(entry.split("/", 1)[0] if "/" in entry else entry.split(".", 1)[0])  # pkg/..., mod.py, mod.*.so
    return frozenset(names)


def always_by_reference(module: types.ModuleType) -> bool:
    """Modules never worth asking about: sparkdl, torch and pyspark (the executors run them), the
    standard library, and modules without a file (builtins, namespace packages, made at runtime)."""
    top = module.__name__.split(".")[0]
    return top in _EVERYWHERE or top in sys.stdlib_module_names or getattr(module, "__file__", None) is None


def travels_by_value(module: types.ModuleType, executors_import: Collection[str] | None) -> bool:
    """The decision for one module: by reference an installed library the executors import; by
    value what they cannot import, and the user's own source files. With no answer from the
    executors (None: no session to ask, or the question failed), by where this driver found it."""
    if always_by_reference(module):
        return False
    if executors_import is None:
        return not installed_by_path(module)
    return module.__name__ not in executors_import or not is_library(module)


def _submodule_classes(obj: Any) -> list[type]:
    """The classes inside an nn.Module instance (nn.Sequential(MyBlock(), ...) holds user classes
    that its own type does not name)."""
    modules = getattr(obj, "modules", None)
    if isinstance(obj, type) or not callable(modules):
        return []
    try:
        return list({type(m) for m in modules()})
    except TypeError:  # a `modules` attribute that is not torch's
        return []


def _referenced(function: Any) -> list[Any]:
    """What a function's code names from its module's globals: a factory in a notebook or script
    (pickled by value with __main__) that builds its model from another local file, `lambda:
    mynet.Net()` or `mynet_factory`, needs that file's module shipped too."""
    code, names = getattr(function, "__code__", None), getattr(function, "__globals__", None)
    if code is None or not isinstance(names, dict):
        return []
    found = []
    for name in code.co_names:
        value = names.get(name)
        if isinstance(value, types.ModuleType):
            found.append(_ModuleRef(value.__name__))
        elif isinstance(value, type) or callable(value):
            found.append(value)
    return found


class _ModuleRef:
    """Stands for a module in ship_by_value's walk (its __module__ is the module's own name)."""

    def __init__(self, name: str) -> None:
        self.__module__ = name


def modules_to_decide(*objects: Any) -> dict[str, set[str]]:
    """The modules `objects` come from (an instance's class and its submodules' classes, what a
    function names from its globals), each with the top-level names unpickling looks up in it;
    modules always sent by reference left out."""
    # A list of stage modules or of layer factories: each element's module counts.
    objects = tuple(x for obj in objects for x in (obj if isinstance(obj, (list, tuple)) else (obj,)))
    objects += tuple(ref for obj in objects if callable(obj) and not isinstance(obj, type) for ref in _referenced(obj))
    found: dict[str, set[str]] = {}
    for obj in objects:
        for candidate in (obj, type(obj), *_submodule_classes(obj)):
            name = _module_of(candidate)
            module = sys.modules.get(name) if name else None
            if module is None or always_by_reference(module):
                continue
            names = found.setdefault(module.__name__, set())
            if (looked_up := _looked_up(candidate)) is not None:
                names.add(looked_up)
    return found


def _executors_import(spark: Any, modules: dict[str, set[str]]) -> frozenset[str] | None:
    """The installed libraries of `modules` the executors import; only libraries are asked about
    (the user's own files travel by value either way), so a model of torch layers and the user's
    own classes runs no job."""
    if spark is None:
        return None
    libraries = {name: needed for name, needed in modules.items() if is_library(sys.modules[name])}
    if not libraries:
        return frozenset()
    from sparkdl.spark.session import executors_can_import

    try:
        return executors_can_import(spark, [(name, tuple(sorted(needed))) for name, needed in libraries.items()])
    except Exception as exc:  # noqa: BLE001 - any failure of the question: fall back, never fail the fit here
        log.warning("sparkdl: could not ask the executors which modules they import (%s: %s); modules outside "
                    "site-packages are shipped by value", type(exc).__name__, exc)
        return None


def ship_by_value(*objects: Any, spark: Any = None) -> list[str]:
    """Register the defining modules of `objects` (and of an instance's class and submodules) for
    pickling by value when the executors of `spark` cannot import them (asked once per session and
    module); without a session, those outside site-packages. Returns the module names registered."""
    from pyspark import cloudpickle

    picklers = [cloudpickle]
    try:  # MLflow pickles pyfunc models with the standalone cloudpickle, which keeps its own registry
        import cloudpickle as standalone

        if standalone is not cloudpickle:
            picklers.append(standalone)
    except ImportError:
        pass
    modules = modules_to_decide(*objects)
    executors_import = _executors_import(spark, modules)
    registered = []
    for name in modules:
        module = sys.modules[name]
        if travels_by_value(module, executors_import):
            if name not in cloudpickle.list_registry_pickle_by_value():  # not the user's own registration
                _by_us.add(name)
            for pickler in picklers:
                pickler.register_pickle_by_value(module)
            registered.append(name)
        elif name in _by_us:  # an earlier guess (no session then) the executors have now contradicted
            for pickler in picklers:
                if name in pickler.list_registry_pickle_by_value():
                    pickler.unregister_pickle_by_value(module)
            _by_us.discard(name)
    return registered
