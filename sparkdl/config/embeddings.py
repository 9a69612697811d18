"""The `embeddings` section: how a run with categorical inputs (data.sparse_cols) trains its
embedding tables (strategies/embedding_tables.py), and the rules tying it to the other sections.

Flat names carry the `embedding_` prefix (option names are unique across sections). Imports nothing
from sparkdl but errors and config values (layering rule).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sparkdl.config.values import check_types, choice, positive_int_or_zero
from sparkdl.errors import ConfigError

EMBEDDING_OPTIMIZERS = ("rowwise_adagrad", "adam")
# "auto": the planner prices both on the measured links and the ids' measured frequency
EMBEDDING_PLACEMENTS = ("auto", "sharded", "replicated")
EMBEDDING_STRATEGY = "embeddings"


@dataclass(frozen=True)
class EmbeddingConfig:
    # The sparse optimizer applied where a table's rows live: "rowwise_adagrad" (one accumulator per
    # row, DLRM's and TorchRec's default) or "adam" (torch.optim.SparseAdam's rule: moments of the
    # touched rows only)
    embedding_optimizer: str = "rowwise_adagrad"
    embedding_lr: float = 0.0  # 0: the optimizer's own default (rowwise_adagrad 0.01, adam 0.001)
    embedding_eps: float = 0.0  # 0: the optimizer's own default
    # Persia's hybrid mode: embedding updates may land up to this many steps late (0 = exact, synchronous)
    embedding_staleness: int = 0
    # "sharded": every table's rows spread over the ranks (all-to-all of the touched rows); "replicated":
    # every rank holds every table (its whole gradient allreduced each step); "auto": the cheaper
    embedding_placement: str = "auto"

    def validate(self) -> None:
        check_types("embeddings", self)
        choice("embeddings.embedding_optimizer", self.embedding_optimizer, EMBEDDING_OPTIMIZERS)
        choice("embeddings.embedding_placement", self.embedding_placement, EMBEDDING_PLACEMENTS)
        for key in ("embedding_lr", "embedding_eps"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"embeddings.{key} must be a finite number >= 0, got {value!r}",
                                  hint="0 keeps the optimizer's default")
        positive_int_or_zero("embeddings.embedding_staleness", self.embedding_staleness)


def check_embedding_run(data: Any, train: Any, launch: Any) -> None:
    """A run with sparse_cols trains with strategy "embeddings" (and one with that strategy needs
    sparse_cols); the options that strategy cannot honour yet are refused here, before any job."""
    sparse = data.sparse_cols is not None
    strategy = train.strategy
    if strategy == EMBEDDING_STRATEGY and not sparse:
        raise ConfigError("train.strategy='embeddings' trains embedding tables, but data.sparse_cols is not set",
                          hint="declare the categorical columns, e.g. sparse_cols={'user': {'num_rows': 100000}}")
    if not sparse:
        return
    if strategy not in ("auto", EMBEDDING_STRATEGY):
        raise ConfigError(f"data.sparse_cols trains with strategy='embeddings' (tables sharded over the ranks, "
                          f"dense layers data parallel), not train.strategy={strategy!r}",
                          hint="leave strategy unset ('auto') or set strategy='embeddings'")
    if data.input_cols is not None:
        raise ConfigError("data.sparse_cols goes with feature_cols (the dense inputs), not input_cols",
                          hint="list the numeric columns in feature_cols (or none) and the categorical ones in "
                               "sparse_cols")
    refused = {"train.accumulate_steps": train.accumulate_steps != 1, "train.sync": train.sync != "allreduce",
               "train.batch_balance": train.batch_balance != "equal", "train.precision": train.precision != "32",
               # a skipped step would still have applied its (non-finite) embedding updates
               "train.nonfinite_loss='skip'": train.nonfinite_loss == "skip",
               "launch.backend": launch.backend != "torch",
               # tables and lookups stay on CPU for now; the dense layers would need moving to the GPU
               "launch.gpus_per_worker": launch.gpus_per_worker > 0,
               # the dense gradients go in one averaging allreduce of their own
               "train.sync_dtype": train.sync_dtype != "fp32", "train.islands": bool(train.islands)}
    for option, set_ in refused.items():
        if set_:
            raise ConfigError(f"{option} is not supported with data.sparse_cols (sharded embedding tables) yet",
                              hint=f"leave {option} at its default for this run")
