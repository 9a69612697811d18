"""The views of a calibration the planner prices every candidate under: as measured, and its
optimistic end (best repeats; ranks within HETEROGENEOUS of each other counted as equal), each with
its network terms and, when the measured links form islands, those islands' links.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from sparkdl.config import LaunchConfig
from sparkdl.planner import cost
from sparkdl.planner.cluster import ClusterInfo
from sparkdl.planner.islands import IslandLinks, find_islands, host_of, island_links
from sparkdl.planner.step_trial import lock_step_s

HETEROGENEOUS = 1.5  # fastest / slowest rank speed (at both calibration ends) above which shares by speed are priced


@dataclass(frozen=True)
class CalibrationEnd:
    """One view of the calibration a layout is priced under: as measured, or its optimistic end."""

    name: str  # "measured" or "optimistic"
    speeds: tuple[float, ...]  # FLOP/s per rank
    latency_s: float  # the link the network terms use (slowest pair, or the emulated one)
    bandwidth_Bps: float
    net: cost.Network
    islands: IslandLinks | None = None  # islands found in the measured links, with this end's figures
    step_s: float = 0.0  # the run's model step timed on the ranks, lock-step (planner/step_trial.py); 0: none
    ist_round: tuple[float, float] = (0.0, 0.0)  # an IST round timed on the ranks: step between syncs, sync


def island_groups(cluster: ClusterInfo, declared: int | tuple[tuple[str, ...], ...], launch: LaunchConfig,
                  backend_ops: frozenset[str]) -> tuple[tuple[str, ...], ...]:
    """Host groups of the islands the measured links form (train.islands=K: exactly K), found once so
    that both calibration ends price the same candidates; none under an emulated network, without
    process groups per island, or when the user declared the islands (those are priced as given).
    `declared`: train.islands."""
    if launch.emulate_network or "subgroup" not in backend_ops or \
            len(cluster.rank_executors) != cluster.workers or not isinstance(declared, int):
        return tuple(tuple(g) for g in declared) if not isinstance(declared, int) else ()
    hosts = [host_of(e) for e in cluster.rank_executors]
    found = find_islands(hosts, cluster.latency_s, cluster.bandwidth_Bps, declared)
    return found.islands if found is not None else ()


def calibration_ends(cluster: ClusterInfo, launch: LaunchConfig, islands: tuple[tuple[str, ...], ...] = ()
                     ) -> list[CalibrationEnd]:
    """The measured end, and the optimistic one when the calibration measured its spread. At the
    optimistic end ranks whose best speeds are within HETEROGENEOUS count as equal (at the fastest):
    their measured difference may be load. Declared figures (emulate_network, emulate_speed) are
    the same at both ends: they are not noisy."""
    ends = [_end("measured", cluster, launch, islands)]
    if cluster.has_spread:
        optimistic = _end("optimistic", cluster.optimistic(), launch, islands)
        speeds = optimistic.speeds
        if not launch.emulate_speed and max(speeds) <= HETEROGENEOUS * min(speeds):
            optimistic = dataclasses.replace(optimistic, speeds=(max(speeds),) * len(speeds),
                                             step_s=lock_step_s(cluster.best_step_s, equal=True))
        ends.append(optimistic)
    return ends


def _end(name: str, cluster: ClusterInfo, launch: LaunchConfig, islands: tuple[tuple[str, ...], ...] = ()
         ) -> CalibrationEnd:
    emulated = launch.emulate_network
    latency, bandwidth = cluster.worst_link()
    if emulated:
        from sparkdl.comm.emulated import network_from_options

        fake_latency, fake_bandwidth = network_from_options(emulated)
        # An emulated link only slows the real one down: the real latency and bandwidth still bound it.
        latency, bandwidth = max(fake_latency, latency), min(fake_bandwidth, bandwidth)
    # Collectives: the measured allreduce, which an emulated network can only slow down further.
    net = cost.Network(latency_s=latency, bandwidth_Bps=bandwidth, collective_latency_s=cluster.collective_latency_s,
                       collective_bandwidth_Bps=cluster.collective_bandwidth_Bps)
    links = island_links(islands, [host_of(e) for e in cluster.rank_executors], cluster.latency_s,
                         cluster.bandwidth_Bps) if islands and len(cluster.rank_executors) == cluster.workers else None
    timed = not launch.emulate_speed  # declared speeds: what the ranks timed is not what they emulate
    return CalibrationEnd(name, tuple(rank_speeds(cluster, launch)), latency, bandwidth, net, links,
                          lock_step_s(cluster.step_s) if timed else 0.0,
                          (cluster.ist_step_s, cluster.ist_sync_s) if timed else (0.0, 0.0))


def rank_speeds(cluster: ClusterInfo, launch: LaunchConfig) -> list[float]:
    """Each rank's FLOP/s: calibrated, or under launch.emulate_speed the fastest calibrated rank
    scaled by the declared relative speeds (the emulation slows alike ranks down)."""
    emulated = launch.emulate_speed
    if emulated:
        return [max(cluster.flops_per_s) * float(s) for s in emulated]
    return list(cluster.flops_per_s)
