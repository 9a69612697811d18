"""The model users write (EmbeddingBagCollection, the built-in DLRM) and ShardedEmbeddingTraining:
a DLRM trained on real gloo ranks (W=2 and 3) with its tables sharded row-wise and table-wise and its
dense part data parallel equals a single-process DLRM on the global batch with the same optimizers
(dense SGD or Adam; tables row-wise Adagrad written out by hand or torch.optim.SparseAdam): dense
weights, table rows and both optimizers' state. The click log is synthetic: log-uniform (Zipf-like)
ids, multi-hot bags of 0-4 ids, per-id weights on the sum-pooled tables. Pure tests: the replicated
collection against F.embedding_bag, deferred tables, the dot interaction, bad models refused."""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gloo_world import run_world
from sparkdl.comm.base import Communicator
from sparkdl.embeddings import (DLRM, Bag, EmbeddingBagCollection, RowwiseAdagrad, ShardedEmbeddingTraining,
                                SparseAdam, TableSpec, deferred_tables, initial_rows, plan_placement)
from sparkdl.embeddings.dlrm import dot_interaction
from sparkdl.errors import ConfigError, SparkdlError

pytestmark = pytest.mark.timeout(240)
LOCAL_BATCH = 6
DENSE = 5
DIM = 4
TABLE_SEED = 7
MODEL_SEED = 11
SPECS = (TableSpec("user", 80, DIM, pooling="sum", sharding="row"),   # weighted multi-hot
         TableSpec("item", 50, DIM, pooling="mean", sharding="row"),
         TableSpec("device", 6, DIM, pooling="sum", sharding="table"),
         TableSpec("tag", 13, DIM, pooling="sum", sharding="table"))  # weighted multi-hot
WEIGHTED = ("user", "tag")
ADAGRAD_LR, ADAM_LR = 0.2, 0.05


def click_log(step: int, world: int) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, ...]], torch.Tensor]:
    """One step's global batch: dense features, {table: (ids, lengths, weights)}, 0/1 labels. Ids are
    floor(n ** u) - 1 for uniform u: P(id) ~ 1/(id+1), a power law (the small ids hot)."""
    generator = torch.Generator().manual_seed(500 + step)
    samples = world * LOCAL_BATCH
    dense = torch.randn(samples, DENSE, generator=generator)
    sparse = {}
    for spec in SPECS:
        lengths = torch.randint(0, 5, (samples,), generator=generator)
        n = int(lengths.sum())
        u = torch.rand(n, generator=generator)
        ids = (torch.floor(torch.tensor(float(spec.num_rows)) ** u) - 1).long().clamp_(0, spec.num_rows - 1)
        weights = torch.rand(n, generator=generator) + 0.5 if spec.name in WEIGHTED else None
        sparse[spec.name] = (ids, lengths, weights)
    labels = (torch.rand(samples, generator=generator) < 0.3).float()
    return dense, sparse, labels


def rank_batch(batch: tuple, rank: int) -> tuple[torch.Tensor, dict[str, Bag], torch.Tensor]:
    """Rank r's samples [r*LOCAL_BATCH, (r+1)*LOCAL_BATCH) of a global batch."""
    dense, sparse, labels = batch
    first, last = rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH
    bags = {}
    for name, (ids, lengths, weights) in sparse.items():
        ends = torch.cumsum(lengths, 0)
        lo, hi = (int(ends[first - 1]) if first else 0), int(ends[last - 1])
        bags[name] = Bag.from_lengths(ids[lo:hi], lengths[first:last], None if weights is None else weights[lo:hi])
    return dense[first:last], bags, labels[first:last]


def whole_batch(batch: tuple) -> tuple[torch.Tensor, dict[str, Bag], torch.Tensor]:
    dense, sparse, labels = batch
    return dense, {name: Bag.from_lengths(*value) for name, value in sparse.items()}, labels


def build_model(sparse_grad: bool = False) -> DLRM:
    torch.manual_seed(MODEL_SEED)
    return DLRM(DENSE, SPECS, bottom=[8, DIM], top=[8, 4], seed=TABLE_SEED, sparse_grad=sparse_grad)


