"""ShardedEmbeddingTraining: one training step of a recommender model with its embedding tables
sharded over the ranks and everything else data parallel (Persia's split, TorchRec's layout).

The model is any nn.Module holding one EmbeddingBagCollection (see dlrm.py). Given a factory, the
model is built under deferred_tables(), so its tables are meta tensors and no rank ever holds one
whole; the collection is then sharded (ShardedEmbeddingBags over the same tables, the same initial
rows) and the dense parameters are broadcast from rank 0, so every rank starts as a single process
would. A step, on every rank with its own batch:

    forward (lookups by all-to-all) -> loss_fn(output, labels) (mean over the local batch) ->
    backward -> the touched rows' gradients to their owners, summed / W, sparse optimizer there ->
    dense gradients averaged (one allreduce, op avg) -> dense optimizer step

which is the step of a single process on the global batch with the same optimizers (exact, up to
summation order), or with embedding updates up to `staleness` steps late (Persia's hybrid mode).

`replicated=True` keeps every table whole on every rank instead (ReplicatedEmbeddingBags: local
lookups, the whole tables' gradients allreduced): the same step, priced differently. `shardings`
overrides each named table's TableSpec.sharding ("row" / "table") before the placement is planned.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Mapping

import torch
from torch import nn

from sparkdl.comm.base import Communicator
from sparkdl.embeddings.collection import EmbeddingBagCollection, deferred_tables, find_collection
from sparkdl.embeddings.optimizers import SparseOptimizer
from sparkdl.embeddings.placement import TableSpec, plan_placement
from sparkdl.embeddings.replicated import ReplicatedEmbeddingBags
from sparkdl.embeddings.sharded import ShardedEmbeddingBags
from sparkdl.errors import ConfigError

__all__ = ["ShardedEmbeddingTraining"]

STATE_FORMAT = 1
DenseOptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[Any, Any], torch.Tensor]


def _build(model: "nn.Module | Callable[[], nn.Module]") -> nn.Module:
    if isinstance(model, nn.Module):
        return model
    if not callable(model):
        raise ConfigError(f"ShardedEmbeddingTraining got {type(model).__name__} as its model",
                          hint="pass an nn.Module or, so that no rank builds whole tables, a function "
                               "returning one")
    with deferred_tables():
        built = model()
    if not isinstance(built, nn.Module):
        raise ConfigError(f"the model factory returned {type(built).__name__}, not an nn.Module",
                          hint="return the model from the factory")
    return built


def with_shardings(tables: tuple[TableSpec, ...], shardings: Mapping[str, str] | None) -> tuple[TableSpec, ...]:
    """`tables` with the sharding of each table `shardings` names replaced (TableSpec checks the value)."""
    if not shardings:
        return tables
    if not isinstance(shardings, Mapping):
        raise ConfigError(f"shardings must map table names to 'row' or 'table', not {type(shardings).__name__}",
                          hint="e.g. shardings={'user': 'row', 'country': 'table'}")
    unknown = sorted(set(shardings) - {s.name for s in tables}, key=str)
    if unknown:
        raise ConfigError(f"shardings names embedding tables the model does not hold: {', '.join(map(str, unknown))}",
                          hint=f"its tables are {', '.join(s.name for s in tables)}")
    return tuple(dataclasses.replace(s, sharding=shardings[s.name]) if s.name in shardings else s for s in tables)


def adopt_rows(collection: EmbeddingBagCollection, bags: Any) -> None:
    """A model given with whole tables (pretrained, warm-started) starts from them, not from the
    seed's rows: each rank copies the rows it holds (replicated: every row)."""
    rank = bags.comm.rank
    with torch.no_grad():
        for t, spec in enumerate(collection.tables):
            weight, shard = collection.weights[t], bags.shards[t]
            start, stop = (0, spec.num_rows) if shard.shape[0] == spec.num_rows else \
                bags.placement.rows_of(spec.name, rank)
            shard.copy_(weight.detach()[start:stop].to(shard.dtype))


