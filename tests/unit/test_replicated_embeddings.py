"""ReplicatedEmbeddingBags, the twin of the sharded tables: on real gloo ranks (W=2 and 3) a DLRM whose
tables are replicated (local lookups, whole gradients allreduced) trains exactly as the same DLRM
sharded and as one process on the global batch (dense SGD; row-wise Adagrad and SparseAdam tables),
including steps where a looked-up row's gradient is exactly zero (its weight in the bag is 0: SparseAdam
still decays its moments). Bounded staleness is the sharded queue's; states resume exactly and a
sharded state is refused by a replicated run and vice versa; `shardings` puts a row-wise table whole
on one rank; the bytes a step sends grow with the tables (replicated) or the touched rows (sharded).
The click log and model come from test_embedding_training."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from gloo_world import run_world
from sparkdl.comm.base import Communicator
from sparkdl.embeddings import (Bag, ReplicatedEmbeddingBags, RowwiseAdagrad, ShardedEmbeddingBags,
                                ShardedEmbeddingTraining, SparseAdam, TableSpec, plan_placement,
                                replicated_placement)
from sparkdl.embeddings.hybrid_step import with_shardings
from sparkdl.errors import ConfigError, SparkdlError
from test_embedding_training import (ADAGRAD_LR, ADAM_LR, SPECS, build_model, click_log, dense_optimizer,
                                     rank_batch, rowwise_adagrad, whole_batch)

pytestmark = pytest.mark.timeout(300)
HOT = 0  # a user id every step looks up
ZERO_FROM = 2  # from this step on, user id HOT's per-id weights are 0: looked up, zero gradient


def zeroed_log(step: int, world: int) -> tuple:
    """click_log with user id HOT the first id of every step, weighted 0 from step ZERO_FROM on."""
    dense, sparse, labels = click_log(step, world)
    ids, lengths, weights = sparse["user"]
    ids = torch.cat([torch.tensor([HOT]), ids[1:]])
    if step >= ZERO_FROM:
        weights = torch.where(ids == HOT, 0.0, weights)
    return dense, {**sparse, "user": (ids, lengths, weights)}, labels


def table_optimizer(kind: str) -> RowwiseAdagrad | SparseAdam:
    return RowwiseAdagrad(lr=ADAGRAD_LR) if kind == "adagrad" else SparseAdam(lr=ADAM_LR)


def _numpy(training: ShardedEmbeddingTraining, losses: list[float]) -> dict[str, Any]:
    dense_state = training.dense_optimizer.state_dict()["state"]
    return {"dense": {k: v.numpy().copy() for k, v in training.model.state_dict().items()},
            "dense_state": {i: {k: v.numpy().copy() for k, v in s.items()} for i, s in dense_state.items()},
            "tables": {k: v.numpy() for k, v in training.full_tables().items()},
            "table_state": {n: {k: v.numpy() for k, v in s.items()}
                            for n, s in training.full_optimizer_state().items()},
            "shard_numel": {s.name: training.bags.local_weight(s.name).numel() for s in SPECS},
            "bounds": training.bags.placement.bounds, "max_lag": training.bags.max_lag,
            "bags": type(training.bags).__name__, "losses": losses}


def _train_both(comm: Communicator, world: int, table_kind: str, steps: int, staleness: int = 0,
                shardings: dict[str, str] | None = None) -> dict[str, Any]:
    """The same steps sharded, then replicated (dense SGD), each from a fresh model."""
    out = {}
    for kind in ("sharded", "replicated"):
        training = ShardedEmbeddingTraining(comm, build_model, dense_optimizer("sgd"), table_optimizer(table_kind),
                                            nn.BCEWithLogitsLoss(), staleness=staleness,
                                            replicated=kind == "replicated", shardings=shardings)
        losses, lags = [], []
        for step in range(steps):
            losses.append(float(training.train_step(*rank_batch(zeroed_log(step, world), comm.rank))))
            lags.append(training.bags.max_lag)
        training.flush()
        out[kind] = {**_numpy(training, losses), "lags": lags, "specs": training.tables}
    return out


def reference(world: int, table_kind: str, steps: int) -> dict[str, Any]:
    """One process, the global batch of zeroed_log, dense SGD, the same table optimizer (SparseAdam:
    torch's own, on sparse gradients that list every looked-up row, zero or not)."""
    model = build_model(sparse_grad=True)
    tables = list(model.embeddings.weights)
    dense_params = [p for n, p in model.named_parameters() if not n.startswith("embeddings.")]
    optimizer = dense_optimizer("sgd")(dense_params)
    adam = torch.optim.SparseAdam(tables, lr=ADAM_LR) if table_kind == "adam" else None
    accumulators = [torch.zeros(s.num_rows) for s in SPECS]
    losses, hot_avg = [], []
    for step in range(steps):
        dense, sparse, labels = whole_batch(zeroed_log(step, world))
        optimizer.zero_grad(set_to_none=True)
        for table in tables:
            table.grad = None
        loss = nn.BCEWithLogitsLoss()(model(dense, sparse), labels)
        loss.backward()
        losses.append(float(loss.detach()))
        optimizer.step()
        if adam is not None:
            adam.step()
            hot_avg.append(adam.state[tables[0]]["exp_avg"][HOT].clone().numpy())
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
            "table_state": table_state, "losses": losses, "hot_avg": hot_avg}


