"""The multi-host bed's CPU capacities (tests/support/multihost.py's Bed inherits them): a cgroup
per worker host (tests/support/cpu_capacity.py) that its Spark Worker and everything under it share,
and seeded noisy neighbours that change a host's capacity at random times."""
from __future__ import annotations

from typing import Any

import cpu_capacity
from standalone import descendants


class BedCpu:
    """CPU capacity per emulated host; needs the Bed's `tag` and `_started` (Started records)."""

    tag: str
    _started: list[Any]
    _cpu_groups: cpu_capacity.CpuGroups | None
    _neighbours: list[cpu_capacity.NoisyNeighbour]

    def set_cpu(self, host: Any, cores: float | None) -> None:
        """`host`'s CPU capacity: `cores` cores (a fraction of one, or several), None for no limit.
        Its processes (a Spark Worker, the executors and Python workers under it) join the host's
        group now; what starts there later (a new Worker, executors) joins it too."""
        if self._cpu_groups is None:
            self._cpu_groups = cpu_capacity.CpuGroups(f"sparkdl-bed-{self.tag}")
        self._cpu_groups.set(host.name, cores)
        self._join_cpu_group(host)

    def cpu_of(self, host: Any) -> float | None:
        """`host`'s CPU capacity in cores as the kernel holds it now (None: no limit)."""
        groups = self._cpu_groups
        return groups.get(host.name) if groups is not None and host.name in groups.capacity else None

    def cpu_throttled(self, host: Any) -> dict[str, float]:
        """How often `host`'s capacity held it back (cpu_capacity.CpuGroups.throttled); {} without a group."""
        groups = self._cpu_groups
        return groups.throttled(host.name) if groups is not None and host.name in groups.capacity else {}

    def cpu_pids(self, host: Any) -> list[int]:
        """The processes in `host`'s CPU group now."""
        return self._cpu_groups.pids(host.name) if self._cpu_groups is not None else []

    def noisy_neighbour(self, host: Any, seed: int, low: float, high: float, mean_interval_s: float,
                        duration_s: float = 3600.0) -> cpu_capacity.NoisyNeighbour:
        """A neighbour on `host` taking a share of its CPU at random times: its capacity set to a
        uniform draw in [low, high] cores at exponential gaps of mean `mean_interval_s`, all from
        random.Random(seed), until stopped (the bed stops it; `stop()` earlier puts back the capacity
        it had). The returned controller's `schedule` records [(seconds, host, cores)] as applied."""
        if self._cpu_groups is None or host.name not in self._cpu_groups.capacity:
            self.set_cpu(host, None)
        assert self._cpu_groups is not None
        neighbour = cpu_capacity.NoisyNeighbour(self._cpu_groups, host.name, seed, low, high, mean_interval_s,
                                                duration_s)
        self._neighbours.append(neighbour)
        return neighbour.start()

    def _join_cpu_group(self, host: Any, pid: int | None = None) -> None:
        """Move `pid` (with its descendants), or every process started on `host`, into its group."""
        groups = self._cpu_groups
        if groups is None or host.name not in groups.capacity:
            return
        roots = [pid] if pid is not None else [s.process.pid for s in self._started
                                                 if s.host == host and s.process.poll() is None]
        for root in roots:
            groups.add(host.name, [root, *descendants(root)])

    def _stop_cpu(self) -> None:
        for neighbour in self._neighbours:
            neighbour.stop()
        self._neighbours.clear()

    def _remove_cpu_groups(self) -> None:
        if self._cpu_groups is not None:  # after the processes: leftovers go to the machine's group first
            self._cpu_groups.remove()
            self._cpu_groups = None
