"""EmbeddingBagCollection: the embedding tables of a user's model, as one nn.Module.

A model holds one collection and calls it with its batch's categorical inputs:
`collection(sparse)` maps {table name: Bag} to {table name: pooled [B, dim]} (only the tables given).
Used alone (one process, or replicated data parallel) it holds every table whole, initialised with
`initial_rows` (the same rows ShardedEmbeddingBags draws shard by shard, so both start equal).

Built inside `deferred_tables()` (or with materialize=False) its tables are meta tensors: no memory,
no initial values. ShardedEmbeddingTraining builds the user's model that way and then `shard()`s the
collection: its lookups become a ShardedEmbeddingBags over the same tables, the table parameters
leave the module (model.parameters() is then the dense part alone), and no rank ever holds a whole
table. Tables are kept in a ParameterList in spec order (state_dict keys `weights.<i>`), so table
names need not be valid attribute names.
"""
from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from sparkdl.embeddings.bags import Bag, as_bag, concat_bags
from sparkdl.embeddings.placement import TableSpec, plan_placement
from sparkdl.embeddings.sharded import initial_rows
from sparkdl.errors import ConfigError, SparkdlError

if TYPE_CHECKING:
    from sparkdl.embeddings.replicated import ReplicatedEmbeddingBags
    from sparkdl.embeddings.sharded import ShardedEmbeddingBags

__all__ = ["EmbeddingBagCollection", "deferred_tables", "probing_tables"]

_DEFERRED = threading.local()


@contextlib.contextmanager
def deferred_tables() -> Iterator[None]:
    """Collections built inside hold their tables as meta tensors (shapes only, no memory)."""
    depth = getattr(_DEFERRED, "depth", 0)
    _DEFERRED.depth = depth + 1
    try:
        yield
    finally:
        _DEFERRED.depth = depth


def _deferring() -> bool:
    return getattr(_DEFERRED, "depth", 0) > 0


@contextlib.contextmanager
def probing_tables() -> Iterator[None]:
    """Inside, a deferred table's lookups give zeros of the right shape (the driver probes a model
    whose tables it never holds)."""
    depth = getattr(_DEFERRED, "probing", 0)
    _DEFERRED.probing = depth + 1
    try:
        yield
    finally:
        _DEFERRED.probing = depth


def _probing() -> bool:
    return getattr(_DEFERRED, "probing", 0) > 0