def assert_equal_runs(result: dict[str, Any], expected: dict[str, Any], atol: float = 1e-5) -> None:
    """Dense weights and optimizer state, whole tables and their optimizer state, losses."""
    assert sorted(result["dense"]) == sorted(expected["dense"])
    for name, value in expected["dense"].items():
        np.testing.assert_allclose(result["dense"][name], value, atol=atol, rtol=0, err_msg=name)
    for i, state in expected["dense_state"].items():
        for key, value in state.items():
            np.testing.assert_allclose(result["dense_state"][i][key], value, atol=atol, rtol=0)
    for spec in SPECS:
        np.testing.assert_allclose(result["tables"][spec.name], expected["tables"][spec.name], atol=atol, rtol=0,
                                   err_msg=spec.name)
        for key, value in expected["table_state"][spec.name].items():
            np.testing.assert_allclose(result["table_state"][spec.name][key], value, atol=atol, rtol=0,
                                       err_msg=f"{spec.name} {key}")


@pytest.mark.parametrize("world,table_kind", [(2, "adagrad"), (3, "adam")])
def test_replicated_equals_sharded_equals_one_process(world: int, table_kind: str) -> None:
    steps = 4
    results = run_world(world, _train_both, world, table_kind, steps, timeout=250)
    expected = reference(world, table_kind, steps)
    for step in range(steps):
        ids, _, weights = zeroed_log(step, world)[1]["user"]
        assert bool((ids == HOT).any())  # the hot row is looked up every step, with weight 0 from ZERO_FROM
        assert (float(weights[ids == HOT].abs().sum()) == 0) == (step >= ZERO_FROM)
    if table_kind == "adam":  # one process decays the zero-gradient row's moments: replicated must too
        assert not np.allclose(expected["hot_avg"][-1], expected["hot_avg"][ZERO_FROM - 1])
        np.testing.assert_allclose(expected["hot_avg"][-1], expected["hot_avg"][ZERO_FROM - 1] * 0.9 ** 2, rtol=1e-5)
    for result in results:
        replicated, sharded = result["replicated"], result["sharded"]
        assert (replicated["bags"], sharded["bags"]) == ("ReplicatedEmbeddingBags", "ShardedEmbeddingBags")
        assert replicated["shard_numel"] == {s.name: s.num_rows * s.dim for s in SPECS}  # whole on every rank
        assert all(b[1] == s.num_rows for b, s in zip(replicated["bounds"], SPECS))  # named once, on rank 0
        assert replicated["max_lag"] == sharded["max_lag"] == 0
        assert_equal_runs(replicated, expected)
        assert_equal_runs(sharded, expected)
        np.testing.assert_allclose(np.mean([r["replicated"]["losses"] for r in results], axis=0),
                                   expected["losses"], atol=1e-5)


def test_staleness_is_the_sharded_queue_and_stays_within_its_bound() -> None:
    world, steps, staleness = 2, 5, 2
    results = run_world(world, _train_both, world, "adam", steps, staleness, timeout=250)
    synchronous = reference(world, "adam", steps)
    for result in results:
        replicated, sharded = result["replicated"], result["sharded"]
        assert replicated["lags"] == sharded["lags"] == [0, 1, 2, 2, 2]  # reaches the bound, never passes it
        assert_equal_runs(replicated, sharded)
        assert not np.allclose(replicated["tables"]["user"], synchronous["tables"]["user"], atol=1e-5)


