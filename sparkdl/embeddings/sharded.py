"""ShardedEmbeddingBags: each rank holds only its shards; a step looks up, by all-to-all, just the
distinct rows its batch touches, pools them locally, and after backward sends their gradients back to
the owners, which apply a sparse optimizer to those rows alone.

A step is `pooled = bags.forward(batch)`, the user's loss and `loss.backward()`, then
`bags.apply_gradients()` on every rank (the gradient exchange is a collective: it runs outside autograd
so that every rank calls it once per step in the same order, whatever its graph).

Data-parallel semantics: each rank's loss is the mean over its own batch and the dense part averages
its gradients over the W ranks, so owners sum the row gradients of all ranks and divide by W: the
gradient of the mean loss over the global batch, as a single process on the global batch computes it.

Bounded staleness (Persia's hybrid mode, opt-in): with staleness=tau the summed gradients of step t
wait in a queue and are applied after step t+tau's exchange, before the lookups of step t+tau+1; the
lookups in between read rows up to tau updates old. `max_lag` records the largest lag any lookup saw
(a lookup at step s while step t's gradients were still queued: lag s - t). tau=0 is synchronous.
The exchange itself still runs every step; overlapping it with the next step is left for later.
"""
from __future__ import annotations

import zlib
from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from sparkdl.comm.base import Communicator
from sparkdl.embeddings import exchange
from sparkdl.embeddings.bags import Bag, as_bag
from sparkdl.embeddings.bucketing import Buckets, bucket
from sparkdl.embeddings.late_updates import LateUpdates
from sparkdl.embeddings.optimizers import SparseOptimizer
from sparkdl.embeddings.placement import Placement, TableSpec
from sparkdl.errors import ConfigError, SparkdlError

__all__ = ["Bag", "ShardedEmbeddingBags", "initial_rows"]

INIT_BLOCK_ROWS = 4096
STATE_FORMAT = 1


