"""Cut a chain of layers into K contiguous stages whose largest cost is as small as possible.

Standard "linear partition" dynamic programme, O(K n^2): exact, and fast for the few hundred
top-level layers a Sequential has. Standard library only.
"""
from __future__ import annotations

from typing import Callable, Sequence


def balanced_cuts(costs: Sequence[float], parts: int,
                  fits: Callable[[int, int, int], bool] | None = None) -> list[int]:
    """Boundaries [0, c1, ..., n]: stage j holds layers c_j .. c_{j+1}-1; every stage non-empty.

    Among cuts with the same bottleneck, the one with the smallest sum of squared stage costs is
    taken (evens out the non-bottleneck stages), then the earliest, so the result is deterministic.
    `fits(stage, first, end)` (optional) says whether layers first..end-1 may form that stage (a
    memory budget); ValueError when no cut satisfies it.
    """
    n = len(costs)
    if parts < 1 or parts > n:
        raise ValueError(f"cannot cut {n} layers into {parts} non-empty stages")
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + max(float(cost), 0.0))

    def span(i: int, j: int) -> float:
        return prefix[j] - prefix[i]

    inf = (float("inf"), float("inf"))
    # best[k][j]: (bottleneck, sum of squares) of cutting layers 0..j-1 into k stages
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    choice = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, parts + 1):
        for j in range(k, n - (parts - k) + 1):
            for i in range(k - 1, j):
                prev = best[k - 1][i]
                if prev == inf or (fits is not None and not fits(k - 1, i, j)):
                    continue
                cost = span(i, j)
                candidate = (max(prev[0], cost), prev[1] + cost * cost)
                if candidate < best[k][j]:
                    best[k][j], choice[k][j] = candidate, i
    if best[parts][n] == inf:
        raise ValueError(f"no cut of {n} layers into {parts} stages satisfies the constraint")
    cuts = [n]
    for k in range(parts, 0, -1):
        cuts.append(choice[k][cuts[-1]])
    return cuts[::-1]


def stage_costs(costs: Sequence[float], cuts: Sequence[int]) -> list[float]:
    return [float(sum(costs[cuts[j]: cuts[j + 1]])) for j in range(len(cuts) - 1)]
