"""The module paths of the flat layout before issue 41 (sparkdl 0.1), kept importable with no warning.

A saved MLflow pyfunc carries a copy of its code file (`from sparkdl.trained_model import ...`) and its
skeleton pickles classes by module path (`sparkdl.serving.ServedModel`); user code may import
`sparkdl.session` or `sparkdl.launch.objectives`. Each old name is the new module itself (one module
object under two names), so classes pickled under either name load, and nothing is copied.
`sparkdl.config`, `sparkdl.storage` and `sparkdl.tracking` are packages now under their old names:
`sparkdl.config` re-exports its public names; the other two were never public.
Standard library only: installed by `import sparkdl`.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Sequence

MOVED: dict[str, str] = {
    "sparkdl.config_values": "sparkdl.config.values",
    "sparkdl.config_training": "sparkdl.config.training",
    "sparkdl.config_elastic": "sparkdl.config.elastic",
    "sparkdl.checks": "sparkdl.driver.checks",
    "sparkdl.planning": "sparkdl.driver.planning",
    "sparkdl.resolved_plan": "sparkdl.planner.resolved",
    "sparkdl.session": "sparkdl.spark.session",
    "sparkdl.jvm": "sparkdl.spark.jvm",
    "sparkdl.shared_paths": "sparkdl.storage.shared_paths",
    "sparkdl.tensor_files": "sparkdl.model.tensor_files",
    "sparkdl.trained_model": "sparkdl.model.trained",
    "sparkdl.layer_factories": "sparkdl.model.layer_factories",
    "sparkdl.layouts": "sparkdl.model.layouts",
    "sparkdl.losses": "sparkdl.model.losses",
    "sparkdl.metrics": "sparkdl.model.metrics",
    "sparkdl.launch.objectives": "sparkdl.model.objectives",
    "sparkdl.serving": "sparkdl.tracking.serving",
    "sparkdl.inference": "sparkdl.tracking.inference",
    "sparkdl.fit_records": "sparkdl.tracking.fit_records",
    "sparkdl.phases": "sparkdl.tracking.phases",
    "sparkdl.mlflow_pyfunc": "sparkdl.tracking.pyfunc",
    "sparkdl.launch.attempts": "sparkdl.driver.attempts",
    "sparkdl.launch.elastic": "sparkdl.driver.elastic",
    "sparkdl.launch.monitor": "sparkdl.driver.monitor",
    "sparkdl.launch.probe": "sparkdl.driver.probe",
    "sparkdl.launch.driver": "sparkdl.driver.job",
    "sparkdl.launch.parts": "sparkdl.driver.parts",
    "sparkdl.launch.callbacks": "sparkdl.driver.callbacks",
    "sparkdl.launch.shipping": "sparkdl.driver.shipping",
    "sparkdl.launch.worker": "sparkdl.executor.worker",
    "sparkdl.launch.loop": "sparkdl.executor.loop",
    "sparkdl.launch.context": "sparkdl.executor.context",
    "sparkdl.launch.checkpoint": "sparkdl.executor.checkpoint",
    "sparkdl.launch.checkpoint_async": "sparkdl.executor.checkpoint_async",
    "sparkdl.launch.reshape": "sparkdl.executor.reshape",
    "sparkdl.launch.memory": "sparkdl.executor.memory",
    "sparkdl.launch.reporter": "sparkdl.executor.reporter",
    "sparkdl.launch.rendezvous": "sparkdl.executor.rendezvous",
    "sparkdl.launch.output": "sparkdl.executor.output",
    "sparkdl.launch.validation": "sparkdl.executor.validation",
    "sparkdl.launch.balance": "sparkdl.executor.balance",
    "sparkdl.launch.channel_client": "sparkdl.executor.channel_client",
    "sparkdl.launch.spec": "sparkdl.wire.spec",
    "sparkdl.launch.wire": "sparkdl.wire.codec",
    "sparkdl.launch.handshake": "sparkdl.wire.handshake",
    "sparkdl.launch.model_transfer": "sparkdl.wire.model_transfer",
    "sparkdl.launch.stopping": "sparkdl.wire.stopping",
    "sparkdl.launch.channel": "sparkdl.wire.frames",
}
OLD_PACKAGES = frozenset({"sparkdl.launch"})  # old packages whose every module moved


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str | None) -> None:
        self.new = new
        self.real_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        if self.new is None:
            package = types.ModuleType(spec.name, "moved: see sparkdl.old_paths")
            package.__path__ = []  # its old submodules resolve through the finder, not the file system
            return package
        module = importlib.import_module(self.new)
        self.real_spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        if self.real_spec is not None:  # importlib stamped the alias's spec on the real module: undo it
            module.__spec__ = self.real_spec


class _OldPathFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname in MOVED:
            return importlib.machinery.ModuleSpec(fullname, _Alias(MOVED[fullname]))
        if fullname in OLD_PACKAGES:
            return importlib.machinery.ModuleSpec(fullname, _Alias(None), is_package=True)
        return None


def install() -> None:
    """Put the finder on sys.meta_path once (after the file-system finders: new paths win)."""
    if not any(isinstance(finder, _OldPathFinder) for finder in sys.meta_path):
        sys.meta_path.append(_OldPathFinder())
