"""A built-in DLRM (Naumov et al., 2019): the model shape recommender users know, and the example of
how to write one's own.

    dense [B, dense_features] -> bottom MLP -> x [B, d]
    sparse {table: Bag}       -> EmbeddingBagCollection -> e_1..e_T [B, d] (every table d wide)
    interaction: the pairwise dot products <v_i, v_j> (i > j) of v = (x, e_1, ..., e_T), beside x
    -> top MLP -> one logit per sample [B] (train with BCEWithLogitsLoss)

Writing another model (wide-and-deep, two-tower, ...): any nn.Module that holds exactly one
EmbeddingBagCollection (every table, shared by the towers that use it) and calls it in its forward
with the batch's {table name: Bag}, taking `(dense, sparse)`:

    class TwoTower(nn.Module):
        def __init__(self, tables):
            super().__init__()
            self.embeddings = EmbeddingBagCollection(tables)
            self.user, self.item = nn.Linear(16, 8), nn.Linear(16, 8)
        def forward(self, dense, sparse):
            e = self.embeddings(sparse)
            return (self.user(e["user"]) * self.item(e["item"])).sum(1)

Replicated, such a model trains like any module; ShardedEmbeddingTraining shards its collection over
the ranks (tables never whole on a rank) and keeps everything else data parallel.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import nn

from sparkdl.embeddings.collection import EmbeddingBagCollection
from sparkdl.embeddings.placement import TableSpec
from sparkdl.errors import ConfigError

__all__ = ["DLRM", "dot_interaction"]


def _mlp(sizes: Sequence[int], relu_last: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(fan_in, fan_out))
        if relu_last or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _check_sizes(option: str, sizes: Sequence[int], allow_empty: bool) -> tuple[int, ...]:
    values = tuple(sizes) if isinstance(sizes, (list, tuple)) else None
    if values is None or (not values and not allow_empty) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values):
        raise ConfigError(f"DLRM: {option}={sizes!r} is not a list of positive layer widths",
                          hint=f"e.g. {option}=[64, 16]" + ("" if allow_empty else " (at least one layer)"))
    return values


def dot_interaction(features: torch.Tensor) -> torch.Tensor:
    """[B, F, d] -> [B, F(F-1)/2]: <v_i, v_j> for every pair i > j (row-major lower triangle)."""
    products = torch.bmm(features, features.transpose(1, 2))
    rows, cols = torch.tril_indices(features.shape[1], features.shape[1], offset=-1)
    return products[:, rows, cols]


class DLRM(nn.Module):
    """DLRM over `dense_features` dense inputs and `tables` (all as wide as bottom[-1]). `bottom`:
    the bottom MLP's widths; `top`: the top MLP's hidden widths (a last layer to one logit is added).
    `seed`, `sparse_grad`, `features`: the collection's (initial rows; sparse table gradients in
    replicated use; {categorical column: table} when columns share a table or are named otherwise)."""

    def __init__(self, dense_features: int, tables: Sequence[TableSpec], bottom: Sequence[int],
                 top: Sequence[int], seed: int = 0, sparse_grad: bool = False,
                 features: Mapping[str, str] | None = None) -> None:
        super().__init__()
        if isinstance(dense_features, bool) or not isinstance(dense_features, int) or dense_features < 1:
            raise ConfigError(f"DLRM: dense_features={dense_features!r} is not a positive integer",
                              hint="pass the number of dense input columns")
        bottom_sizes = _check_sizes("bottom", bottom, allow_empty=False)
        top_sizes = _check_sizes("top", top, allow_empty=True)
        specs = tuple(tables)
        width = bottom_sizes[-1]
        narrow = [f"{s.name} (dim {s.dim})" for s in specs if isinstance(s, TableSpec) and s.dim != width]
        if narrow:
            raise ConfigError(f"DLRM: the dot interaction needs every table {width} wide (bottom[-1]); "
                              f"not {', '.join(narrow)}",
                              hint="give every TableSpec dim=bottom[-1]")
        self.bottom = _mlp((dense_features, *bottom_sizes), relu_last=True)
        self.embeddings = EmbeddingBagCollection(specs, seed=seed, sparse_grad=sparse_grad, features=features)
        count = 1 + len(self.embeddings.feature_names)
        self.top = _mlp((width + count * (count - 1) // 2, *top_sizes, 1), relu_last=False)

    def forward(self, dense: torch.Tensor, sparse: Mapping[str, Any]) -> torch.Tensor:
        x = self.bottom(dense)
        pooled = self.embeddings(sparse)
        names = self.embeddings.feature_names
        missing = [n for n in names if n not in pooled]
        if missing:
            raise ConfigError(f"DLRM: the batch has no ids for {', '.join(missing)}",
                              hint="pass a Bag for every table (or declared feature; empty bags are fine)")
        features = torch.stack([x] + [pooled[n] for n in names], dim=1)
        return self.top(torch.cat([x, dot_interaction(features)], dim=1)).squeeze(1)
