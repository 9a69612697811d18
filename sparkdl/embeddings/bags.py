"""One table's share of a batch (ids, bag offsets, optional per-id weights), checked before any exchange."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sparkdl.embeddings.placement import TableSpec
from sparkdl.errors import ConfigError, SparkdlError


@dataclass(frozen=True)
class Bag:
    """B bags over N ids: bag b holds ids[offsets[b]:offsets[b+1]] (the last up to N), as
    nn.EmbeddingBag's offsets. `weights`: one float per id (sum pooling only) or None."""

    ids: torch.Tensor
    offsets: torch.Tensor
    weights: torch.Tensor | None = None

    @classmethod
    def from_lengths(cls, ids: torch.Tensor, lengths: torch.Tensor,
                     weights: torch.Tensor | None = None) -> "Bag":
        """Bags given by their lengths (B values summing to N): the multi-hot column's array sizes."""
        lengths = torch.as_tensor(lengths, dtype=torch.int64)
        offsets = torch.zeros_like(lengths)
        if lengths.numel() > 1:
            offsets[1:] = torch.cumsum(lengths[:-1], 0)
        return cls(ids, offsets, weights)

    @property
    def num_bags(self) -> int:
        return int(self.offsets.numel())

    def to(self, device: Any, non_blocking: bool = False) -> "Bag":
        """This bag on `device` (the strategies move batches with .to, as they move tensors)."""
        weights = self.weights.to(device, non_blocking=non_blocking) if self.weights is not None else None
        return Bag(self.ids.to(device, non_blocking=non_blocking),
                   self.offsets.to(device, non_blocking=non_blocking), weights)


def as_bag(spec: TableSpec, value: Any) -> Bag:
    """A Bag from a Bag or an (ids, offsets[, weights]) tuple, refused with the table's name when the
    ids or offsets cannot be looked up."""
    if not isinstance(value, Bag):
        if not isinstance(value, (tuple, list)) or len(value) not in (2, 3):
            raise ConfigError(f"embedding table {spec.name!r}: the batch holds {type(value).__name__}",
                              hint="pass a Bag or a tuple (ids, offsets) or (ids, offsets, per_sample_weights)")
        value = Bag(*value)
    where = f"embedding table {spec.name!r}"
    ids, offsets, weights = value.ids, value.offsets, value.weights
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
        raise ConfigError(f"{where}: ids must be a 1-D int64 tensor",
                          hint="convert with torch.as_tensor(ids, dtype=torch.int64)")
    if not isinstance(offsets, torch.Tensor) or offsets.dtype != torch.int64 or offsets.dim() != 1:
        raise ConfigError(f"{where}: offsets must be a 1-D int64 tensor (one start per bag)",
                          hint="build it with Bag.from_lengths(ids, lengths) from each row's array size")
    if offsets.numel() and (int(offsets[0]) != 0 or bool((offsets[1:] < offsets[:-1]).any())
                            or int(offsets[-1]) > ids.numel()):
        raise ConfigError(f"{where}: offsets must start at 0, never decrease and stay <= len(ids)",
                          hint="offsets[b] is where bag b starts in ids")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= spec.num_rows):
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        raise SparkdlError(f"{where}: id {bad} is outside [0, {spec.num_rows})",
                           hint="hash ids into the table's range or enlarge num_rows")
    if weights is not None:
        if spec.pooling != "sum":
            raise ConfigError(f"{where}: per-sample weights need sum pooling (pooling={spec.pooling!r})",
                              hint="use pooling='sum' or drop the weights")
        if not isinstance(weights, torch.Tensor) or not weights.is_floating_point() or weights.shape != ids.shape:
            raise ConfigError(f"{where}: per-sample weights must be a float tensor shaped like ids",
                              hint="give one weight per id")
    return value


def concat_bags(bags: "list[Bag]") -> Bag:
    """Several bag lists of one table as one (features sharing a table, looked up together): ids
    end to end, each list's offsets shifted by the ids before it; weights of 1 where a list has none."""
    if len(bags) == 1:
        return bags[0]
    shifts = torch.cumsum(torch.tensor([0] + [b.ids.numel() for b in bags[:-1]], dtype=torch.int64), 0)
    weighted = any(b.weights is not None for b in bags)
    weights = None
    if weighted:
        dtype = next(b.weights.dtype for b in bags if b.weights is not None)
        weights = torch.cat([b.weights if b.weights is not None else torch.ones(b.ids.numel(), dtype=dtype)
                             for b in bags])
    return Bag(torch.cat([b.ids for b in bags]),
               torch.cat([b.offsets + shift for b, shift in zip(bags, shifts.tolist())]), weights)