def initial_rows(spec: TableSpec, start: int, stop: int, seed: int = 0) -> torch.Tensor:
    """Rows [start, stop) of the table's initial weights, the same whichever rank draws them: uniform in
    +-sqrt(1/num_rows) (TorchRec's default), drawn in blocks of INIT_BLOCK_ROWS rows, each block from a
    generator seeded by (seed, table name, block), so no rank ever materializes the whole table."""
    bound = (1.0 / spec.num_rows) ** 0.5
    name_key = zlib.crc32(spec.name.encode())
    parts = []
    for block in range(start // INIT_BLOCK_ROWS, (stop - 1) // INIT_BLOCK_ROWS + 1 if stop > start else 0):
        first = block * INIT_BLOCK_ROWS
        rows = min(INIT_BLOCK_ROWS, spec.num_rows - first)
        generator = torch.Generator().manual_seed(((seed * 1_000_003 + name_key) * 65_537 + block) % 2**63)
        values = torch.rand(rows, spec.dim, generator=generator) * (2 * bound) - bound
        parts.append(values[max(start - first, 0): stop - first])
    return torch.cat(parts) if parts else torch.empty(0, spec.dim)


@dataclass
class _Lookup:
    """What a training lookup leaves for apply_gradients."""

    step: int
    routes: exchange.Routes
    buckets: list[Buckets | None]
    leaves: list[torch.Tensor | None]
    requested: list[list[torch.Tensor]]  # [r][t]: local rows rank r asked this rank for


class ShardedEmbeddingBags(LateUpdates):
    """The tables of `placement`, this rank's shards only. `optimizer`: RowwiseAdagrad or SparseAdam."""

    def __init__(self, comm: Communicator, placement: Placement, optimizer: SparseOptimizer,
                 staleness: int = 0, seed: int = 0) -> None:
        self._check_arguments(placement, comm, staleness)
        self.comm, self.placement, self.optimizer, self.staleness = comm, placement, optimizer, staleness
        self.shards = [initial_rows(s, *placement.rows_of(s.name, comm.rank), seed=seed) for s in placement.tables]
        self.states = [optimizer.init_state(w) for w in self.shards]
        self.steps = 0  # training lookups so far
        self.max_lag = 0
        self.last_bytes: dict[str, int] = {}
        self._pending: deque[tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]] = deque()
        self._lookup: _Lookup | None = None
        self._dims = torch.tensor([s.dim for s in placement.tables], dtype=torch.int64)

    def forward(self, batch: Mapping[str, Any], train: bool = True) -> dict[str, torch.Tensor]:
        """name -> pooled [B, dim] for every table in `batch` (Bag or (ids, offsets[, weights])).
        Every rank calls it together, each with its own batch; tables may be missing on some ranks."""
        if self._lookup is not None:
            raise SparkdlError("ShardedEmbeddingBags.forward ran again before apply_gradients()",
                               hint="call apply_gradients() on every rank after loss.backward(), "
                                    "or pass train=False for lookups that do not train")
        unknown = sorted(set(batch) - {s.name for s in self.placement.tables})
        if unknown:
            raise ConfigError(f"the batch names embedding tables that do not exist: {', '.join(map(str, unknown))}",
                              hint=f"use {', '.join(s.name for s in self.placement.tables)}")
        if train:
            self._bound_staleness()
        bags = [as_bag(s, batch[s.name]) if s.name in batch else None for s in self.placement.tables]
        buckets = [bucket(b.ids, bounds) if b is not None else None for b, bounds in zip(bags, self.placement.bounds)]
        rows = self._fetch(buckets, train)
        pooled: dict[str, torch.Tensor] = {}
        leaves: list[torch.Tensor | None] = []
        for spec, bag, bk, got in zip(self.placement.tables, bags, buckets, rows):
            if bag is None or bk is None:
                leaves.append(None)
                continue
            leaf = got.requires_grad_(train)
            leaves.append(leaf)
            weights = bag.weights.to(leaf.dtype) if bag.weights is not None else None
            pooled[spec.name] = F.embedding_bag(bk.inverse, leaf, bag.offsets, mode=spec.pooling,
                                                per_sample_weights=weights)
        if train:
            assert self._lookup is not None
            self._lookup.buckets, self._lookup.leaves = buckets, leaves
            self.steps += 1
        return pooled

    __call__ = forward

    def _fetch(self, buckets: list[Buckets | None], train: bool) -> list[torch.Tensor | None]:
        """Each table's distinct rows in `unique` order, from their owners (two all-to-alls)."""
        world = self.comm.size
        empty = torch.zeros(world, dtype=torch.int64)
        sent = torch.stack([bk.counts if bk is not None else empty for bk in buckets], dim=1)
        routes = exchange.exchange_counts(self.comm, sent, self._dims)
        none = [torch.empty(0, dtype=torch.int64)] * world
        requests = [list(torch.split(bk.local_rows, bk.counts.tolist())) if bk is not None else none
                    for bk in buckets]
        by_rank = [[requests[t][r] for t in range(len(buckets))] for r in range(world)]
        requested = exchange.send_requests(self.comm, routes, by_rank)
        answers = [[self.shards[t][ids] for t, ids in enumerate(per_rank)] for per_rank in requested]
        dtype = self.shards[0].dtype
        got = exchange.return_rows(self.comm, routes, answers, dtype)
        rows: list[torch.Tensor | None] = []
        for t, bk in enumerate(buckets):
            if bk is None:
                rows.append(None)
                continue
            in_order = torch.empty(bk.unique.numel(), int(self._dims[t]), dtype=dtype)
            in_order[bk.order] = torch.cat([got[r][t] for r in range(world)])
            rows.append(in_order)
        if train:
            self._lookup = _Lookup(self.steps, routes, [], [], requested)
        self.last_bytes = exchange.step_bytes(self.comm.rank, routes, self.shards[0].element_size())
        if not train:
            self.last_bytes["gradients"] = 0
        return rows

    def apply_gradients(self) -> None:
        """After loss.backward() on every rank: the touched rows' gradients go to their owners, which
        apply (or, with staleness, queue) the optimizer step."""
        lookup, self._lookup = self._lookup, None
        if lookup is None:
            raise SparkdlError("apply_gradients() ran without a training lookup before it",
                               hint="call forward(batch) and loss.backward() first, once per step")
        world = self.comm.size
        grads: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for t, (bk, leaf) in enumerate(zip(lookup.buckets, lookup.leaves)):
            if bk is None or leaf is None:
                for r in range(world):
                    grads[r].append(torch.empty(0, int(self._dims[t])))
                continue
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            for r, chunk in enumerate(torch.split(grad.detach()[bk.order], bk.counts.tolist())):
                grads[r].append(chunk)
        got = exchange.send_gradients(self.comm, lookup.routes, grads, self.shards[0].dtype)
        updates = []
        for t in range(len(self.shards)):
            rows = torch.cat([lookup.requested[r][t] for r in range(world)])
            unique, inverse = torch.unique(rows, sorted=True, return_inverse=True)
            summed = torch.zeros(unique.numel(), int(self._dims[t]), dtype=self.shards[t].dtype)
            summed.index_add_(0, inverse, torch.cat([got[r][t] for r in range(world)]))
            updates.append((unique, summed.div_(world)))
        self._queue(lookup.step, updates)

    def local_weight(self, name: str) -> torch.Tensor:
        """This rank's rows of table `name` (rows_of(name) of the placement)."""
        return self.shards[self.placement.index(name)]

    def shard_state(self) -> dict[str, Any]:
        """This rank's shards, optimizer state and queued updates: what a checkpoint writes per rank."""
        tables = {}
        for spec, weight, state in zip(self.placement.tables, self.shards, self.states):
            start, stop = self.placement.rows_of(spec.name, self.comm.rank)
            tables[spec.name] = {"start": start, "stop": stop, "weight": weight.clone(),
                                 "optimizer": {k: v.clone() for k, v in state.items()}}
        pending = self._pending_state()
        return {"format": STATE_FORMAT, "rank": self.comm.rank, "world_size": self.comm.size,
                "steps": self.steps, "max_lag": self.max_lag, "tables": tables, "pending": pending}

    def load_shard_state(self, state: Mapping[str, Any]) -> None:
        """Restore what shard_state() returned on the same rank of the same placement."""
        if state.get("kind", "sharded") != "sharded":  # replicated.py's states say so
            raise SparkdlError(f"the embedding state was saved by a {state.get('kind')} run, but this run "
                               "shards its tables", hint="resume with the embeddings placement the checkpoint "
                                                         "was written under (sharded or replicated)")
        if state.get("format") != STATE_FORMAT or state.get("world_size") != self.comm.size \
                or state.get("rank") != self.comm.rank:
            raise SparkdlError(f"the embedding shard state is for rank {state.get('rank')} of "
                               f"{state.get('world_size')} (format {state.get('format')}), not rank "
                               f"{self.comm.rank} of {self.comm.size}",
                               hint="resume with the same number of ranks, each loading its own shard")
        for t, spec in enumerate(self.placement.tables):
            saved = state["tables"].get(spec.name)
            rows = self.placement.rows_of(spec.name, self.comm.rank)
            if saved is None or (saved["start"], saved["stop"]) != rows:
                raise SparkdlError(f"the embedding shard state does not hold rows {rows} of table {spec.name!r}",
                                   hint="resume with the placement the state was saved under")
            self.shards[t] = saved["weight"].clone()
            self.states[t] = {k: v.clone() for k, v in saved["optimizer"].items()}
        self._load_pending(state["pending"])
        self.steps, self.max_lag, self._lookup = int(state["steps"]), int(state["max_lag"]), None