class TwoTower(nn.Module):
    """dlrm.py's "write your own" shape: towers over one shared collection. `unused` never gets a
    gradient; `rare` only on a batch holding a sample with dense[:, 0] > RARE (some ranks, some steps)."""

    RARE = 1.2

    def __init__(self, sparse_grad: bool = False) -> None:
        super().__init__()
        self.embeddings = EmbeddingBagCollection(SPECS, seed=TABLE_SEED, sparse_grad=sparse_grad)
        self.user = nn.Sequential(nn.Linear(DIM + DENSE, 6), nn.ReLU(), nn.Linear(6, 4))
        self.item = nn.Linear(3 * DIM, 4)
        self.unused = nn.Linear(2, 2)
        self.rare = nn.Linear(DENSE, 1)
        self.took_rare: list[bool] = []

    def forward(self, dense: torch.Tensor, sparse: dict[str, Bag]) -> torch.Tensor:
        e = self.embeddings(sparse)
        user = self.user(torch.cat([e["user"], dense], 1))
        item = self.item(torch.cat([e["item"], e["device"], e["tag"]], 1))
        out = (user * item).sum(1)
        rare = dense[:, 0] > self.RARE
        self.took_rare.append(bool(rare.any()))
        if self.took_rare[-1]:
            out = out + rare.float() * self.rare(dense).squeeze(1)
        return out


def build_two_tower(sparse_grad: bool = False) -> TwoTower:
    torch.manual_seed(MODEL_SEED)
    return TwoTower(sparse_grad)


BUILDERS = {"dlrm": build_model, "two_tower": build_two_tower}


def dense_optimizer(kind: str):
    if kind == "sgd":
        return lambda params: torch.optim.SGD(params, lr=0.1)
    return lambda params: torch.optim.Adam(params, lr=0.01)


def _train(comm: Communicator, world: int, dense_kind: str, table_kind: str, steps: int,
           model_name: str = "dlrm") -> dict[str, Any]:
    deferred = []

    def factory() -> nn.Module:
        model = BUILDERS[model_name]()
        deferred.append(all(w.is_meta for w in model.embeddings.weights))
        return model

    table_optimizer = RowwiseAdagrad(lr=ADAGRAD_LR) if table_kind == "adagrad" else SparseAdam(lr=ADAM_LR)
    training = ShardedEmbeddingTraining(comm, factory, dense_optimizer(dense_kind), table_optimizer,
                                        nn.BCEWithLogitsLoss())
    losses = [float(training.train_step(*rank_batch(click_log(step, world), comm.rank))) for step in range(steps)]
    dense_state = training.dense_optimizer.state_dict()["state"]
    return {"deferred": deferred,
            "dense": {k: v.numpy().copy() for k, v in training.model.state_dict().items()},
            "dense_state": {i: {k: v.numpy().copy() for k, v in s.items()} for i, s in dense_state.items()},
            "tables": {k: v.numpy() for k, v in training.full_tables().items()},
            "table_state": {n: {k: v.numpy() for k, v in s.items()}
                            for n, s in training.full_optimizer_state().items()},
            "shard_numel": {s.name: training.bags.local_weight(s.name).numel() for s in SPECS},
            "model_numel": sum(p.numel() for p in training.model.parameters()),
            "losses": losses, "took_rare": getattr(training.model, "took_rare", None)}


def rowwise_adagrad(weight: torch.Tensor, accumulator: torch.Tensor, grad: torch.Tensor) -> None:
    """Row-wise Adagrad written out on one coalesced sparse gradient."""
    grad = grad.coalesce()
    rows, values = grad.indices()[0], grad.values()
    with torch.no_grad():
        accumulator[rows] += values.pow(2).mean(1)
        weight[rows] -= ADAGRAD_LR * values / (accumulator[rows].sqrt() + 1e-8).unsqueeze(1)


