"""User code reaches the executors (driver/shipping.py): a factory's own module and the local
modules it builds the model from are pickled by value."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch
from pyspark import cloudpickle

from sparkdl.driver.shipping import ship_by_value


def test_a_factory_that_builds_from_another_local_file_ships_that_file(tmp_path: Path) -> None:
    (tmp_path / "local_net_for_shipping.py").write_text(
        "import torch\nclass Net(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.fc = torch.nn.Linear(3, 2)\n    def forward(self, x):\n        return self.fc(x)\n")
    sys.path.insert(0, str(tmp_path))
    try:
        local = importlib.import_module("local_net_for_shipping")
        namespace = {"local_net_for_shipping": local, "__name__": "__main__"}
        exec("def factory():\n    return local_net_for_shipping.Net()\n", namespace)  # a notebook's cell
        factory = namespace["factory"]
        assert "local_net_for_shipping" in ship_by_value(factory)
        payload = cloudpickle.dumps(factory)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("local_net_for_shipping", None)
    # Where the file is not importable (an executor), the pickled factory still builds the model.
    built = cloudpickle.loads(payload)()
    assert built(torch.zeros(1, 3)).shape == (1, 2)
