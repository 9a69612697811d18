"""ReplicatedEmbeddingBags: every rank holds every table whole; the twin of ShardedEmbeddingBags
(the same interface and attributes, a drop-in for ShardedEmbeddingTraining and strategy
"embeddings") for tables small enough that allreducing their whole gradient beats the all-to-alls.

Lookups are local: each table's distinct batch ids are gathered into a leaf (as sharded gathers the
rows it fetched), pooled with F.embedding_bag, and autograd fills that leaf's gradient. A step's
apply_gradients() then scatters every table's leaf gradient into a dense [num_rows, dim] buffer and
allreduces all of them at once with one "touched on some rank" flag per row: the whole tables'
gradients every step (the cost planner/embeddings.py `replicated` prices). The rows some rank
touched (flag > 0) get the sparse optimizer's update with the summed gradient / W, so a row looked
up with an exactly zero gradient still moves (SparseAdam's moments decay on it), exactly as the
sharded owners update every requested row: both equal one process on the global batch.

Bounded staleness is the sharded queue's: step t's update is applied after step t+tau's allreduce,
before the lookups of step t+tau+1; `max_lag` records the largest lag a lookup saw.

`placement` describes the tables as whole on rank 0 (placement.whole_on), so code that reads a
rank's own rows (rows_of) takes every table from rank 0 once, while `shards[t]` is the whole table
on every rank.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F

from sparkdl.comm.base import Communicator
from sparkdl.embeddings.bags import as_bag
from sparkdl.embeddings.late_updates import LateUpdates
from sparkdl.embeddings.optimizers import SparseOptimizer
from sparkdl.embeddings.placement import Placement, TableSpec, plan_placement, whole_on
from sparkdl.embeddings.sharded import initial_rows
from sparkdl.errors import ConfigError, SparkdlError

__all__ = ["ReplicatedEmbeddingBags", "replicated_placement"]

STATE_FORMAT = 1
STATE_KIND = "replicated"  # a sharded state has no "kind"

Updates = list[tuple[torch.Tensor, torch.Tensor]]  # per table: (distinct rows, their gradients)


def replicated_placement(tables: Sequence[TableSpec], world_size: int) -> Placement:
    """Every table whole on rank 0 (the other ranks' ranges empty): what a replicated run reports
    as its placement, so each row is named once."""
    specs = plan_placement(tuple(tables), world_size).tables  # the same checks as sharding
    return Placement(world_size=world_size, tables=specs,
                     bounds=tuple(whole_on(0, s.num_rows, world_size) for s in specs))


@dataclass
class _Lookup:
    """What a training lookup leaves for apply_gradients: per table, its distinct ids and the leaf
    holding their rows (None where this rank's batch skipped the table)."""

    step: int
    unique: list[torch.Tensor | None]
    leaves: list[torch.Tensor | None]


def ring_bytes(nbytes: int, world: int) -> int:
    """What one rank sends in a ring allreduce of `nbytes` (as Communicator counts it)."""
    return 2 * (world - 1) * nbytes // world if world > 1 else 0


class ReplicatedEmbeddingBags(LateUpdates):
    """Every table of `placement` whole on every rank. `placement` names the tables (any placement
    of them over comm.size ranks); `optimizer`: RowwiseAdagrad or SparseAdam."""

    def __init__(self, comm: Communicator, placement: Placement, optimizer: SparseOptimizer,
                 staleness: int = 0, seed: int = 0) -> None:
        self._check_arguments(placement, comm, staleness)
        self.comm, self.optimizer, self.staleness = comm, optimizer, staleness
        self.placement = replicated_placement(placement.tables, comm.size)
        self.shards = [initial_rows(s, 0, s.num_rows, seed=seed) for s in self.placement.tables]
        self.states = [optimizer.init_state(w) for w in self.shards]
        self.steps = 0  # training lookups so far
        self.max_lag = 0
        self.last_bytes: dict[str, int] = {}
        self._pending: deque[tuple[int, Updates]] = deque()
        self._lookup: _Lookup | None = None

    def forward(self, batch: Mapping[str, Any], train: bool = True) -> dict[str, torch.Tensor]:
        """name -> pooled [B, dim] for every table in `batch` (Bag or (ids, offsets[, weights])).
        The lookups are local; a training lookup must be followed by apply_gradients() on every rank."""
        if self._lookup is not None:
            raise SparkdlError("ReplicatedEmbeddingBags.forward ran again before apply_gradients()",
                               hint="call apply_gradients() on every rank after loss.backward(), "
                                    "or pass train=False for lookups that do not train")
        tables = self.placement.tables
        unknown = sorted(set(batch) - {s.name for s in tables})
        if unknown:
            raise ConfigError(f"the batch names embedding tables that do not exist: {', '.join(map(str, unknown))}",
                              hint=f"use {', '.join(s.name for s in tables)}")
        if train:
            self._bound_staleness()
        pooled: dict[str, torch.Tensor] = {}
        uniques: list[torch.Tensor | None] = []
        leaves: list[torch.Tensor | None] = []
        for spec, weight in zip(tables, self.shards):
            if spec.name not in batch:
                uniques.append(None)
                leaves.append(None)
                continue
            bag = as_bag(spec, batch[spec.name])
            unique, inverse = torch.unique(bag.ids, sorted=True, return_inverse=True)
            # A copy, so that later in-place optimizer steps never touch a tensor autograd saved.
            leaf = weight[unique].requires_grad_(train)
            uniques.append(unique)
            leaves.append(leaf)
            weights = bag.weights.to(leaf.dtype) if bag.weights is not None else None
            pooled[spec.name] = F.embedding_bag(inverse, leaf, bag.offsets, mode=spec.pooling,
                                                per_sample_weights=weights)
        self.last_bytes = self._step_bytes(train)
        if train:
            self._lookup = _Lookup(self.steps, uniques, leaves)
            self.steps += 1
        return pooled

    __call__ = forward

    def _step_bytes(self, train: bool) -> dict[str, int]:
        """Bytes this rank sends in a step, in sharded's keys: no ids or rows travel (lookups are
        local); the gradients and the touched flags of every row of every table are allreduced."""
        size = self.shards[0].element_size()
        rows = sum(s.num_rows for s in self.placement.tables)
        floats = sum(s.num_rows * s.dim for s in self.placement.tables)
        world = self.comm.size
        touched = ring_bytes(rows * size, world) if train else 0
        total = ring_bytes((floats + rows) * size, world) if train else 0
        return {"counts": 0, "ids": 0, "rows": 0, "gradients": total - touched, "touched": touched}

    def apply_gradients(self) -> None:
        """After loss.backward() on every rank: one allreduce of every table's whole gradient and
        touched flags; the touched rows' summed gradients / W go to the optimizer (or its queue)."""
        lookup, self._lookup = self._lookup, None
        if lookup is None:
            raise SparkdlError("apply_gradients() ran without a training lookup before it",
                               hint="call forward(batch) and loss.backward() first, once per step")
        tables, dtype = self.placement.tables, self.shards[0].dtype
        sizes = [s.num_rows * s.dim for s in tables] + [s.num_rows for s in tables]
        flat = torch.zeros(sum(sizes), dtype=dtype)
        pieces = torch.split(flat, sizes)
        grads = [p.view(s.num_rows, s.dim) for p, s in zip(pieces, tables)]
        flags = pieces[len(tables):]
        for t, (unique, leaf) in enumerate(zip(lookup.unique, lookup.leaves)):
            if unique is None or leaf is None:
                continue
            if leaf.grad is not None:
                grads[t].index_copy_(0, unique, leaf.grad.detach().to(dtype))
            flags[t][unique] = 1  # touched here, whether or not its gradient is zero
        self.comm.allreduce(flat, op="sum")
        world = self.comm.size
        updates: Updates = []
        for grad, flag in zip(grads, flags):
            rows = torch.nonzero(flag > 0).reshape(-1)
            updates.append((rows, grad[rows].div_(world)))
        self._queue(lookup.step, updates)

    def local_weight(self, name: str) -> torch.Tensor:
        """Table `name` whole (every rank holds it)."""
        return self.shards[self.placement.index(name)]

    def shard_state(self) -> dict[str, Any]:
        """The tables, their optimizer state and queued updates: the same on every rank, so any
        rank's copy resumes every rank."""
        tables = {spec.name: {"start": 0, "stop": spec.num_rows, "weight": weight.clone(),
                              "optimizer": {k: v.clone() for k, v in state.items()}}
                  for spec, weight, state in zip(self.placement.tables, self.shards, self.states)}
        pending = self._pending_state()
        return {"format": STATE_FORMAT, "kind": STATE_KIND, "rank": self.comm.rank,
                "world_size": self.comm.size, "steps": self.steps, "max_lag": self.max_lag,
                "tables": tables, "pending": pending}

    def load_shard_state(self, state: Mapping[str, Any]) -> None:
        """Restore what shard_state() returned (on any rank) for the same tables."""
        kind = state.get("kind", "sharded")
        if kind != STATE_KIND or state.get("format") != STATE_FORMAT:
            raise SparkdlError(f"the embedding state was saved by a {kind} run (format {state.get('format')}), "
                               "but this run replicates its tables",
                               hint="resume with the embeddings placement the checkpoint was written "
                                    "under (sharded or replicated), or start the run afresh")
        for spec in self.placement.tables:
            saved = state["tables"].get(spec.name)
            if saved is None or (saved["start"], saved["stop"]) != (0, spec.num_rows) \
                    or tuple(saved["weight"].shape) != (spec.num_rows, spec.dim):
                raise SparkdlError(f"the embedding state does not hold table {spec.name!r} whole "
                                   f"({spec.num_rows} x {spec.dim})",
                                   hint="resume with the tables the state was saved with")
        for t, spec in enumerate(self.placement.tables):
            saved = state["tables"][spec.name]
            self.shards[t] = saved["weight"].clone()
            self.states[t] = {k: v.clone() for k, v in saved["optimizer"].items()}
        self._load_pending(state["pending"])
        self.steps, self.max_lag, self._lookup = int(state["steps"]), int(state["max_lag"]), None
