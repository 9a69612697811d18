"""Islands from the measured pair matrix: hosts joined by fast links (a rack, a zone) grouped apart
from the slow links between them, for hierarchical DiLoCo (strategies/islands.py). Standard library
only. Ranks on one host always share an island; hosts are merged, fastest link first (complete
linkage: two groups join at the slowest link between them), until the next merge would cross a link
ISLAND_GAP times slower than the slowest link already inside an island, or the count asked for is
reached.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

ISLAND_GAP = 4.0  # links between islands at least this many times slower than those inside

Matrix = Sequence[Sequence[float]]


@dataclass(frozen=True)
class IslandLinks:
    islands: tuple[tuple[str, ...], ...]  # host names per island
    sizes: tuple[int, ...]  # ranks per island
    inside: tuple[float, float]  # (largest latency, smallest bandwidth) of a link inside an island
    across: tuple[float, float]  # the same between islands


def host_of(executor: str) -> str:
    return executor.rsplit(":", 1)[0] if ":" in executor else executor


def find_islands(rank_hosts: Sequence[str], latency: Matrix, bandwidth: Matrix, count: int = 0) -> IslandLinks | None:
    """The islands of these ranks (host of each rank, its pair matrices), or None when the links
    form none: one host, or no gap between fast and slow links (with `count`, exactly that many
    islands, gap or not; None if there are fewer hosts)."""
    hosts = sorted(set(rank_hosts))
    if len(hosts) < 2 or (count and len(hosts) < count):
        return None
    link = _host_links(rank_hosts, bandwidth)  # the slowest link between two hosts (min bandwidth)
    groups = [[h] for h in hosts]
    # Ranks sharing a host are inside an island already: their links are the first inside ones.
    inside_slowest = min((bandwidth[i][j] for i, a in enumerate(rank_hosts) for j, b in enumerate(rank_hosts)
                          if i != j and a == b), default=float("inf"))
    while len(groups) > max(count, 1):
        best, pair = -1.0, (0, 1)
        for i in range(len(groups)):
            for j in range(i + 1, len(groups)):
                joined = min(link[(a, b)] for a in groups[i] for b in groups[j])
                if joined > best:
                    best, pair = joined, (i, j)
        if not count and inside_slowest < float("inf") and best * ISLAND_GAP < inside_slowest:
            break  # the next link is a slow one: what is left are the islands
        inside_slowest = min(inside_slowest, best)
        i, j = pair
        groups[i] = sorted(groups[i] + groups[j])
        del groups[j]
    if len(groups) < 2:
        return None
    return _links(tuple(tuple(g) for g in groups), rank_hosts, latency, bandwidth)


def _host_links(rank_hosts: Sequence[str], matrix: Matrix) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for i, a in enumerate(rank_hosts):
        for j, b in enumerate(rank_hosts):
            if i != j and a != b:
                value = matrix[i][j]
                out[(a, b)] = min(out.get((a, b), value), value)
    return out


def island_links(islands: Sequence[Sequence[str]], rank_hosts: Sequence[str], latency: Matrix, bandwidth: Matrix
                 ) -> IslandLinks | None:
    """The links inside and across given islands (host groups); None if a rank's host is in none."""
    if any(not any(host in group for group in islands) for host in rank_hosts):
        return None
    return _links(tuple(tuple(g) for g in islands), rank_hosts, latency, bandwidth)


def _links(islands: tuple[tuple[str, ...], ...], rank_hosts: Sequence[str], latency: Matrix, bandwidth: Matrix
           ) -> IslandLinks:
    where = {host: k for k, group in enumerate(islands) for host in group}
    inside: list[tuple[float, float]] = []
    across: list[tuple[float, float]] = []
    for i, a in enumerate(rank_hosts):
        for j, b in enumerate(rank_hosts):
            if i != j:
                (inside if where[a] == where[b] else across).append((latency[i][j], bandwidth[i][j]))

    def worst(pairs: list[tuple[float, float]]) -> tuple[float, float]:
        return (max(p[0] for p in pairs), min(p[1] for p in pairs)) if pairs else (0.0, float("inf"))

    sizes = tuple(sum(1 for h in rank_hosts if where[h] == k) for k in range(len(islands)))
    return IslandLinks(islands, sizes, worst(inside), worst(across))
