"""The unique ids of one table in a batch, grouped by the rank that owns them (no communication)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Buckets:
    """`unique`: the batch's distinct ids (sorted); `inverse`: each id's index in `unique`;
    `order`: indices into `unique` grouped by owner rank (stable); `counts[r]`: how many go to rank r;
    `local_rows`: unique[order] as row numbers inside their owner's shard."""

    unique: torch.Tensor
    inverse: torch.Tensor
    order: torch.Tensor
    counts: torch.Tensor
    local_rows: torch.Tensor


def owners(ids: torch.Tensor, bounds: tuple[int, ...]) -> torch.Tensor:
    """Owner rank of every id: the last rank whose range starts at or before it (see placement.py)."""
    starts = torch.tensor(bounds[:-1], dtype=torch.int64)
    return torch.searchsorted(starts, ids, right=True) - 1


def bucket(ids: torch.Tensor, bounds: tuple[int, ...]) -> Buckets:
    """Each distinct id is requested once, from its owner, however often the batch repeats it."""
    world_size = len(bounds) - 1
    unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    owner = owners(unique, bounds)
    order = torch.argsort(owner, stable=True)
    starts = torch.tensor(bounds[:-1], dtype=torch.int64)
    local_rows = unique[order] - starts[owner[order]]
    counts = torch.bincount(owner, minlength=world_size)
    return Buckets(unique, inverse, order, counts, local_rows)
