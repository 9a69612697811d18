"""Embedding tables sharded over the ranks of one run (issue 45: Persia / TorchRec-style).

Owns: table specs and their placement over W ranks (placement.py: stdlib only, so the planner may
price placements), the per-step id bucketing (bucketing.py), the sparse row optimizers that run where
the rows live (optimizers.py), and ShardedEmbeddingBags (sharded.py): lookups of only the rows a batch
touches by all-to-all, pooled locally, their gradients sent back to the owners by all-to-all, applied
synchronously or with a bounded staleness; ReplicatedEmbeddingBags (replicated.py) is its twin with
every table whole on every rank (local lookups, whole gradients allreduced).

The model users write (collection.py, dlrm.py): any nn.Module holding one EmbeddingBagCollection
(every table; {name: Bag} -> {name: pooled [B, dim]}) and calling it from its forward(dense, sparse);
DLRM is the built-in example (bottom MLP, pairwise dot interaction, top MLP to one logit), and
dlrm.py's docstring shows a two-tower model. Used alone the collection holds whole tables (replicated
use); ShardedEmbeddingTraining (hybrid_step.py) builds the model with deferred (meta) tables, shards
the collection over the ranks and keeps the dense part data parallel (gradients averaged by allreduce
every step), exactly as one process on the global batch with the same optimizers.

May import: torch, sparkdl.comm.base (never a backend), sparkdl.errors. Never pyspark: this runs on the
workers. TorchRec/FBGEMM are not used: fbgemm_gpu 1.9 does not load with torch 2.13 (its kernels are
built against another torch), so everything here is torch's own embedding_bag, index ops and the
Communicator's all_to_all (gloo's all_to_all_single with uneven splits on CPU, NCCL's on GPUs; the
interface's default builds it from point-to-point send/irecv).
"""
from importlib import import_module
from typing import Any

# Names load on first use (PEP 562): the planner imports placement.py (stdlib only) through this
# package and must not pull torch in with it.
_WHERE = {"EmbeddingBagCollection": "collection", "deferred_tables": "collection", "DLRM": "dlrm",
          "ShardedEmbeddingTraining": "hybrid_step", "RowwiseAdagrad": "optimizers", "SparseAdam": "optimizers",
          "Placement": "placement", "TableSpec": "placement", "plan_placement": "placement", "Bag": "sharded",
          "ShardedEmbeddingBags": "sharded", "initial_rows": "sharded",
          "ReplicatedEmbeddingBags": "replicated", "replicated_placement": "replicated"}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'sparkdl.embeddings' has no attribute {name!r}")
    return getattr(import_module(f"sparkdl.embeddings.{_WHERE[name]}"), name)