def test_shardings_put_a_row_table_whole_on_one_rank_and_train_as_one_process() -> None:
    world, steps = 3, 3
    results = run_world(world, _train_both, world, "adagrad", steps, 0, {"user": "table"}, timeout=250)
    expected = reference(world, "adagrad", steps)
    user = [s.name for s in SPECS].index("user")
    for result in results:
        bounds = result["sharded"]["bounds"][user]
        held = [bounds[r + 1] - bounds[r] for r in range(world)]
        assert sorted(held) == [0, 0, SPECS[user].num_rows]  # whole on one rank
        assert plan_placement(SPECS, world).bounds[user] != bounds  # row-wise without the override
        assert result["sharded"]["specs"] == SPECS  # the collection keeps the user's specs
        assert_equal_runs(result["sharded"], expected)
        assert_equal_runs(result["replicated"], expected)


def _resume(comm: Communicator, world: int, steps: int, cut: int) -> dict[str, Any]:
    """Replicated with staleness 1 (so a state holds a queued update): straight through, and again
    from state() after `cut` steps in a fresh trainer; then a sharded state offered to a replicated
    trainer and the other way round."""
    def trainer(seed_shift: int, replicated: bool = True) -> ShardedEmbeddingTraining:
        def factory() -> nn.Module:
            torch.manual_seed(1 + seed_shift)
            return build_model()
        return ShardedEmbeddingTraining(comm, factory, dense_optimizer("sgd"), SparseAdam(lr=ADAM_LR),
                                        nn.BCEWithLogitsLoss(), staleness=1, replicated=replicated)

    def run(training: ShardedEmbeddingTraining, first: int, last: int) -> None:
        for step in range(first, last):
            training.train_step(*rank_batch(zeroed_log(step, world), comm.rank))

    straight = trainer(0)
    run(straight, 0, cut)
    saved = straight.state()
    run(straight, cut, steps)
    resumed = trainer(1)
    resumed.load_state(saved)
    run(resumed, cut, steps)
    straight.flush()
    resumed.flush()
    same = all(torch.equal(a, b) for a, b in zip(straight.bags.shards + list(straight.model.parameters()),
                                                 resumed.bags.shards + list(resumed.model.parameters())))
    # Every rank's saved tables are the same: any rank's state resumes them all.
    saved_user = saved["tables"]["tables"]["user"]["weight"]
    ranks_agree = all(torch.equal(saved_user, other) for other in comm.allgather(saved_user))
    refusals = []
    sharded = trainer(0, replicated=False)
    for target, state in ((trainer(0), sharded.state()), (sharded, saved)):
        try:
            target.load_state(state)
            refusals.append("")
        except SparkdlError as exc:
            refusals.append(str(exc))
    return {"same": same, "pending": len(saved["tables"]["pending"]), "ranks_agree": ranks_agree,
            "refusals": refusals, "steps": resumed.steps}


def test_replicated_state_resumes_exactly_and_refuses_sharded_states() -> None:
    for result in run_world(2, _resume, 2, 5, 2, timeout=250):
        assert result["same"] and result["steps"] == 5
        assert result["pending"] == 1 and result["ranks_agree"]
        replicated_refusal, sharded_refusal = result["refusals"]
        assert "saved by a sharded run" in replicated_refusal and "replicates" in replicated_refusal
        assert "saved by a replicated run" in sharded_refusal and "shards" in sharded_refusal


BYTES_BATCHES = {"few": 6, "many": 40}  # distinct ids per rank


def _bytes(comm: Communicator, world: int) -> dict[str, Any]:
    """One step of each kind over a small and a ten times larger table, with few and many touched
    rows: what last_bytes reports and (replicated) what the communicator counted."""
    out: dict[str, Any] = {}
    for rows in (100, 1000):
        spec = TableSpec("t", rows, 8)
        for batch, distinct in BYTES_BATCHES.items():
            ids = (torch.arange(distinct) * 2 + comm.rank) % 100  # inside both tables, spread over owners
            for kind in (ShardedEmbeddingBags, ReplicatedEmbeddingBags):
                bags = kind(comm, plan_placement([spec], world), SparseAdam())
                before = comm.bytes_sent
                bags.forward({"t": Bag(ids, torch.arange(0, distinct, 2))})["t"].sum().backward()
                bags.apply_gradients()
                sent = comm.bytes_sent - before
                owned = bags.placement.rows_of("t", comm.rank)
                foreign = int(((ids < owned[0]) | (ids >= owned[1])).sum())
                out[(kind.__name__, rows, batch)] = {**bags.last_bytes, "sent": sent, "foreign": foreign}
    return {str(k): v for k, v in out.items()}


