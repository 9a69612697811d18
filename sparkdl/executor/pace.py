"""Each rank's pace in an epoch: its compute time (its steps' time less what it spent blocked in the
strategy's collectives), its speed in rows per compute-second, the time lost to waiting, and the ranks
that hold the others back, named with their hosts (issue 43, item 2).

Standard library only: the loop builds the record's figures with it and the driver's monitor words
its warning from the same record.
"""
from __future__ import annotations

import statistics
from typing import Any, Sequence

SLOW_FACTOR = 1.5  # a rank this much slower than the median is named


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


def slow_rank_message(entry: dict[str, Any], waiting: float) -> str:
    return (f"sparkdl: rank {entry['rank']} on host {entry['host']} computes {entry['slower']:.1f}x slower than "
            f"the median; {100 * waiting:.0f}% of step time is spent waiting for it")
