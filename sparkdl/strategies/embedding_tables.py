"""strategy "embeddings": a recommender model with its embedding tables sharded over the ranks and
its dense layers data parallel (embeddings/hybrid_step.py does the step's collectives).

Each rank builds the model with deferred tables (meta tensors: no rank ever holds a table whole),
binds the run's categorical columns to their tables, and trains on its batches of
(dense, {column: Bag}). A step: forward (lookups by all-to-all) -> the run's loss (per-row weights
as data parallel weighs them) -> backward -> the touched rows' gradients to their owners, the sparse
optimizer there -> the dense gradients averaged -> the dense optimizer step (grad_clip and the lr
schedule apply to the dense layers). Synchronous, this is a single process's step on the global
batch; with staleness > 0 embedding updates land up to that many steps late.

Checkpoints hold each rank's shards (with their optimizer state and queued updates); the trained
model leaves each rank as its own rows of every table (`<table key>#rows=<start>`), which the driver
writes into its copy of the model piece by piece (model/trained.py).
"""
from __future__ import annotations

import time
from typing import Any, ContextManager, Iterable

import torch
from torch import nn

from sparkdl.comm.base import ALL_TO_ALL, ALLGATHER, ALLREDUCE, BROADCAST
from sparkdl.embeddings.collection import deferred_tables, find_collection
from sparkdl.embeddings.hybrid_step import ShardedEmbeddingTraining
from sparkdl.embeddings.optimizers import RowwiseAdagrad, SparseAdam, SparseOptimizer
from sparkdl.errors import ConfigError
from sparkdl.model.layouts import EmbeddingLayout
from sparkdl.model.trained import ROWS_MARK
from sparkdl.strategies.base import LossFn, OptimizerFactory, Strategy
from sparkdl.strategies.inputs import global_share, loss_and_weight_sum
from sparkdl.strategies.stepping import SINGLE, Accumulation, float_output



def table_optimizer(layout: EmbeddingLayout) -> SparseOptimizer:
    """The layout's sparse optimizer; 0 for lr or eps keeps the optimizer's default."""
    options = {k: v for k, v in (("lr", layout.lr), ("eps", layout.eps)) if v}
    if layout.optimizer == "adam":
        return SparseAdam(**options)
    return RowwiseAdagrad(**options)