def test_step_bytes_grow_with_the_tables_replicated_and_with_the_touched_rows_sharded() -> None:
    world = 2
    for result in run_world(world, _bytes, world, timeout=250):
        def get(kind: str, rows: int, batch: str) -> dict[str, int]:
            return result[str((kind, rows, batch))]

        for rows in (100, 1000):
            for batch in BYTES_BATCHES:
                replicated = get("ReplicatedEmbeddingBags", rows, batch)
                # Every row of the table, gradients and touched flags, by ring allreduce, whatever the batch.
                assert replicated["gradients"] == 2 * (world - 1) * rows * 8 * 4 // world
                assert replicated["touched"] == 2 * (world - 1) * rows * 4 // world
                assert replicated["ids"] == replicated["rows"] == 0
                assert replicated["sent"] == sum(v for k, v in replicated.items() if k not in ("sent", "foreign"))
                sharded = get("ShardedEmbeddingBags", rows, batch)
                assert sharded["gradients"] == sharded["foreign"] * 8 * 4  # touched rows others own
        assert get("ReplicatedEmbeddingBags", 1000, "few")["gradients"] == \
            10 * get("ReplicatedEmbeddingBags", 100, "few")["gradients"]
        assert get("ShardedEmbeddingBags", 100, "many")["gradients"] > get("ShardedEmbeddingBags", 100, "few")["gradients"]
        assert get("ShardedEmbeddingBags", 1000, "many")["gradients"] < get("ReplicatedEmbeddingBags", 1000, "many")["gradients"]


# Pure tests (one process)

def test_shardings_override_named_tables_and_refuse_unknown_ones() -> None:
    specs = with_shardings(SPECS, {"user": "table", "device": "row"})
    assert [s.sharding for s in specs] == ["table", "row", "row", "table"]
    assert [(s.name, s.num_rows, s.dim, s.pooling) for s in specs] == [(s.name, s.num_rows, s.dim, s.pooling)
                                                                       for s in SPECS]
    assert with_shardings(SPECS, None) == SPECS
    with pytest.raises(ConfigError, match="nope, zzz"):
        with_shardings(SPECS, {"zzz": "row", "nope": "table", "user": "row"})
    with pytest.raises(ConfigError, match="sharding='diagonal'"):
        with_shardings(SPECS, {"user": "diagonal"})


def test_replicated_placement_names_every_row_once_on_rank_zero() -> None:
    placement = replicated_placement(SPECS, 3)
    assert placement.tables == SPECS
    for spec in SPECS:
        assert placement.rows_of(spec.name, 0) == (0, spec.num_rows)
        assert all(placement.rows_of(spec.name, r)[0] == placement.rows_of(spec.name, r)[1] for r in (1, 2))
    with pytest.raises(ConfigError, match="repeat"):
        replicated_placement(SPECS + SPECS[:1], 2)


def _pretrained_rank(comm: Communicator, replicated: bool) -> dict[str, bool]:
    from sparkdl.embeddings import EmbeddingBagCollection, ShardedEmbeddingTraining, TableSpec

    specs = (TableSpec("u", 10, 3), TableSpec("v", 7, 3))
    model = EmbeddingBagCollection(specs)
    with torch.no_grad():
        for t, weight in enumerate(model.weights):
            weight.copy_(torch.arange(weight.numel(), dtype=torch.float32).reshape(weight.shape) + 100 * t)
    expected = {s.name: w.detach().clone() for s, w in zip(specs, model.weights)}
    training = ShardedEmbeddingTraining(comm, nn.Sequential(model, nn.Linear(3, 1)), lambda p: torch.optim.SGD(p, lr=0.1),
                                        RowwiseAdagrad(), lambda out, y: out.sum(), replicated=replicated)
    return {n: torch.equal(t, expected[n]) for n, t in training.full_tables().items()}


@pytest.mark.parametrize("replicated", [False, True])
def test_a_model_given_with_whole_tables_starts_from_its_rows(replicated: bool) -> None:
    """Pretrained tables in a model instance are kept, not redrawn from the seed."""
    assert all(all(r.values()) for r in run_world(2, _pretrained_rank, replicated))
