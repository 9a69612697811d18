"""Islands (hierarchical DiLoCo): ranks grouped into islands of fast links (a rack, a zone) train
synchronous data parallel inside their island every step, and the islands sync as DiLoCo replicas
across the slow links between them (streamed and quantized like flat DiLoCo, strategies/diloco.py).

Across islands the outer average is sharded: with D the smallest island's size, the pseudo-gradient
is cut into D chunks and member j of every island averages chunk j with its counterparts (so D links
between islands carry 1/D of it each), then every island shares the averaged chunks over its own
fast links. Islands count by their size: the outer mean weights island i by D_i / W, so that with
H = 1 (outer lr 1, no momentum) the update is exactly data parallel's over all W ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from sparkdl.comm.base import Communicator
from sparkdl.strategies import low_precision


def island_ranks(groups: Sequence[Sequence[str]], hosts: Sequence[str], executors: Sequence[str] = ()
                 ) -> list[list[int]]:
    """The ranks of each island: rank r belongs to the group naming its executor (host:port) or its
    host. Every rank must belong to exactly one island, and every island must hold a rank."""
    islands: list[list[int]] = [[] for _ in groups]
    for rank, host in enumerate(hosts):
        names = {host} | ({executors[rank]} if rank < len(executors) else set())
        found = [i for i, group in enumerate(groups) if names & set(group)]
        if len(found) != 1:
            where = "no island" if not found else f"islands {found}"
            raise ValueError(f"rank {rank} on {sorted(names)} is in {where} of train.islands={list(map(list, groups))}")
        islands[found[0]].append(rank)
    empty = [list(group) for group, ranks in zip(groups, islands) if not ranks]
    if empty:
        raise ValueError(f"train.islands: no rank runs on {empty}")
    return islands


@dataclass
class IslandComms:
    """This rank's island and, if it takes part in the outer average, its group across islands."""

    island: Communicator  # data parallel every step, and the sharing of averaged chunks
    across: Communicator | None  # member j of every island, j < the smallest island's size
    shards: int  # D: the smallest island's size
    weight: float  # K x D_i / W: this island's share of the outer mean, times K


def island_comms(comm: Communicator, islands: list[list[int]]) -> IslandComms:
    """Every rank calls this with the same islands (torch makes every group on every rank)."""
    shards = min(len(members) for members in islands)
    island = comm.split(islands)
    across = comm.split([[members[j] for members in islands] for j in range(shards)])
    mine = next(members for members in islands if comm.rank in members)
    assert island is not None
    return IslandComms(island, across, shards, len(islands) * len(mine) / comm.size)


def average_across_islands(comms: IslandComms, delta: torch.Tensor, wire: str, residual: torch.Tensor | None
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The islands' mean pseudo-gradient (weighted by island size) on every rank of every island, and
    this rank's error-feedback residual (its chunk's)."""
    chunks = torch.tensor_split(delta.detach().reshape(-1).to(torch.float32), comms.shards)
    out = torch.empty(delta.numel(), dtype=torch.float32)
    pieces = torch.tensor_split(out, comms.shards)
    index = comms.island.rank
    if comms.across is not None and index < comms.shards:
        mean, residual = low_precision.average_with_feedback(comms.across, chunks[index] * comms.weight, wire,
                                                             residual)
        pieces[index].copy_(mean)
    for j in range(comms.shards):
        comms.island.broadcast(pieces[j], src=j)
    return out, residual
