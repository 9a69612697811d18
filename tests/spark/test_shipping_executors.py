"""What the executors can import travels by reference, whatever folder the driver found it in; what
they cannot import travels by value (driver/shipping.py, asked by spark/session.executors_can_import).

A real `pip install --target` of a tiny library made here, whose module-level class holds an
object cloudpickle cannot copy by value (as torch's `torch.classes` reached through a library's
globals: `cannot pickle '_Classes' object`): on the PYTHONPATH of the driver and of the executors
it trains, and is not registered by value; the same library on the driver's path only is shipped
by value and trains. A Hugging Face GPT-2 wrapped in a module of this test file trains too."""
from __future__ import annotations

import contextlib
import importlib
import os
import sys
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch
from pyspark import cloudpickle
from torch import nn

from sparkdl import TorchEstimator
from sparkdl.driver.shipping import ship_by_value
from sparkdl.spark.session import executors_can_import

from shipping_libs import pip_install_target

COMMON = dict(num_workers=2, tracking=False, progress=False, seed=0)


@contextlib.contextmanager
def on_driver_path(target: Path, name: str) -> Iterator[Any]:
    """`target` on this driver's sys.path (what PYTHONPATH does at start-up); the library's module."""
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    try:
        yield importlib.import_module(f"{name}.layers")
    finally:
        sys.path.remove(str(target))
        for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[module]


@contextlib.contextmanager
def on_executor_path(spark: Any, target: Path) -> Iterator[None]:
    """`target` on the executors' PYTHONPATH for the jobs started inside: spark.executorEnv, which
    PySpark passes with every Python function (the shared session started before this test)."""
    environment = spark.sparkContext.environment
    before = environment.get("PYTHONPATH")
    environment["PYTHONPATH"] = os.pathsep.join(p for p in (str(target), before) if p)
    try:
        yield
    finally:
        if before is None:
            environment.pop("PYTHONPATH", None)
        else:
            environment["PYTHONPATH"] = before


def imported_on_executors(spark: Any, module: str) -> set[str]:
    """Where the executors' Python imports `module` from (its __file__, or the error), per task."""
    import pyarrow as pa

    def where(batches: Any) -> Any:
        for _ in batches:
            pass
        try:
            found = importlib.import_module(module).__file__ or ""
        except ImportError as exc:
            found = f"{type(exc).__name__}: {exc}"
        yield pa.RecordBatch.from_pydict({"file": [found]})

    return {r["file"] for r in spark.range(0, 2, 1, 2).mapInArrow(where, "file string").collect()}


def regression_rows(spark: Any, width: int = 4) -> Any:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, width)).astype(np.float32)
    y = x @ rng.normal(size=width).astype(np.float32)
    rows = [([float(v) for v in features], float(target)) for features, target in zip(x, y)]
    return spark.createDataFrame(rows, "xs array<float>, y float")


def fit(model: nn.Module, df: Any) -> Any:
    return TorchEstimator(model=model, loss="mse", optimizer="sgd", lr=0.05, feature_cols=["xs"], label_col="y",
                          batch_size=16, epochs=1, **COMMON).fit(df)


def test_a_target_folder_the_executors_import_travels_by_reference(spark, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    name = "sparkdl_target_lib_a"
    target = pip_install_target(tmp_path, name, unpicklable=True)
    with on_driver_path(target, name) as layers, on_executor_path(spark, target):
        assert imported_on_executors(spark, f"{name}.layers") == {str(target / name / "layers.py")}
        model = nn.Sequential(layers.Block(), nn.Linear(4, 1))
        # Where no executor can be asked, the folder's place decides (outside site-packages: by
        # value), which cannot pickle this library: the failure the question avoids.
        assert ship_by_value(model) == [f"{name}.layers"]
        with pytest.raises(TypeError, match="_Classes"):
            cloudpickle.dumps(model)
        assert executors_can_import(spark, [(f"{name}.layers", ("Block",))]) == {f"{name}.layers"}
        assert ship_by_value(model, spark=spark) == []  # the executors import it: the guess is taken back
        assert f"{name}.layers" not in cloudpickle.list_registry_pickle_by_value()
        trained = fit(model, regression_rows(spark))
        assert f"{name}.layers" not in cloudpickle.list_registry_pickle_by_value()
        assert type(trained.torch_module()[0]).__module__ == f"{name}.layers"
        assert len(trained.history) == 1


def test_a_library_only_the_driver_has_travels_by_value(spark, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    name = "sparkdl_target_lib_b"
    target = pip_install_target(tmp_path, name, unpicklable=False)
    with on_driver_path(target, name) as layers:
        assert imported_on_executors(spark, f"{name}.layers") == {f"ModuleNotFoundError: No module named '{name}'"}
        model = nn.Sequential(layers.Block(), nn.Linear(4, 1))
        assert executors_can_import(spark, [(f"{name}.layers", ("Block",))]) == frozenset()
        trained = fit(model, regression_rows(spark))
        assert f"{name}.layers" in cloudpickle.list_registry_pickle_by_value()
        scored = trained.transform(regression_rows(spark)).select("prediction").collect()
        assert len(scored) == 128


class LogitsOf(nn.Module):
    """A Hugging Face causal LM wrapped by hand (this test module: shipped by value) to return its logits."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids).logits


def test_a_hugging_face_gpt2_wrapped_in_a_test_module_trains(spark) -> None:  # type: ignore[no-untyped-def]
    from transformers import GPT2Config, GPT2LMHeadModel

    from sparkdl.datasets import synthetic_tokens_dataframe

    torch.manual_seed(0)
    model = LogitsOf(GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=32)))
    registered = ship_by_value(model, spark=spark)
    assert registered == [__name__]  # this file; transformers, which the executors import, by reference
    assert not any(m.startswith("transformers") for m in cloudpickle.list_registry_pickle_by_value())
    df = synthetic_tokens_dataframe(spark, rows=128, seq_len=16, vocab=256, seed=0)
    trained = TorchEstimator(model=model, input_cols=["tokens"], label_col="targets", loss="cross_entropy",
                             optimizer="adamw", lr=1e-3, batch_size=16, epochs=1, **COMMON).fit(df)
    assert type(trained.torch_module().lm).__name__ == "GPT2LMHeadModel"
    assert np.isfinite(trained.history[0]["loss"])