def reference(world: int, dense_kind: str, table_kind: str, steps: int, model_name: str = "dlrm") -> dict[str, Any]:
    """One process, the global batch, the same initial weights and optimizers."""
    model = BUILDERS[model_name](sparse_grad=True)
    tables = list(model.embeddings.weights)
    dense_params = [p for n, p in model.named_parameters() if not n.startswith("embeddings.")]
    optimizer = dense_optimizer(dense_kind)(dense_params)
    adam = torch.optim.SparseAdam(tables, lr=ADAM_LR) if table_kind == "adam" else None
    accumulators = [torch.zeros(s.num_rows) for s in SPECS]
    losses = []
    for step in range(steps):
        dense, sparse, labels = whole_batch(click_log(step, world))
        optimizer.zero_grad(set_to_none=True)
        for table in tables:
            table.grad = None
        loss = nn.BCEWithLogitsLoss()(model(dense, sparse), labels)
        loss.backward()
        losses.append(float(loss.detach()))
        optimizer.step()
        if adam is not None:
            adam.step()
        else:
            for table, accumulator in zip(tables, accumulators):
                rowwise_adagrad(table.data, accumulator, table.grad)
    if adam is not None:
        table_state = {s.name: {k: adam.state[t][k].numpy() for k in ("exp_avg", "exp_avg_sq")}
                       for s, t in zip(SPECS, tables)}
    else:
        table_state = {s.name: {"sum": a.numpy()} for s, a in zip(SPECS, accumulators)}
    return {"dense": {n: p.detach().numpy() for n, p in model.state_dict().items() if not n.startswith("embeddings.")},
            "dense_state": {i: {k: v.numpy() for k, v in optimizer.state[p].items()}
                            for i, p in enumerate(dense_params) if p in optimizer.state},
            "tables": {s.name: t.detach().numpy() for s, t in zip(SPECS, tables)},
            "table_state": table_state, "losses": losses}


def assert_matches(results: list[dict], expected: dict[str, Any]) -> None:
    """Every rank's dense weights and optimizer state, the gathered tables and their optimizer state
    equal the single process's to 1e-5; the ranks' dense weights agree to the bit."""
    for result in results:
        assert result["deferred"] == [True]  # the factory's tables were never built whole
        for spec in SPECS:  # no rank holds a whole row-wise table; table-wise ones live on one rank
            assert result["shard_numel"][spec.name] < spec.num_rows * spec.dim or spec.sharding == "table"
        assert result["model_numel"] == sum(v.size for v in expected["dense"].values())  # no table in it
        assert sorted(result["dense"]) == sorted(expected["dense"])
        for name, value in expected["dense"].items():
            np.testing.assert_allclose(result["dense"][name], value, atol=1e-5, rtol=0, err_msg=name)
            np.testing.assert_array_equal(result["dense"][name], results[0]["dense"][name])  # ranks agree
        assert sorted(result["dense_state"]) == sorted(expected["dense_state"])
        for i, state in expected["dense_state"].items():
            for key, value in state.items():
                np.testing.assert_allclose(result["dense_state"][i][key], value, atol=1e-5, rtol=0)
        for spec in SPECS:
            start = initial_rows(spec, 0, spec.num_rows, seed=TABLE_SEED).numpy()
            assert not np.allclose(expected["tables"][spec.name], start)  # the rows did move
            np.testing.assert_allclose(result["tables"][spec.name], expected["tables"][spec.name], atol=1e-5, rtol=0)
            for key, value in expected["table_state"][spec.name].items():
                np.testing.assert_allclose(result["table_state"][spec.name][key], value, atol=1e-5, rtol=0)
    owned = {s.name: sum(r["shard_numel"][s.name] for r in results) for s in SPECS}
    assert owned == {s.name: s.num_rows * s.dim for s in SPECS}  # every row held exactly once
    # The ranks' mean local losses are the global batch's loss (equal local batch sizes).
    np.testing.assert_allclose(np.mean([r["losses"] for r in results], axis=0), expected["losses"], atol=1e-5)


@pytest.mark.parametrize("world,dense_kind,table_kind",
                         [(2, "sgd", "adagrad"), (3, "adam", "adam"), (3, "sgd", "adagrad"), (2, "adam", "adam")])
def test_sharded_dlrm_equals_one_process_on_the_global_batch(world: int, dense_kind: str, table_kind: str) -> None:
    steps = 4
    results = run_world(world, _train, world, dense_kind, table_kind, steps, timeout=200)
    assert_matches(results, reference(world, dense_kind, table_kind, steps))


def test_own_two_tower_model_trains_sharded_with_gradients_some_ranks_lack() -> None:
    """A parameter used on some ranks only is averaged with zeros from the others (the global mean's
    gradient); one used nowhere keeps no gradient, so Adam leaves it and keeps no state for it."""
    world, steps = 2, 4
    results = run_world(world, _train, world, "adam", "adagrad", steps, "two_tower", timeout=200)
    took = np.array([r["took_rare"] for r in results])  # [rank, step]
    assert (took.any(0) & ~took.all(0)).any()  # some step where one rank used `rare` and the other not
    expected = reference(world, "adam", "adagrad", steps, "two_tower")
    assert len(expected["dense_state"]) == len(results[0]["dense"]) - 2  # `unused`: no gradient, no state
    assert_matches(results, expected)


