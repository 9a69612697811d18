"""Each rank's pace in an epoch: its compute time (its steps' time less what it spent blocked in the
strategy's collectives), its speed in rows per compute-second, the time lost to waiting, and the ranks
that hold the others back, named with their hosts (issue 43, item 2).

One rule (issue 52) decides whether unequal speeds cost the run something a user should act on:
`costs_the_run` for one measurement, `Sustained` for WINDOW successive ones. The driver's monitor
names a slow rank by it (measurements: epochs), and executor/rebalance.py re-splits the batch, and
so says that speeds drifted, by it (measurements: its agreements). Noise on sub-millisecond steps
(two ranks sharing two cores with Spark's JVMs) never passes the absolute floor.

Standard library only: the loop builds the record's figures with it and the driver's monitor words
its warning from the same record.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Hashable, Mapping, Sequence

SLOW_FACTOR = 1.5  # a rank this much slower than the median is a candidate for naming
MIN_LOST_S = 0.005  # unequal speeds must cost at least this many seconds of waiting per step...
MIN_SHARE = 0.10  # ...and at least this share of the step's time...
WINDOW = 2  # ...in this many successive measurements (epochs, or the rebalancer's agreements)


@dataclass(frozen=True)
class Cost:
    """What unequal speeds cost per step: `lost_s` seconds of a step of `step_s` seconds."""

    lost_s: float
    step_s: float

    @property
    def share(self) -> float:
        return self.lost_s / self.step_s if self.step_s > 0 else 0.0


def costs_the_run(cost: Cost) -> bool:
    """One measurement's verdict: the loss is above the absolute floor *and* a real share of the
    step (a millisecond of a 2 s step is not worth a warning; 40% of a 0.3 ms step is noise)."""
    return cost.lost_s >= MIN_LOST_S and cost.lost_s >= MIN_SHARE * cost.step_s


@dataclass
class Sustained:
    """Which keys (ranks, or the rebalancer's split) cost the run in each of the last `window`
    measurements: one bad epoch (a first epoch's warm-up, a neighbour's burst) is not enough."""

    window: int = WINDOW
    _streaks: dict[Hashable, int] = field(default_factory=dict)

    def update(self, costs: Mapping[Hashable, Cost]) -> list[Hashable]:
        """Take one measurement (keys absent cost nothing this time) and return the keys whose
        streak reached the window, in the order of `costs`."""
        for key in list(self._streaks):
            if key not in costs:
                self._streaks[key] = 0
        for key, cost in costs.items():
            self._streaks[key] = self._streaks.get(key, 0) + 1 if costs_the_run(cost) else 0
        return [key for key in costs if self._streaks[key] >= self.window]


def pace_figures(step_seconds: Sequence[float], wait_seconds: Sequence[float], rows: Sequence[float]
                 ) -> dict[str, list[float]]:
    """Per rank: compute seconds (step time less collective waits, never below 0), wait seconds and
    rows per compute-second (0 for a rank that computed nothing)."""
    compute = [max(s - w, 0.0) for s, w in zip(step_seconds, wait_seconds)]
    speed = [r / c if c > 0 else 0.0 for r, c in zip(rows, compute)]
    return {"compute_seconds_by_rank": compute, "wait_seconds_by_rank": [float(w) for w in wait_seconds],
            "rows_per_compute_s_by_rank": speed}


def wait_fraction(step_seconds: Sequence[float], wait_seconds: Sequence[float]) -> float:
    """The share of all ranks' step time spent blocked in collectives."""
    total = sum(step_seconds)
    return sum(wait_seconds) / total if total > 0 else 0.0


def slow_ranks(speeds: Sequence[float], hosts: Sequence[str], factor: float = SLOW_FACTOR) -> list[dict[str, Any]]:
    """The ranks whose speed is more than `factor` times below the median's: rank, host and how many
    times slower, slowest first."""
    measured = [s for s in speeds if s > 0]
    if len(measured) < 2:
        return []
    median = statistics.median(measured)
    slow = [{"rank": r, "host": hosts[r] if r < len(hosts) else "?", "slower": median / s}
            for r, s in enumerate(speeds) if s > 0 and median / s > factor]
    return sorted(slow, key=lambda entry: -entry["slower"])


def slow_ranks_in_groups(speeds: Sequence[float], hosts: Sequence[str], groups: Sequence[Sequence[int]],
                         factor: float = SLOW_FACTOR) -> list[dict[str, Any]]:
    """slow_ranks within each group of ranks doing the same work (a pipeline stage's replicas),
    with the ranks' own numbers; slowest first."""
    slow: list[dict[str, Any]] = []
    for group in groups:
        members = [r for r in group if r < len(speeds)]
        for entry in slow_ranks([speeds[r] for r in members], [hosts[r] if r < len(hosts) else "?" for r in members],
                                factor):
            slow.append({**entry, "rank": members[entry["rank"]]})
    return sorted(slow, key=lambda entry: -entry["slower"])


def with_costs(slow: list[dict[str, Any]], compute_seconds: Sequence[float], step_seconds: Sequence[float],
               groups: Sequence[Sequence[int]], steps: int) -> list[dict[str, Any]]:
    """The slow ranks whose cost passes `costs_the_run` this epoch, each with it: `lost_s_per_step`
    (its compute seconds above the median of its peers', per step: what they wait for it) and
    `step_s` (the ranks' mean step seconds, per step)."""
    if steps <= 0 or not step_seconds:
        return []
    step_s = statistics.fmean(step_seconds) / steps
    kept = []
    for entry in slow:
        rank = entry["rank"]
        peers = next((g for g in groups if rank in g), range(len(compute_seconds)))
        others = [compute_seconds[r] for r in peers if r != rank and r < len(compute_seconds)]
        if not others:
            continue
        cost = Cost(max(compute_seconds[rank] - statistics.median(others), 0.0) / steps, step_s)
        if costs_the_run(cost):
            kept.append({**entry, "lost_s_per_step": cost.lost_s, "step_s": cost.step_s})
    return kept


def entry_cost(entry: Mapping[str, Any]) -> Cost | None:
    """The cost a slow_ranks entry carries (None for a record written before costs were kept)."""
    if "lost_s_per_step" not in entry or "step_s" not in entry:
        return None
    return Cost(float(entry["lost_s_per_step"]), float(entry["step_s"]))


def slow_rank_message(entry: dict[str, Any], waiting: float) -> str:
    """`waiting`: the share of step time its peers spend waiting for it (its own cost's share when
    the entry carries one, else the epoch's wait_fraction)."""
    cost = entry_cost(entry)
    share = cost.share if cost is not None else waiting
    per_step = f" ({1000 * cost.lost_s:.0f} ms a step)" if cost is not None else ""
    return (f"sparkdl: rank {entry['rank']} on host {entry['host']} computes {entry['slower']:.1f}x slower than "
            f"the median; {100 * min(share, 1.0):.0f}% of step time is spent waiting for it{per_step}")