class ShardedEmbeddingTraining:
    """`model`: an nn.Module or a zero-argument factory (preferred: tables never built whole) whose
    forward takes (dense, sparse); `dense_optimizer_factory(params)`: a torch optimizer over the dense
    parameters; `table_optimizer`: RowwiseAdagrad or SparseAdam; `loss_fn(output, labels)`: the mean
    over the local batch. `replicated`: every table whole on every rank (ReplicatedEmbeddingBags);
    `shardings`: {table name: "row" | "table"} over the specs' own sharding (sharded placement)."""

    def __init__(self, comm: Communicator, model: "nn.Module | Callable[[], nn.Module]",
                 dense_optimizer_factory: DenseOptimizerFactory, table_optimizer: SparseOptimizer,
                 loss_fn: LossFn, staleness: int = 0, replicated: bool = False,
                 shardings: Mapping[str, str] | None = None) -> None:
        if not callable(dense_optimizer_factory) or not callable(loss_fn):
            raise ConfigError("ShardedEmbeddingTraining needs callables for dense_optimizer_factory and loss_fn",
                              hint="e.g. lambda params: torch.optim.Adam(params, lr=1e-3) and "
                                   "nn.BCEWithLogitsLoss()")
        self.comm, self.loss_fn = comm, loss_fn
        self.model = _build(model)
        self.collection: EmbeddingBagCollection = find_collection(self.model)
        if self.collection.sharded is not None:
            raise ConfigError("the model's EmbeddingBagCollection is sharded already",
                              hint="build a fresh model (or pass a factory) for each ShardedEmbeddingTraining")
        placement = plan_placement(with_shardings(self.collection.tables, shardings), comm.size)
        self.bags: ShardedEmbeddingBags | ReplicatedEmbeddingBags
        if replicated:
            self.bags = ReplicatedEmbeddingBags(comm, placement, table_optimizer, staleness=staleness,
                                                seed=self.collection.seed)
        else:
            self.bags = ShardedEmbeddingBags(comm, placement, table_optimizer, staleness=staleness,
                                             seed=self.collection.seed)
        if self.collection.is_materialized:
            adopt_rows(self.collection, self.bags)
        self.collection.shard(self.bags)
        deferred = [name for name, p in self.model.named_parameters() if p.is_meta]
        if deferred:
            raise ConfigError(f"dense parameters {', '.join(deferred[:3])} are meta tensors",
                              hint="build only EmbeddingBagCollection tables deferred; dense layers need values")
        self.dense_params = [p for p in self.model.parameters() if p.requires_grad]
        self._broadcast_dense()
        optimizer = dense_optimizer_factory(self.dense_params)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"dense_optimizer_factory returned {type(optimizer).__name__}",
                              hint="return a torch.optim.Optimizer over the parameters it is given")
        self.dense_optimizer = optimizer
        self.steps = 0

    @property
    def tables(self) -> tuple[TableSpec, ...]:
        return self.collection.tables

    def _broadcast_dense(self) -> None:
        """Rank 0's dense parameters and buffers everywhere (as DDP does at construction)."""
        with torch.no_grad():
            for tensor in list(self.model.parameters()) + list(self.model.buffers()):
                self.comm.broadcast(tensor.data, src=0)

    def train_step(self, dense: Any, sparse: Mapping[str, Any], labels: Any) -> torch.Tensor:
        """One synchronous step on this rank's batch (every rank calls it together); returns the local loss."""
        self.model.train()
        self.dense_optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(dense, sparse), labels)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ConfigError("loss_fn must return a scalar tensor (the mean over the local batch)",
                              hint="reduce the loss with .mean()")
        loss.backward()
        self.bags.apply_gradients()
        self.average_dense_gradients()
        self.dense_optimizer.step()
        self.steps += 1
        return loss.detach()

    def average_dense_gradients(self) -> None:
        """One allreduce (avg) of every dense gradient, with one flag per parameter: a parameter no
        rank had a gradient for keeps none (as in one process); a rank without one adds zeros."""
        params = self.dense_params
        if not params:
            return
        dtype = params[0].dtype
        for param in params[1:]:
            dtype = torch.promote_types(dtype, param.dtype)
        flags = torch.tensor([float(p.grad is not None) for p in params], dtype=dtype)
        flat = torch.cat([p.grad.detach().reshape(-1).to(dtype) if p.grad is not None
                          else torch.zeros(p.numel(), dtype=dtype) for p in params] + [flags])
        self.comm.allreduce(flat, op="avg")
        pieces = torch.split(flat, [p.numel() for p in params] + [len(params)])
        for param, piece, flag in zip(params, pieces, pieces[-1].tolist()):
            if flag > 0:
                param.grad = piece.view_as(param).to(param.dtype).clone()

    def predict(self, dense: Any, sparse: Mapping[str, Any]) -> Any:
        """The model's output without training (lookups only; every rank calls it together)."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                return self.model(dense, sparse)
        finally:
            self.model.train(was_training)

    def flush(self) -> None:
        """Apply every queued embedding update now (staleness > 0: before evaluating or saving)."""
        self.bags.flush()

    def state(self) -> dict[str, Any]:
        """What a checkpoint writes on this rank: the dense model and optimizer (the same on every
        rank; one rank's copy suffices) and this rank's table shards with their optimizer state."""
        return {"format": STATE_FORMAT, "steps": self.steps,
                "dense": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
                # state_dict() holds the live moment tensors, which later steps update in place.
                "dense_optimizer": copy.deepcopy(self.dense_optimizer.state_dict()),
                "tables": self.bags.shard_state()}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore state() of the same rank under the same placement."""
        if state.get("format") != STATE_FORMAT:
            raise ConfigError(f"the training state has format {state.get('format')!r}, not {STATE_FORMAT}",
                              hint="resume with the sparkdl version that saved it")
        self.model.load_state_dict(state["dense"])
        self.dense_optimizer.load_state_dict(state["dense_optimizer"])
        self.bags.load_shard_state(state["tables"])
        self.steps = int(state["steps"])

    def full_tables(self) -> dict[str, torch.Tensor]:
        """Every table whole, on every rank (a collective; for tests and small tables only)."""
        return {s.name: self._gather(s, self.bags.local_weight(s.name)) for s in self.tables}

    def full_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every table's optimizer state whole (row-shaped tensors gathered; scalars as on this rank)."""
        return {spec.name: {key: self._gather(spec, value) if value.dim() else value.clone()
                            for key, value in sorted(self.bags.states[t].items())}
                for t, spec in enumerate(self.tables)}

    def _gather(self, spec: TableSpec, local: torch.Tensor) -> torch.Tensor:
        bounds = self.bags.placement.bounds[self.bags.placement.index(spec.name)]
        sizes = [bounds[r + 1] - bounds[r] for r in range(self.comm.size)]
        padded = torch.zeros(max(sizes), *local.shape[1:], dtype=local.dtype)
        padded[: local.shape[0]] = local
        parts = self.comm.allgather(padded)
        return torch.cat([part[:n] for part, n in zip(parts, sizes)])
