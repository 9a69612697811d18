"""The pip requirements sparkdl logs with the MLflow model (instead of MLflow's inference, which
loads the model in a subprocess)."""
from __future__ import annotations


def test_model_requirements_name_the_model_layers_distribution() -> None:
    from dataclasses import dataclass
    from typing import Any

    import sklearn.preprocessing
    import torch
    from torch import nn

    from sparkdl.tracking.mlflow_run import model_requirements

    @dataclass
    class Served:
        module: Any
        transform_fn: Any = None

    plain = model_requirements(Served(nn.Sequential(nn.Linear(2, 2))))
    assert plain[1] == f"torch=={torch.__version__.split('+')[0]}" and "+" not in " ".join(plain)
    assert {r.split("==")[0] for r in plain} == {"sparkdl-torch", "torch", "mlflow", "pandas", "numpy", "pyarrow",
                                                  "cloudpickle"}
    with_fn = model_requirements(Served(nn.Linear(2, 2), transform_fn=sklearn.preprocessing.normalize))
    assert any(r.startswith("scikit-learn==") for r in with_fn)
