"""Embedding tables sharded over the ranks of one run (issue 45: Persia / TorchRec-style).

Owns: table specs and their placement over W ranks (placement.py: stdlib only, so the planner may
price placements), the per-step id bucketing (bucketing.py), the sparse row optimizers that run where
the rows live (optimizers.py), and ShardedEmbeddingBags (sharded.py): lookups of only the rows a batch
touches by all-to-all, pooled locally, their gradients sent back to the owners by all-to-all, applied
synchronously or with a bounded staleness.

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
from sparkdl.embeddings.collection import EmbeddingBagCollection, deferred_tables
from sparkdl.embeddings.dlrm import DLRM
from sparkdl.embeddings.hybrid_step import ShardedEmbeddingTraining
from sparkdl.embeddings.optimizers import RowwiseAdagrad, SparseAdam
from sparkdl.embeddings.placement import Placement, TableSpec, plan_placement
from sparkdl.embeddings.sharded import Bag, ShardedEmbeddingBags, initial_rows

__all__ = ["DLRM", "Bag", "EmbeddingBagCollection", "Placement", "RowwiseAdagrad", "ShardedEmbeddingBags",
           "ShardedEmbeddingTraining", "SparseAdam", "TableSpec", "deferred_tables", "initial_rows",
           "plan_placement"]
