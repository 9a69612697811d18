"""The queue of row updates not yet applied (Persia's bounded staleness), one rule for sharded and
replicated tables: the summed gradients of step t join the queue after its backward and are applied
before the lookups of step t + staleness + 1 at the latest, so no lookup sees rows more than
`staleness` steps behind (staleness 0: applied at once, synchronous and exact)."""
from __future__ import annotations

from collections import deque
from typing import Any

import torch

Updates = list[tuple[torch.Tensor, torch.Tensor]]  # per table: (rows, summed gradients / W)


class LateUpdates:
    """Mixed into the bags classes, which own `shards`, `states`, `optimizer`, `staleness`, `steps`
    and `max_lag`."""

    shards: list[torch.Tensor]
    states: list[dict[str, torch.Tensor]]
    optimizer: Any
    staleness: int
    steps: int
    max_lag: int
    _pending: "deque[tuple[int, Updates]]"

    @staticmethod
    def _check_arguments(placement: Any, comm: Any, staleness: Any) -> None:
        """What sharded and replicated bags refuse alike: a placement for another world, a bad bound."""
        from sparkdl.errors import ConfigError

        if placement.world_size != comm.size:
            raise ConfigError(f"the placement is for {placement.world_size} ranks but the run has {comm.size}",
                              hint="plan the placement with plan_placement(specs, comm.size)")
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
            raise ConfigError(f"staleness={staleness!r} is not an integer >= 0",
                              hint="0: synchronous updates; tau > 0: embedding updates may lag tau steps")

    def _queue(self, step: int, updates: Updates) -> None:
        self._pending.append((step, updates))
        while len(self._pending) > self.staleness:
            self._apply_oldest()

    def _apply_oldest(self) -> None:
        _, updates = self._pending.popleft()
        for weight, state, (rows, grads) in zip(self.shards, self.states, updates):
            with torch.no_grad():
                self.optimizer.update(weight, state, rows, grads)

    def _bound_staleness(self) -> None:
        """Before the lookups of step s: no queued update older than s - staleness, then the lag this
        lookup sees (s minus the oldest step still queued)."""
        while self._pending and self.steps - self._pending[0][0] > self.staleness:
            self._apply_oldest()
        if self._pending:
            self.max_lag = max(self.max_lag, self.steps - self._pending[0][0])

    def flush(self) -> None:
        """Apply every queued update now (before a checkpoint, an evaluation or the end of training)."""
        while self._pending:
            self._apply_oldest()

    def _pending_state(self) -> list[dict[str, Any]]:
        return [{"step": step, "rows": [r.clone() for r, _ in ups], "grads": [g.clone() for _, g in ups]}
                for step, ups in self._pending]

    def _load_pending(self, saved: list[dict[str, Any]]) -> None:
        self._pending = deque((p["step"], list(zip(p["rows"], p["grads"]))) for p in saved)