def _resume(comm: Communicator, world: int, steps: int, cut: int) -> dict[str, Any]:
    """Train straight through, and again from state() saved after `cut` steps loaded into a fresh
    trainer whose dense and table weights start elsewhere."""
    def trainer(seed_shift: int) -> ShardedEmbeddingTraining:
        def factory() -> DLRM:
            torch.manual_seed(MODEL_SEED + seed_shift)
            return DLRM(DENSE, SPECS, bottom=[8, DIM], top=[8, 4], seed=TABLE_SEED + seed_shift)
        return ShardedEmbeddingTraining(comm, factory, dense_optimizer("adam"), SparseAdam(lr=ADAM_LR),
                                        nn.BCEWithLogitsLoss())

    def run(training: ShardedEmbeddingTraining, first: int, last: int) -> None:
        for step in range(first, last):
            training.train_step(*rank_batch(click_log(step, world), comm.rank))

    straight = trainer(0)
    run(straight, 0, cut)
    saved = straight.state()
    run(straight, cut, steps)
    resumed = trainer(1)
    resumed.load_state(saved)
    run(resumed, cut, steps)
    dense_same = all(torch.equal(a, b) for a, b in zip(straight.model.parameters(), resumed.model.parameters()))
    tables_same = all(torch.equal(straight.bags.local_weight(s.name), resumed.bags.local_weight(s.name))
                      for s in SPECS)
    dense, sparse, _ = rank_batch(click_log(0, world), comm.rank)
    scored = resumed.predict(dense, sparse)
    return {"dense_same": dense_same, "tables_same": tables_same, "steps": resumed.steps,
            "scored_shape": list(scored.shape), "scored_grad": scored.requires_grad}


def test_state_resumes_exactly_and_predict_does_not_train() -> None:
    for result in run_world(2, _resume, 2, 5, 2, timeout=200):
        assert result["dense_same"] and result["tables_same"] and result["steps"] == 5
        assert result["scored_shape"] == [LOCAL_BATCH] and not result["scored_grad"]


# Pure tests (one process, no ranks)

def test_replicated_collection_forward_equals_embedding_bag_on_the_same_rows() -> None:
    collection = EmbeddingBagCollection(SPECS, seed=TABLE_SEED)
    _, sparse, _ = whole_batch(click_log(0, 2))
    pooled = collection(sparse)
    assert sorted(pooled) == sorted(s.name for s in SPECS)
    for spec in SPECS:
        rows = initial_rows(spec, 0, spec.num_rows, seed=TABLE_SEED)
        assert torch.equal(collection.table(spec.name).detach(), rows)
        bounds = plan_placement(SPECS, 3).bounds[SPECS.index(spec)]  # the shards ranks draw alone
        shards = [initial_rows(spec, bounds[r], bounds[r + 1], seed=TABLE_SEED) for r in range(3)]
        assert torch.equal(torch.cat(shards), rows)
        bag = sparse[spec.name]
        expected = F.embedding_bag(bag.ids, rows, bag.offsets, mode=spec.pooling, per_sample_weights=bag.weights)
        assert pooled[spec.name].shape == (2 * LOCAL_BATCH, DIM)
        torch.testing.assert_close(pooled[spec.name], expected, rtol=0, atol=0)
    # Only the tables given are looked up; a (ids, offsets) tuple works like a Bag.
    only = collection({"device": (torch.tensor([1, 5, 5]), torch.tensor([0, 1]))})
    assert list(only) == ["device"]
    torch.testing.assert_close(only["device"][1], 2 * initial_rows(SPECS[2], 5, 6, seed=TABLE_SEED)[0])


def test_collection_sparse_gradients_touch_only_the_batch_rows() -> None:
    collection = EmbeddingBagCollection(SPECS[:1], sparse_grad=True)
    collection({"user": (torch.tensor([3, 3, 9]), torch.tensor([0, 2]))})["user"].sum().backward()
    grad = collection.table("user").grad
    assert grad.is_sparse and sorted(grad.coalesce().indices()[0].tolist()) == [3, 9]


