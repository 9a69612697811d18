"""Driver side of strategy "embeddings" (data.sparse_cols): the model probed on real rows with its
tables deferred, checked against the declared tables, and the layout the ranks train with."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sparkdl.errors import ModelError

if TYPE_CHECKING:
    from sparkdl.config import DataConfig, LaunchConfig, TrainConfig
    from sparkdl.config.embeddings import EmbeddingConfig
    from sparkdl.data.layout import FeedLayout
    from sparkdl.model.layouts import EmbeddingLayout
    from sparkdl.planner.resolved import ResolvedPlan


def probe_embedding_model(model: Any, data: "DataConfig", train: "TrainConfig", layout: "FeedLayout",
                          sample: Any) -> tuple[Any, int, Any, tuple[int, ...]]:
    """Build the model (a factory's tables deferred: the driver never holds them), bind the
    categorical columns to its tables, check those against data.sparse_cols, and run a few real
    rows through it (deferred tables give zeros) and the loss. Returns what probe_tensor_model does."""
    import torch

    from sparkdl.data.assemble import sample_batch
    from sparkdl.driver.checks import check_loss_on_sample, driver_copy
    from sparkdl.embeddings.collection import deferred_tables, find_collection, probing_tables

    with deferred_tables():
        module, forward = driver_copy(model, train.seed)
    try:
        collection = find_collection(module)
    except Exception as exc:  # noqa: BLE001 - ConfigError from find_collection, named here for fit
        raise ModelError(f"data.sparse_cols needs a model holding one EmbeddingBagCollection: {exc}",
                         hint="build the tables as EmbeddingBagCollection([TableSpec(...), ...]) inside the "
                              "model (sparkdl.embeddings.DLRM is one)") from None
    check_tables(collection, layout)
    collection.bind_features({f.source: f.table for f in layout.sparse})
    batch = sample_batch(sample, layout, None)
    inputs, label, weight = batch
    try:
        with probing_tables():
            out = forward(inputs)
    except ModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure here is a model/input mismatch
        raise ModelError(f"the model cannot take a batch of (dense [{inputs[0].shape[1]} features], "
                         f"{{{', '.join(inputs[1])}: Bag}}): {type(exc).__name__}: {exc}",
                         hint="write forward(dense, sparse) and look the columns up with "
                              "self.embeddings(sparse)[column]") from None
    rows = int(label.shape[0]) if label is not None else None
    if not isinstance(out, torch.Tensor) or out.dim() < 1 or (rows is not None and out.shape[0] != rows):
        raise ModelError("the model must return one tensor with the batch as its first dimension",
                         hint="return one logit per row ([batch]) or (batch, outputs)")
    width = int(out[0].numel())
    if label is not None:
        from sparkdl.model.objectives import loss_function

        check_loss_on_sample(data, train, out, label, weight, loss_function(train))
    return module, width, batch, tuple(out.shape[1:])


def check_tables(collection: Any, layout: "FeedLayout") -> None:
    """Every table data.sparse_cols names exists in the model with the same number of rows."""
    specs = {s.name: s for s in collection.tables}
    for feature in layout.sparse:
        spec = specs.get(feature.table)
        if spec is None:
            raise ModelError(f"data.sparse_cols sends column {feature.source!r} to table {feature.table!r}, which "
                             f"the model's EmbeddingBagCollection does not hold (it holds "
                             f"{', '.join(sorted(specs)) or 'none'})",
                             hint=f"add TableSpec({feature.table!r}, num_rows={feature.num_rows}, dim=...) to the "
                                  "model, or set table=... on the column")
        if spec.num_rows != feature.num_rows:
            raise ModelError(f"table {feature.table!r} has {spec.num_rows} rows in the model but num_rows="
                             f"{feature.num_rows} in data.sparse_cols",
                             hint="declare the same num_rows in both (ids are hashed onto num_rows rows)")


def embedding_layout(embeddings: "EmbeddingConfig", layout: "FeedLayout") -> tuple["EmbeddingLayout", dict[str, str]]:
    """The ranks' layout and the MLflow params that describe it."""
    from sparkdl.model.layouts import EmbeddingLayout

    planned = EmbeddingLayout(optimizer=embeddings.embedding_optimizer, lr=float(embeddings.embedding_lr),
                              eps=float(embeddings.embedding_eps), staleness=int(embeddings.embedding_staleness),
                              features=tuple((f.source, f.table) for f in layout.sparse))
    params = {"embeddings.optimizer": planned.optimizer, "embeddings.staleness": str(planned.staleness),
              "embeddings.tables": ",".join(sorted({f.table for f in layout.sparse}))}
    return planned, params


def resolve_embeddings(train: "TrainConfig", launch: "LaunchConfig", layout: "FeedLayout",
                       embeddings: "EmbeddingConfig | None") -> "ResolvedPlan":
    """sparse_cols runs train with strategy "embeddings" (config/embeddings.py refused the rest)."""
    from sparkdl.config import merged_section
    from sparkdl.config.embeddings import EmbeddingConfig
    from sparkdl.driver.checks import check_backend
    from sparkdl.planner.resolved import ResolvedPlan

    train = merged_section("train", train, {"strategy": "embeddings"})
    check_backend(train, launch)
    planned, params = embedding_layout(embeddings or EmbeddingConfig(), layout)
    return ResolvedPlan.build(train, launch.num_workers, planned, params, None)
