"""Where time goes, phase by phase. `Phases`: a fit's wall time around the training job
(`model.fit_seconds`, the MLflow metrics `fit_<phase>_s`, benchmarks/fixed_cost.py --breakdown).
`Clock`: the time one rank's task spends in each of its phases (`ctx.task_phases`), including work
on the partition's reader thread (receiving from Spark, converting, writing the spool). Standard
library only: worker-side modules use it."""
from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")


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


class Clock:
    """Seconds summed per named phase. Phases may run on different threads at once (the reader
    thread receives and spools while the loop trains), so they need not add up to the wall time;
    each name is written by one thread only."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        """Close the phase `name`, running since the previous lap (or the clock's start), on the
        task's main thread."""
        now = time.perf_counter()
        self.add(name, now - self._last)
        self._last = now

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - started)

    def iterate(self, items: Iterable[T], name: str) -> Iterator[T]:
        """`items`, with the time spent waiting for each next item added to `name`."""
        source = iter(items)
        while True:
            started = time.perf_counter()
            try:
                item = next(source)
            except StopIteration:
                self.add(name, time.perf_counter() - started)
                return
            self.add(name, time.perf_counter() - started)
            yield item

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)


def maybe_timed(clock: Clock | None, name: str):  # type: ignore[no-untyped-def]
    """`clock.timed(name)`, or nothing to time without a clock."""
    from contextlib import nullcontext

    return clock.timed(name) if clock is not None else nullcontext()