class EmbeddingBagCollection(nn.Module):
    """Pooled lookups in several tables. `seed` picks the initial rows (initial_rows(spec, ..., seed));
    `sparse_grad`: the whole tables get sparse gradients (for torch.optim.SparseAdam / SGD in
    replicated use); `materialize=False`: tables stay meta tensors until materialize() or shard()."""

    def __init__(self, tables: Sequence[TableSpec], seed: int = 0, sparse_grad: bool = False,
                 materialize: bool = True, features: Mapping[str, str] | None = None) -> None:
        super().__init__()
        specs = tuple(tables)
        plan_placement(specs, 1)  # the same checks as sharding: TableSpec objects, distinct names
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"EmbeddingBagCollection: seed={seed!r} is not an integer",
                              hint="pass an int (every rank must use the same one)")
        self.tables = specs
        self.features: dict[str, str] = {}
        if features:
            self.bind_features(features)
        self.seed = seed
        self.sparse_grad = bool(sparse_grad)
        self.sharded: ShardedEmbeddingBags | ReplicatedEmbeddingBags | None = None
        deferred = _deferring() or not materialize
        self.weights = nn.ParameterList(
            [nn.Parameter(torch.empty(s.num_rows, s.dim, device="meta")) if deferred
             else nn.Parameter(initial_rows(s, 0, s.num_rows, seed=seed)) for s in specs])

    @property
    def is_materialized(self) -> bool:
        """Every table is held whole in memory (False when deferred or sharded)."""
        return self.sharded is None and all(not w.is_meta for w in self.weights) and len(self.weights) > 0

    def materialize(self) -> None:
        """Give deferred tables their initial rows (replicated use of a collection built deferred)."""
        if self.sharded is not None:
            raise SparkdlError("this EmbeddingBagCollection is sharded: its tables are not held here",
                               hint="gather them with ShardedEmbeddingTraining.full_tables() (small tables only)")
        for i, spec in enumerate(self.tables):
            if self.weights[i].is_meta:
                self.weights[i] = nn.Parameter(initial_rows(spec, 0, spec.num_rows, seed=self.seed))

    def shard(self, bags: "ShardedEmbeddingBags | ReplicatedEmbeddingBags") -> None:
        """Look rows up through `bags` (which must hold these tables: their sharding may differ) and
        drop the local tables."""
        def shape(specs: Sequence[TableSpec]) -> list[tuple[str, int, int, str]]:
            return [(s.name, s.num_rows, s.dim, s.pooling) for s in specs]

        if shape(bags.placement.tables) != shape(self.tables):
            raise ConfigError("the sharded embedding bags hold other tables than this collection",
                              hint="plan the placement from the collection's own tables")
        self.sharded = bags
        self.weights = nn.ParameterList()

    @property
    def feature_names(self) -> tuple[str, ...]:
        """The names a batch's lookups go by, in a fixed order: the declared features, else the tables."""
        return tuple(self.features) if self.features else tuple(s.name for s in self.tables)

    def bind_features(self, features: Mapping[str, str]) -> None:
        """Name the inputs that look rows up: {feature (a categorical column): table}. Several features
        may share a table; each gets its own pooled output. Adds to earlier bindings, never changes one."""
        names = {s.name for s in self.tables}
        for feature, table in dict(features).items():
            if table not in names:
                raise ConfigError(f"feature {feature!r} looks up table {table!r}, which the model's "
                                  f"EmbeddingBagCollection does not hold",
                                  hint=f"its tables are {', '.join(sorted(names))}: declare {table!r} there "
                                       "(a TableSpec) or point the feature at one of them")
            if feature in names and feature != table:
                raise ConfigError(f"feature {feature!r} is also the name of another table",
                                  hint="name a feature after its own table, or after no table")
            bound = self.features.get(feature)
            if bound is not None and bound != table:
                raise ConfigError(f"feature {feature!r} looks up table {bound!r} in the model but table "
                                  f"{table!r} in data.sparse_cols", hint="make the two agree")
            self.features[feature] = table

    def _by_table(self, sparse: Mapping[str, Any]) -> tuple[dict[str, Bag], dict[str, list[tuple[str, int]]]]:
        """The batch's bags grouped per table (features sharing a table looked up in one bag list) and,
        per table, which features' bags it holds in order, with their counts."""
        known = {s.name: s for s in self.tables}
        grouped: dict[str, list[tuple[str, Bag]]] = {}
        for key, value in sparse.items():
            table = self.features.get(key, key)
            if table not in known:
                raise ConfigError(f"the batch looks up {key!r}, which is neither a table nor a feature of the "
                                  "model's EmbeddingBagCollection",
                                  hint=f"use {', '.join(self.feature_names)}")
            grouped.setdefault(table, []).append((key, as_bag(known[table], value)))
        merged = {table: concat_bags([b for _, b in items]) for table, items in grouped.items()}
        parts = {table: [(key, bag.num_bags) for key, bag in items] for table, items in grouped.items()}
        return merged, parts

    def table(self, name: str) -> nn.Parameter:
        """The whole weight of table `name` (replicated use)."""
        for spec, weight in zip(self.tables, self.weights):
            if spec.name == name:
                return weight
        raise ConfigError(f"no embedding table is named {name!r}",
                          hint=f"use one of {', '.join(s.name for s in self.tables)}")

    def forward(self, sparse: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """{table or feature name: Bag or (ids, offsets[, weights])} -> {that name: pooled [B, dim]}
        for the names given."""
        if not isinstance(sparse, Mapping):
            raise ConfigError(f"the embedding lookups got {type(sparse).__name__}",
                              hint="pass a mapping {table name: Bag}")
        merged, parts = self._by_table(sparse)
        if self.sharded is not None:
            # Training lookups must be followed by apply_gradients (ShardedEmbeddingTraining does it).
            pooled = self.sharded.forward(merged, train=self.training and torch.is_grad_enabled())
        else:
            pooled = {spec.name: self._whole_lookup(i, merged[spec.name])
                      for i, spec in enumerate(self.tables) if spec.name in merged}
        out: dict[str, torch.Tensor] = {}
        for table, items in parts.items():
            for (key, _), piece in zip(items, torch.split(pooled[table], [n for _, n in items])):
                out[key] = piece
        return out

    def _whole_lookup(self, index: int, bag: Bag) -> torch.Tensor:
        spec, weight = self.tables[index], self.weights[index]
        if weight.is_meta:
            if _probing():  # the driver's probe of a deferred model: shapes, not values
                return torch.zeros(bag.num_bags, spec.dim)
            missing = getattr(self, "_unreachable", {}).get(index)
            if missing is not None:
                raise SparkdlError(f"embedding table {spec.name!r} is a file on the driver's host ({missing}) that "
                                   "this host cannot read",
                                   hint="save the model (TorchModel.save / MLflow) to storage every host reaches and "
                                        "score with the loaded model, or score where the driver's files are visible")
            raise SparkdlError(f"embedding table {spec.name!r} was built deferred and holds no rows",
                               hint="call materialize() for replicated use, or train the model with "
                                    "ShardedEmbeddingTraining")
        weights = bag.weights.to(weight.dtype) if bag.weights is not None else None
        return F.embedding_bag(bag.ids, weight, bag.offsets, mode=spec.pooling,
                               per_sample_weights=weights, sparse=self.sparse_grad)

    def __getstate__(self) -> dict[str, Any]:
        """A table backed by a file (embeddings/mapped.py) travels as its file's name, not its rows:
        scoring tasks that see the file map it; others get a meta tensor that loading fills."""
        from sparkdl.embeddings.mapped import mapped_path

        state = self.__dict__.copy()
        weights = state["_modules"].get("weights")
        paths = [mapped_path(w) for w in weights] if weights is not None else []
        if not any(paths):
            return state
        light = nn.ParameterList([nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), w.requires_grad)
                                  if p else w for w, p in zip(weights, paths)])
        state["_modules"] = {**state["_modules"], "weights": light}
        state["_mapped_tables"] = [(i, p, tuple(w.shape), str(w.dtype).removeprefix("torch."))
                                   for i, (w, p) in enumerate(zip(weights, paths)) if p]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        from sparkdl.embeddings.mapped import map_readonly

        mapped = state.pop("_mapped_tables", [])
        super().__setstate__(state)
        self._unreachable: dict[int, str] = {}
        for index, path, shape, dtype in mapped:
            table = map_readonly(path, shape, getattr(torch, dtype))
            if table is not None:
                self.weights[index] = nn.Parameter(table, requires_grad=False)
            else:  # loading the model's files fills it; scoring before that says where the rows were
                self._unreachable[index] = path

    def extra_repr(self) -> str:
        where = "sharded" if self.sharded is not None else ("whole" if self.is_materialized else "deferred")
        return f"{where}: " + ", ".join(f"{s.name}[{s.num_rows}x{s.dim}, {s.pooling}]" for s in self.tables)


def find_collection(model: nn.Module) -> EmbeddingBagCollection:
    """The one EmbeddingBagCollection inside `model`, refused when there is none or several."""
    found = [m for m in model.modules() if isinstance(m, EmbeddingBagCollection)]
    if len(found) != 1:
        raise ConfigError(f"the model holds {len(found)} EmbeddingBagCollection modules, not one",
                          hint="put every embedding table in one EmbeddingBagCollection (share it between "
                               "towers) and call it from the model's forward")
    return found[0]
