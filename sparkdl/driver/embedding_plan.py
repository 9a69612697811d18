"""Driver side of strategy "embeddings" (data.sparse_cols): the model probed on real rows with its
tables deferred, checked against the declared tables, and the layout the ranks train with."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sparkdl.errors import ModelError

if TYPE_CHECKING:
    from sparkdl.config import DataConfig, LaunchConfig, TrainConfig
    from sparkdl.config.embeddings import EmbeddingConfig
    from sparkdl.data.layout import FeedLayout
    from sparkdl.planner.resolved import ResolvedPlan


def probe_embedding_model(model: Any, data: "DataConfig", train: "TrainConfig", layout: "FeedLayout",
                          sample: Any) -> tuple[Any, int, Any, tuple[int, ...]]:
    """Build the model (a factory's tables deferred: the driver never holds them), bind the
    categorical columns to its tables, check those against data.sparse_cols, and run a few real
    rows through it (deferred tables give zeros) and the loss. Returns what probe_tensor_model does."""
    import torch

    from sparkdl.data.assemble import sample_batch
    from sparkdl.driver.model_probe import check_loss_on_sample, driver_copy
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
    """Every table data.sparse_cols names exists in the model with the same rows (and dim and
    pooling where they matter); columns sharing a table need the model to name them."""
    specs = {s.name: s for s in collection.tables}
    shared = sorted({f.table for f in layout.sparse if sum(g.table == f.table for g in layout.sparse) > 1})
    unnamed = [t for t in shared if not any(collection.features.get(f.source) == t for f in layout.sparse)]
    if unnamed:
        columns = [f.source for f in layout.sparse if f.table == unnamed[0]]
        raise ModelError(f"columns {columns} share table {unnamed[0]!r}, but the model's EmbeddingBagCollection does "
                         "not name them (its outputs are sized per feature when it is built)",
                         hint=f"pass features={{{', '.join(f'{c!r}: {unnamed[0]!r}' for c in columns)}, ...}} to "
                              "DLRM / EmbeddingBagCollection")
    for feature in layout.sparse:
        spec = specs.get(feature.table)
        if spec is None:
            raise ModelError(f"data.sparse_cols sends column {feature.source!r} to table {feature.table!r}, which "
                             f"the model's EmbeddingBagCollection does not hold (it holds "
                             f"{', '.join(sorted(specs)) or 'none'})",
                             hint=f"add TableSpec({feature.table!r}, num_rows={feature.num_rows}, dim=...) to the "
                                  "model, or set table=... on the column")
        if feature.source_weights is not None and spec.pooling != "sum":
            raise ModelError(f"column {feature.source!r} has weights ({feature.source_weights!r}) but its table "
                             f"{feature.table!r} pools by {spec.pooling!r}",
                             hint="per-id weights need TableSpec(..., pooling='sum'), or drop weights_col")
        if feature.dim is not None and spec.dim != feature.dim:
            raise ModelError(f"table {feature.table!r} is {spec.dim} wide in the model but dim={feature.dim} in "
                             "data.sparse_cols", hint="declare the same dim in both, or leave dim out of sparse_cols")
        if spec.num_rows != feature.num_rows:
            raise ModelError(f"table {feature.table!r} has {spec.num_rows} rows in the model but num_rows="
                             f"{feature.num_rows} in data.sparse_cols",
                             hint="declare the same num_rows in both (ids are hashed onto num_rows rows)")


def resolve_embeddings(module: Any, data: "DataConfig", train: "TrainConfig", launch: "LaunchConfig",
                       layout: "FeedLayout", embeddings: "EmbeddingConfig | None", cluster: Any = None,
                       rows: Any = None, num_rows: int | None = None, kept: Any = None) -> "ResolvedPlan":
    """sparse_cols runs train with strategy "embeddings" (config/embeddings.py refused the rest), its
    tables sharded or replicated as embedding_placement says; under "auto" the planner prices both
    from the measured links and the sampled ids of `rows` (the prepared DataFrame) and chooses.
    `cluster`: a function measuring (or recalling) the cluster, called only then; `kept`: a plan to
    train with instead (plan=, plan_from_run, plan_file), checked against this run."""
    from sparkdl.config import merged_section
    from sparkdl.config.embeddings import EmbeddingConfig
    from sparkdl.driver.checks import check_backend
    from sparkdl.embeddings.collection import find_collection
    from sparkdl.model.layouts import EmbeddingLayout
    from sparkdl.planner.resolved import ResolvedPlan

    train = merged_section("train", train, {"strategy": "embeddings"})
    check_backend(train, launch)
    if kept is not None:
        return _kept(kept, train, launch, layout)
    embeddings = embeddings or EmbeddingConfig()
    placement, decision = embeddings.embedding_placement, None
    if placement == "auto" and launch.num_workers > 1 and cluster is not None and rows is not None:
        decision = decide_placement(find_collection(module).tables, data, launch, layout, embeddings, cluster(), rows,
                                    num_rows or 1, train.seed)
        placement = "sharded" if decision.sharded else "replicated"
    elif placement == "auto":
        placement = "sharded"  # one rank (or nothing to measure with): no exchange either way
    planned = EmbeddingLayout(optimizer=embeddings.embedding_optimizer, lr=float(embeddings.embedding_lr),
                              eps=float(embeddings.embedding_eps), staleness=int(embeddings.embedding_staleness),
                              features=tuple((f.source, f.table) for f in layout.sparse),
                              replicated=placement == "replicated",
                              shardings=decision.choice.shardings if decision is not None and decision.sharded else (),
                              decision=decision.explain() if decision is not None else "")
    params = {"embeddings.optimizer": planned.optimizer, "embeddings.staleness": str(planned.staleness),
              "embeddings.placement": placement, "embeddings.placement_chosen_by": "planner" if decision else "option",
              "embeddings.tables": ",".join(sorted({f.table for f in layout.sparse}))}
    if decision is not None:
        params.update({f"embeddings.{o.name.split('(')[0]}_comm_ms": f"{o.step_s * 1e3:.3f}" for o in decision.options
                       if o.name == "replicated" or o is decision.choice})
    return ResolvedPlan.build(train, launch.num_workers, planned, params, None)


def _kept(kept: Any, train: "TrainConfig", launch: "LaunchConfig", layout: "FeedLayout") -> "ResolvedPlan":
    from sparkdl.errors import ConfigError
    from sparkdl.model.layouts import EmbeddingLayout
    from sparkdl.planner.resolved import ResolvedPlan

    if not isinstance(kept.layout, EmbeddingLayout):
        raise ConfigError(f"the kept plan trains with strategy {kept.strategy!r}, but a run with data.sparse_cols "
                          "trains with 'embeddings'", hint="plan this run again (sparkdl.plan with the same sparse_cols)")
    features = tuple((f.source, f.table) for f in layout.sparse)
    if kept.world != launch.num_workers or tuple(kept.layout.features) != features:
        raise ConfigError(f"the kept plan was made for {kept.world} workers and columns {list(kept.layout.features)}, "
                          f"this run has {launch.num_workers} and {list(features)}",
                          hint="plan this run again, or keep its workers and sparse_cols")
    return ResolvedPlan.build(train, launch.num_workers, kept.layout, dict(kept.params), None)


def decide_placement(tables: Any, data: "DataConfig", launch: "LaunchConfig", layout: "FeedLayout",
                     embeddings: "EmbeddingConfig", cluster: Any, rows: Any, num_rows: int, seed: int) -> Any:
    """The planner's EmbeddingDecision: the sampled ids' frequencies (one Spark job), the calibrated
    cluster's links and the rank memory budget."""
    from sparkdl.data.sparse_id_counts import table_id_counts
    from sparkdl.planner.budget import rank_memory_budget
    from sparkdl.planner.embeddings import decide_embeddings, measure_ids
    from sparkdl.planner.ends import calibration_ends

    world = launch.num_workers
    counts = table_id_counts(rows, layout, num_rows, seed)
    stats = {t.name: measure_ids(t.name, t.num_rows, counts[t.name].counts, counts[t.name].sample_rows,
                                 data.batch_size, world, counts[t.name].tail_ids, counts[t.name].tail_total)
             for t in tables if t.name in counts}
    for t in tables:  # a table no column feeds is never looked up
        stats.setdefault(t.name, measure_ids(t.name, t.num_rows, (), 1, data.batch_size, world))
    ends = calibration_ends(cluster, launch)  # as measured, and its best repeats: a flip between them is a close call
    return decide_embeddings(tables, stats, world, ends[0].net, rank_memory_budget(launch, cluster),
                             embeddings.embedding_optimizer, all_peers=True,
                             optimistic=ends[1].net if len(ends) > 1 else None)