class ShardedEmbeddings(Strategy):
    name = "embeddings"
    requires = frozenset({ALLREDUCE, BROADCAST, ALLGATHER, ALL_TO_ALL})

    def model_building(self) -> ContextManager[Any]:
        return deferred_tables()

    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory, loss_fn: LossFn) -> None:
        layout = self.layout
        if not isinstance(layout, EmbeddingLayout):
            raise ConfigError("strategy 'embeddings' needs its layout from the driver's plan",
                              hint="train through fit()/TorchEstimator with data.sparse_cols set")
        if torch.device(self.comm.device).type != "cpu":
            raise ConfigError(f"strategy 'embeddings' trains on CPU, but this rank got {self.comm.device}",
                              hint="run sparse_cols fits on CPU executors (launch.gpus_per_worker=0, no GPU "
                                   "resources in the Spark app) for now")
        collection = find_collection(model)
        collection.bind_features(dict(layout.features))
        self._loss_fn = loss_fn
        self.training = ShardedEmbeddingTraining(self.comm, model, make_optimizer, table_optimizer(layout),
                                                 loss_fn, staleness=layout.staleness, replicated=layout.replicated,
                                                 shardings=dict(layout.shardings) or None)
        self._optimizer = self.training.dense_optimizer
        self.steps.attach(self._optimizer)
        prefix = next(name for name, m in model.named_modules() if m is collection)
        self._table_keys = [f"{prefix + '.' if prefix else ''}weights.{i}" for i in range(len(collection.tables))]
        self._bytes = EpochBytes()

    def train_step(self, inputs: Any, labels: torch.Tensor, weights: torch.Tensor | None = None,
                   micro: Accumulation = SINGLE) -> torch.Tensor:
        started = time.perf_counter()
        training = self.training
        training.model.train()
        self._optimizer.zero_grad(set_to_none=True)
        dense, sparse = _split(inputs)
        output = float_output(training.model(dense, sparse))
        loss, numerator, denominator = loss_and_weight_sum(self._loss_fn, output, labels, weights)
        if numerator is not None:
            total = denominator.detach().reshape(1).to(torch.float32).clone()
            self.comm.allreduce(total, op="sum")
            objective = global_share(numerator, denominator, total[0], self.comm.size)
        else:
            objective = loss * self.loss_weight
        objective.backward()
        training.bags.apply_gradients()
        self._bytes.add(training.bags.last_bytes)  # this step's lookups (validation's are not training)
        training.average_dense_gradients()
        self.slow_down(started)
        self.steps.step(self._optimizer, training.dense_params)
        training.steps += 1
        return loss.detach()

    def evaluate(self, batches: Iterable[Any], loss_fn: LossFn, classification: bool, metrics: Any = None
                 ) -> torch.Tensor:
        """Lookups are collectives: every rank runs as many validation batches as the rank with the
        most; one with fewer joins the others' lookups with empty batches."""
        self.training.flush()  # validation sees every update so far
        mine = list(batches)
        rounds = max(int(n) for n in self.comm.allgather_object(len(mine)))
        sums = super().evaluate(iter(mine), loss_fn, classification, metrics)
        with torch.no_grad():
            for _ in range(rounds - len(mine)):
                self.training.bags.forward({}, train=False)
        return sums

    def module(self) -> nn.Module:
        return self.training.model

    def epoch_metrics(self) -> dict[str, float]:
        shards = sum(w.numel() * w.element_size() for w in self.training.bags.shards)
        dense = sum(p.numel() * p.element_size() for p in self.training.model.parameters())
        return {"param_bytes": float(shards + dense), "embedding_max_lag": float(self.training.bags.max_lag)}

    def epoch_record(self) -> dict[str, Any]:
        """Every rank calls it at the epoch's end (one small allreduce)."""
        return {"embedding_bytes_per_step": self._bytes.take_mean(self.comm)}

    @property
    def replicated_state(self) -> bool:  # type: ignore[override]
        # Sharded: every rank saves its own shards. Replicated with late updates: every rank flushes
        # its queue when it saves, so every rank saves (a rank that did not would keep older rows).
        return bool(self.layout.replicated and not self.layout.staleness)

    def finish(self) -> None:
        self.training.flush()

    def checkpoint_state(self) -> dict[str, Any]:
        self.training.flush()  # queued updates are applied, not saved half-done
        return {"training": self.training.state(), "steps": self.steps.state_dict()}

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        if "reshape_from" in state:  # written by another number of ranks (executor/reshape.py)
            from sparkdl.strategies.embedding_reshape import reshaped_state

            state = {"training": reshaped_state(self.training.bags, int(state["reshape_from"]), state["read_part"]),
                     "steps": state.get("steps", {})}
        if "training" not in state:
            raise ConfigError("this checkpoint was not written by strategy 'embeddings'",
                              hint="resume with the strategy the run was trained with")
        self.training.load_state(state["training"])
        self.steps.load_state_dict(state.get("steps", {}))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The dense model and this rank's table rows (early stopping's best epoch)."""
        state = {f"dense.{k}": v.detach().cpu().clone() for k, v in self.training.model.state_dict().items()}
        state.update({f"shard.{i}": w.clone() for i, w in enumerate(self.training.bags.shards)})
        return state

    def restore(self, snapshot: dict[str, torch.Tensor]) -> None:
        self.training.flush()
        self.training.model.load_state_dict({k[len("dense."):]: v for k, v in snapshot.items()
                                             if k.startswith("dense.")})
        with torch.no_grad():
            for i, weight in enumerate(self.training.bags.shards):
                weight.copy_(snapshot[f"shard.{i}"])

    def result_state(self) -> dict[str, torch.Tensor] | None:
        """This rank's rows of every table, named by where they start; the dense part from rank 0."""
        self.training.flush()
        placement, rank = self.training.bags.placement, self.comm.rank
        mine: dict[str, torch.Tensor] = {}
        for key, spec, weight in zip(self._table_keys, placement.tables, self.training.bags.shards):
            start, stop = placement.rows_of(spec.name, rank)
            if stop > start:
                mine[f"{key}{ROWS_MARK}{start}"] = weight.detach()
        if rank == 0:
            mine.update({k: v.detach().cpu() for k, v in self.training.model.state_dict().items()})
        return mine


def _split(inputs: Any) -> tuple[Any, Any]:
    if isinstance(inputs, (tuple, list)) and len(inputs) == 2 and isinstance(inputs[1], dict):
        return inputs[0], inputs[1]
    raise ConfigError("strategy 'embeddings' trains on batches of (dense, {column: Bag})",
                      hint="set data.sparse_cols (the categorical columns) and feature_cols (the dense ones)")


class EpochBytes:
    """The bytes a rank sent per training step for its tables, summed over an epoch by exchange
    (embeddings/exchange.step_bytes' keys; "touched": replicated tables' row mask)."""

    KINDS = ("counts", "ids", "rows", "gradients", "touched")  # fixed: every rank's allreduce is alike

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.seen: set[str] = set()
        self.steps = 0
        self._reset()

    def _reset(self) -> None:
        self.sums, self.seen, self.steps = dict.fromkeys(self.KINDS, 0.0), set(), 0

    def add(self, step_bytes: dict[str, int]) -> None:
        for kind, value in step_bytes.items():
            if kind in self.sums:
                self.sums[kind] += float(value)
                self.seen.add(kind)
        self.steps += 1

    def take_mean(self, comm: Any) -> dict[str, float]:
        """Mean bytes per step over the epoch's training steps and over the ranks (each rank's own
        mean, averaged), for the kinds some rank sent; then starts the next epoch's sums."""
        steps = max(self.steps, 1)
        means = [self.sums[k] / steps for k in self.KINDS]
        seen = [1.0 if k in self.seen else 0.0 for k in self.KINDS]
        vector = torch.tensor(means + seen + [1.0 if self.steps else 0.0], dtype=torch.float64)
        comm.allreduce(vector, op="sum")
        ranks = max(float(vector[-1]), 1.0)
        count = len(self.KINDS)
        self._reset()
        return {k: round(float(vector[i]) / ranks, 1) for i, k in enumerate(self.KINDS) if vector[count + i] > 0}


__all__ = ["ShardedEmbeddings", "ROWS_MARK", "table_optimizer"]