def test_deferred_tables_hold_no_rows_until_materialized() -> None:
    big = TableSpec("huge", 50_000_000, 64)  # 12.8 GB if it were built
    with deferred_tables():
        collection = EmbeddingBagCollection((big, SPECS[2]), seed=3)
    assert all(w.is_meta for w in collection.weights) and not collection.is_materialized
    with pytest.raises(SparkdlError, match="deferred"):
        collection({"device": (torch.tensor([1]), torch.tensor([0]))})
    small = EmbeddingBagCollection(SPECS[2:], seed=3, materialize=False)
    small.materialize()
    assert small.is_materialized
    assert torch.equal(small.table("device").detach(), initial_rows(SPECS[2], 0, SPECS[2].num_rows, seed=3))


def test_dot_interaction_is_every_pair_below_the_diagonal() -> None:
    features = torch.randn(3, 4, 5)
    got = dot_interaction(features)
    expected = torch.stack([torch.stack([(features[b, i] * features[b, j]).sum() for i in range(4) for j in range(i)])
                            for b in range(3)])
    assert got.shape == (3, 6)
    torch.testing.assert_close(got, expected)


def test_dlrm_scores_one_logit_per_sample_and_refuses_bad_shapes() -> None:
    model = build_model()
    dense, sparse, _ = whole_batch(click_log(1, 2))
    logits = model(dense, sparse)
    assert logits.shape == (2 * LOCAL_BATCH,)
    assert model.top[0].in_features == DIM + 5 * 4 // 2  # x beside 10 pairwise products of 5 vectors
    with pytest.raises(ConfigError, match="bottom"):
        DLRM(DENSE, SPECS, bottom=[], top=[4])
    with pytest.raises(ConfigError, match="wide"):
        DLRM(DENSE, SPECS + (TableSpec("odd", 5, DIM + 1),), bottom=[8, DIM], top=[4])
    with pytest.raises(ConfigError, match="no ids for tag"):
        model(dense, {k: v for k, v in sparse.items() if k != "tag"})
    with pytest.raises(ConfigError, match="neither a table nor a feature"):
        model(dense, {**sparse, "nope": sparse["tag"]})


class _TwoCollections(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = EmbeddingBagCollection(SPECS[:1]), EmbeddingBagCollection(SPECS[1:2])


def test_training_refuses_models_without_exactly_one_collection() -> None:
    from sparkdl.embeddings.collection import find_collection

    with pytest.raises(ConfigError, match="2 EmbeddingBagCollection"):
        find_collection(_TwoCollections())
    with pytest.raises(ConfigError, match="0 EmbeddingBagCollection"):
        find_collection(nn.Linear(2, 2))
    assert find_collection(build_model()) is not None


def test_a_file_backed_table_pickles_as_its_file_and_maps_back(monkeypatch) -> None:
    import pickle

    from sparkdl.embeddings import mapped
    from sparkdl.model.tensor_files import write_tensors
    from sparkdl.model.trained import load_parts

    spec = TableSpec("big", 4096, 8)
    monkeypatch.setattr(mapped, "MAPPED_TABLE_BYTES", 1024)
    with deferred_tables():
        model = EmbeddingBagCollection([spec])
    rows = torch.arange(4096 * 8, dtype=torch.float32).reshape(4096, 8)
    parts = []
    for start, stop in ((0, 1000), (1000, 4096)):  # two ranks' pieces, written as the ranks write them
        path = f"/tmp/sparkdl-test-piece-{os.getpid()}-{start}.bin"
        with open(path, "wb") as stream:
            write_tensors(stream, {f"weights.0#rows={start}": rows[start:stop]})
        parts.append(path)
    load_parts(model, parts)
    for path in parts:
        os.remove(path)
    table = model.weights[0]
    assert mapped.mapped_path(table) is not None and torch.equal(table, rows)
    data = pickle.dumps(model)
    assert len(data) < 64 * 1024  # the file's name travels, not the 128 KiB of rows
    back = pickle.loads(data)
    assert torch.equal(back.weights[0], rows)
    ids = torch.tensor([5, 4095])
    torch.testing.assert_close(back({"big": Bag(ids, torch.tensor([0, 1]))})["big"], rows[ids])
    os.remove(mapped.mapped_path(table))  # another host: the file is not there
    elsewhere = pickle.loads(data)
    assert elsewhere.weights[0].is_meta
    with pytest.raises(SparkdlError, match="file on the driver's host"):
        elsewhere({"big": Bag(ids, torch.tensor([0, 1]))})
