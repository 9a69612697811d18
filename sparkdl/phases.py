"""Where a fit's wall time goes, phase by phase (the fixed cost around the training job itself):
`model.fit_seconds`, the MLflow metrics `fit_<phase>_s`, and benchmarks/fixed_cost.py --breakdown."""
from __future__ import annotations

import time


class Phases:
    """Consecutive phases: `mark(name)` closes the one running since the previous mark."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._last
        self._last = now

    def metrics(self) -> dict[str, float]:
        """The phases as MLflow metric names: fit_<phase>_s, and fit_total_s."""
        return {**{f"fit_{name}_s": s for name, s in self.seconds.items()}, "fit_total_s": sum(self.seconds.values())}
