"""Tiny libraries installed with a real `pip install --target` for the shipping tests
(tests/spark/test_shipping_executors.py, test_shipping_connect.py): a package `name` with one module,
`name.layers`, defining `Block(nn.Module)`; with `unpicklable`, Block holds a class attribute that
cloudpickle cannot copy by value (torch.classes, as a library's globals reach it:
`cannot pickle '_Classes' object`), so it trains only when the executors import the library."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

LAYERS = """
import torch
from torch import nn


class Block(nn.Module):
    {attribute}

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))
"""


def pip_install_target(root: Path, name: str, unpicklable: bool) -> Path:
    """`pip install --target root/target` (offline, from root/src) of the package `name`; the target folder."""
    source = root / "src"
    (source / name).mkdir(parents=True)
    (source / name / "__init__.py").write_text("")
    attribute = "registry = torch.classes  # cloudpickle cannot copy this by value" if unpicklable else "pass"
    (source / name / "layers.py").write_text(textwrap.dedent(LAYERS).format(attribute=attribute))
    (source / "pyproject.toml").write_text(textwrap.dedent(f"""
        [build-system]
        requires = ["setuptools"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "{name.replace('_', '-')}"
        version = "0.1"
        [tool.setuptools]
        packages = ["{name}"]
        """))
    target = root / "target"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-build-isolation", "--no-deps",
                    "--quiet", "--target", str(target), str(source)], check=True, timeout=300)
    assert (target / name / "layers.py").is_file()
    return target
