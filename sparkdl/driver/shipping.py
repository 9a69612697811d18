"""Make user code reach the executors: functions and classes defined in the driver's own scripts
or test modules are pickled by value, because executors cannot import those modules."""
from __future__ import annotations

import sys
import sysconfig
import types
from pathlib import Path
from typing import Any

_INSTALLED_ROOTS = tuple(
    str(Path(p).resolve()) for p in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                                     sysconfig.get_paths()["stdlib"]})


def _module_of(obj: Any) -> str | None:
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return None
    name = getattr(obj, "__module__", None)
    if name is None or name == "__main__":
        return None  # cloudpickle already ships __main__ by value
    return name


def _is_installed(module: Any) -> bool:
    path = getattr(module, "__file__", None)
    if path is None:
        return True  # builtins and namespace packages: importable everywhere or not ours to ship
    resolved = str(Path(path).resolve())
    return resolved.startswith(_INSTALLED_ROOTS) or module.__name__.split(".")[0] in ("sparkdl", "torch", "pyspark")


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


def ship_by_value(*objects: Any) -> list[str]:
    """Register the defining modules of `objects` (and of an instance's class) for pickling by
    value when they are not installed packages; returns the module names registered."""
    from pyspark import cloudpickle

    picklers = [cloudpickle]
    try:  # MLflow pickles pyfunc models with the standalone cloudpickle, which keeps its own registry
        import cloudpickle as standalone

        if standalone is not cloudpickle:
            picklers.append(standalone)
    except ImportError:
        pass
    registered = []
    # A list of stage modules or of layer factories: each element's module counts.
    objects = tuple(x for obj in objects for x in (obj if isinstance(obj, (list, tuple)) else (obj,)))
    objects += tuple(ref for obj in objects if callable(obj) and not isinstance(obj, type) for ref in _referenced(obj))
    for obj in objects:
        for candidate in (obj, type(obj), *_submodule_classes(obj)):
            name = _module_of(candidate)
            module = sys.modules.get(name) if name else None
            if module is None or _is_installed(module) or name in registered:
                continue
            for pickler in picklers:
                pickler.register_pickle_by_value(module)
            registered.append(name)
    return registered
