"""ShardedEmbeddingBags on real gloo ranks (W=2 and 3) against a single process on the global batch:
nn.EmbeddingBag with the same initial rows and a by-hand row-wise Adagrad, or nn.EmbeddingBag(sparse=True)
with torch.optim.SparseAdam. Weights and optimizer state must agree after a few steps, for row-wise and
table-wise tables, multi-hot bags, per-sample weights and mean pooling; the bounded-staleness mode equals
the same reference with updates applied tau steps late and never lags more than tau; the bytes a step
sends depend on the rows the batches touch, never on the table sizes."""
from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from gloo_world import run_world
from sparkdl.comm.base import Communicator
from sparkdl.comm.emulated import EmulatedNetwork
from sparkdl.embeddings import Bag, ShardedEmbeddingBags, TableSpec, initial_rows, plan_placement
from sparkdl.embeddings.optimizers import RowwiseAdagrad, SparseAdam

pytestmark = pytest.mark.timeout(180)
LOCAL_BATCH = 5
SEED = 3
SPECS = (TableSpec("user", 50, 4, pooling="sum", sharding="row"),    # weighted multi-hot
         TableSpec("item", 23, 3, pooling="mean", sharding="row"),   # mean of multi-hot
         TableSpec("tag", 9, 2, pooling="sum", sharding="table"),
         TableSpec("page", 7, 5, pooling="mean", sharding="table"))


def optimizer_of(name: str) -> RowwiseAdagrad | SparseAdam:
    return RowwiseAdagrad(lr=0.3) if name == "adagrad" else SparseAdam(lr=0.05)


def global_batch(step: int, world: int, specs=SPECS) -> dict[str, tuple[torch.Tensor, ...]]:
    """Every rank's samples of one step; rank r's are [r*LOCAL_BATCH, (r+1)*LOCAL_BATCH). Skewed ids
    (the small ones hot), bags of 0-3 ids, weights on the sum-pooled row-wise table."""
    generator = torch.Generator().manual_seed(1000 + step)
    batch = {}
    for spec in specs:
        lengths = torch.randint(0, 4, (world * LOCAL_BATCH,), generator=generator)
        n = int(lengths.sum())
        ids = (torch.rand(n, generator=generator).pow(3) * spec.num_rows).long().clamp_(max=spec.num_rows - 1)
        weights = torch.rand(n, generator=generator) + 0.5 if spec.name == "user" else None
        batch[spec.name] = (ids, lengths, weights)
    return batch


def local_bags(batch: dict[str, Any], rank: int) -> dict[str, Bag]:
    out = {}
    for name, (ids, lengths, weights) in batch.items():
        ends = torch.cumsum(lengths, 0)
        first, last = rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH
        lo = int(ends[first - 1]) if first else 0
        hi = int(ends[last - 1])
        out[name] = Bag.from_lengths(ids[lo:hi], lengths[first:last], None if weights is None else weights[lo:hi])
    return out


def loss_of(pooled: dict[str, torch.Tensor]) -> torch.Tensor:
    """A non-linear loss mixing the tables, the mean over the samples at hand."""
    total = 0
    for name, value in sorted(pooled.items()):
        mix = torch.linspace(-1.0, 1.5, value.shape[1])
        total = total + (value * mix).sum(1).pow(2) + value.sum(1).sin()
    return total.mean()


def _train(comm: Communicator, world: int, optimizer: str, steps: int, staleness: int) -> dict[str, Any]:
    placement = plan_placement(SPECS, world)
    bags = ShardedEmbeddingBags(comm, placement, optimizer_of(optimizer), staleness=staleness, seed=SEED)
    sent = []
    for step in range(steps):
        before = comm.bytes_sent
        pooled = bags(local_bags(global_batch(step, world), comm.rank))
        assert all(value.requires_grad for value in pooled.values())
        loss_of(pooled).backward()
        bags.apply_gradients()
        sent.append((comm.bytes_sent - before, sum(bags.last_bytes.values())))
    bags.flush()
    return {"weights": {s.name: bags.local_weight(s.name).numpy().copy() for s in SPECS},
            "state": {s.name: {k: v.numpy().copy() for k, v in bags.states[i].items()} for i, s in enumerate(SPECS)},
            "max_lag": bags.max_lag, "sent": sent}


def apply_by_hand(tables: dict[str, nn.EmbeddingBag], adam: torch.optim.SparseAdam | None,
                  accumulators: dict[str, torch.Tensor], grads: list[torch.Tensor]) -> None:
    """SparseAdam's step, or row-wise Adagrad written out, on the sparse gradients of one step."""
    if adam is not None:
        for table, g in zip(tables.values(), grads):
            table.weight.grad = g
        adam.step()
        return
    with torch.no_grad():
        for (name, table), g in zip(tables.items(), grads):
            rows, values = g.indices()[0], g.values()
            acc = accumulators[name]
            acc[rows] += values.pow(2).mean(1)
            table.weight[rows] -= 0.3 * values / (acc[rows].sqrt() + 1e-8).unsqueeze(1)


def reference(world: int, optimizer: str, steps: int, staleness: int) -> tuple[dict, dict]:
    """One process, the global batch, the same initial rows; gradients applied `staleness` steps late."""
    tables = {s.name: nn.EmbeddingBag(s.num_rows, s.dim, mode=s.pooling, sparse=True) for s in SPECS}
    for spec in SPECS:
        tables[spec.name].weight.data.copy_(initial_rows(spec, 0, spec.num_rows, seed=SEED))
    params = [t.weight for t in tables.values()]
    adam = torch.optim.SparseAdam(params, lr=0.05) if optimizer == "adam" else None
    accumulators = {s.name: torch.zeros(s.num_rows) for s in SPECS}
    queue: deque = deque()
    for step in range(steps):
        batch = global_batch(step, world)
        pooled = {}
        for name, (ids, lengths, weights) in batch.items():
            bag = Bag.from_lengths(ids, lengths, weights)
            pooled[name] = tables[name](bag.ids, bag.offsets, per_sample_weights=bag.weights)
        for p in params:
            p.grad = None
        loss_of(pooled).backward()
        queue.append([p.grad.coalesce() for p in params])
        while len(queue) > staleness:
            apply_by_hand(tables, adam, accumulators, queue.popleft())
    while queue:  # as ShardedEmbeddingBags.flush() at the end
        apply_by_hand(tables, adam, accumulators, queue.popleft())
    weights = {n: t.weight.detach().numpy() for n, t in tables.items()}
    if adam is not None:
        state = {n: {k: adam.state[t.weight][k] for k in ("exp_avg", "exp_avg_sq")} for n, t in tables.items()}
    else:
        state = {n: {"sum": acc} for n, acc in accumulators.items()}
    return weights, {n: {k: np.asarray(v) for k, v in s.items()} for n, s in state.items()}


def assemble(results: list[dict], world: int, key: str, name: str, field: str | None = None) -> np.ndarray:
    """The whole table (or state) from every rank's rows, in row order."""
    placement = plan_placement(SPECS, world)
    parts = []
    for rank in range(world):
        start, stop = placement.rows_of(name, rank)
        value = results[rank][key][name] if field is None else results[rank][key][name][field]
        assert value.shape[0] == stop - start  # each rank holds only its own rows
        parts.append(value)
    return np.concatenate(parts)


@pytest.mark.parametrize("world,optimizer", [(2, "adagrad"), (3, "adam"), (3, "adagrad"), (2, "adam")])
def test_synchronous_sharded_training_equals_one_process_on_the_global_batch(world: int, optimizer: str) -> None:
    steps = 4
    results = run_world(world, _train, world, optimizer, steps, 0, timeout=150)
    weights, state = reference(world, optimizer, steps, 0)
    for spec in SPECS:
        start = initial_rows(spec, 0, spec.num_rows, seed=SEED).numpy()
        assert not np.allclose(weights[spec.name], start)  # the optimizer did move rows
        got = assemble(results, world, "weights", spec.name)
        np.testing.assert_allclose(got, weights[spec.name], atol=1e-6, rtol=0)
        for field, expected in state[spec.name].items():
            np.testing.assert_allclose(assemble(results, world, "state", spec.name, field), expected, atol=1e-6, rtol=0)
    if optimizer == "adam":
        assert all(int(r["state"][s.name]["step"]) == steps for r in results for s in SPECS)
    assert all(r["max_lag"] == 0 for r in results)


def test_bounded_staleness_lags_at_most_tau_and_equals_late_updates() -> None:
    world, steps, tau = 2, 6, 2
    results = run_world(world, _train, world, "adagrad", steps, tau, timeout=150)
    assert [r["max_lag"] for r in results] == [tau, tau]  # reached, never exceeded
    late, _ = reference(world, "adagrad", steps, tau)
    synchronous, _ = reference(world, "adagrad", steps, 0)
    for spec in SPECS:
        got = assemble(results, world, "weights", spec.name)
        np.testing.assert_allclose(got, late[spec.name], atol=1e-6, rtol=0)
    assert any(not np.allclose(late[s.name], synchronous[s.name], atol=1e-5) for s in SPECS)  # the lag is real


def _bytes_per_step(comm: Communicator, num_rows: int) -> dict[str, Any]:
    """One step on a table of `num_rows` rows touched only at ids < 40: bytes by exchange, and the
    count each rank expects from the ids it asks others for and others ask it for."""
    specs = (TableSpec("big", num_rows, 8), TableSpec("small", 30, 4, sharding="table"))
    placement = plan_placement(specs, comm.size)
    bags = ShardedEmbeddingBags(comm, placement, RowwiseAdagrad(), seed=1)
    generator = torch.Generator().manual_seed(5)
    per_rank = [{s.name: torch.randint(0, min(40, s.num_rows), (6,), generator=generator) for s in specs}
                for _ in range(comm.size)]
    before = comm.bytes_sent
    pooled = bags({name: (ids, torch.tensor([0, 3])) for name, ids in per_rank[comm.rank].items()})
    sum(v.sum() for v in pooled.values()).backward()
    bags.apply_gradients()
    expected = 8 * len(specs) * (comm.size - 1)  # the counts
    for t, spec in enumerate(specs):
        bounds = placement.bounds[t]
        mine = range(bounds[comm.rank], bounds[comm.rank + 1])
        asked = {int(i) for i in per_rank[comm.rank][spec.name].unique() if int(i) not in mine}
        expected += len(asked) * (8 + 4 * spec.dim)  # ids out, gradients out
        for other in range(comm.size):
            if other != comm.rank:  # rows we return to each peer that asked
                expected += 4 * spec.dim * sum(int(i) in mine for i in per_rank[other][spec.name].unique())
    return {"charged": comm.bytes_sent - before, "reported": bags.last_bytes, "expected": expected}


@pytest.mark.parametrize("world", [2, 3])
def test_bytes_per_step_scale_with_touched_rows_not_table_size(world: int) -> None:
    small = run_world(world, _bytes_per_step, 1_000, timeout=120)
    large = run_world(world, _bytes_per_step, 300_000, timeout=120)
    for few, many in zip(small, large):
        assert few["charged"] == few["expected"] == sum(few["reported"].values())
        # A table 300x larger costs what the small one does when the batches touch the same rows.
        assert many["charged"] == few["charged"] and many["reported"] == few["reported"]
        assert few["charged"] < 2_000



def _resume(comm: Communicator, world: int, steps: int, cut: int, staleness: int) -> dict[str, Any]:
    """Train `steps` steps straight, and again from the shard state saved after `cut` steps into a
    fresh module (other initial rows), queued stale updates included. Then the step order's checks."""
    from sparkdl.errors import SparkdlError

    placement = plan_placement(SPECS, world)

    def run(bags: ShardedEmbeddingBags, first: int, last: int) -> None:
        for step in range(first, last):
            loss_of(bags(local_bags(global_batch(step, world), comm.rank))).backward()
            bags.apply_gradients()

    straight = ShardedEmbeddingBags(comm, placement, SparseAdam(lr=0.05), staleness=staleness, seed=SEED)
    run(straight, 0, cut)
    saved = straight.shard_state()
    run(straight, cut, steps)
    resumed = ShardedEmbeddingBags(comm, placement, SparseAdam(lr=0.05), staleness=staleness, seed=SEED + 1)
    differed = not all(torch.equal(a, b) for a, b in zip(straight.shards, resumed.shards))
    resumed.load_shard_state(saved)
    run(resumed, cut, steps)
    same = all(torch.equal(a, b) for a, b in zip(straight.shards, resumed.shards)) and all(
        torch.equal(x[k], y[k]) for x, y in zip(straight.states, resumed.states) for k in x)
    batch = local_bags(global_batch(0, world), comm.rank)
    scored = resumed(batch, train=False)  # lookups that do not train need no apply_gradients
    errors = []
    resumed(batch)
    for call in (lambda: resumed(batch), resumed.apply_gradients, resumed.apply_gradients):
        try:
            call()
        except SparkdlError as exc:
            errors.append(str(exc).splitlines()[0])
    return {"pending": len(saved["pending"]), "differed": differed, "same": same, "errors": errors,
            "scored_grad": any(v.requires_grad for v in scored.values())}


def test_shard_state_resumes_exactly_with_stale_updates_queued() -> None:
    results = run_world(2, _resume, 2, 5, 2, 1, timeout=120)
    for result in results:
        assert result["pending"] == 1  # staleness 1: one step's update still queued at the cut
        assert result["differed"] and result["same"]
        assert not result["scored_grad"]
        assert result["errors"] == ["ShardedEmbeddingBags.forward ran again before apply_gradients()",
                                    "apply_gradients() ran without a training lookup before it"]


def _all_to_all_both_ways(comm: Communicator) -> dict[str, Any]:
    """gloo's all_to_all_single (the backend's override) against the interface's point-to-point default."""
    world, rank = comm.size, comm.rank
    send_rows = [(rank + dst) % 3 for dst in range(world)]  # some empty, uneven
    recv_rows = [(src + rank) % 3 for src in range(world)]
    tensor = torch.cat([torch.full((n, 2), float(10 * rank + dst)) for dst, n in enumerate(send_rows)])
    before = comm.bytes_sent
    native = comm.all_to_all(tensor, send_rows, recv_rows)
    middle = comm.bytes_sent
    default = Communicator.all_to_all(comm, tensor, send_rows, recv_rows)
    after = comm.bytes_sent
    emulated = EmulatedNetwork(comm, 0.0, 1e12).all_to_all(tensor, send_rows, recv_rows)  # wrappers keep working
    expected = torch.cat([torch.full((n, 2), float(10 * src + rank)) for src, n in enumerate(recv_rows)])
    return {"native": torch.equal(native, expected), "default": torch.equal(default, expected),
            "emulated": torch.equal(emulated, expected),
            "bytes": (middle - before, after - middle, comm.bytes_sent - after),
            "expected_bytes": 8 * (sum(send_rows) - send_rows[rank])}


@pytest.mark.parametrize("world", [2, 3])
def test_all_to_all_native_and_point_to_point_agree(world: int) -> None:
    for result in run_world(world, _all_to_all_both_ways, timeout=60):
        assert result["native"] and result["default"] and result["emulated"]
        assert result["bytes"] == (result["expected_bytes"],) * 3  # rows to other ranks only


def _uneven_batches(comm: Communicator) -> dict[str, Any]:
    """Rank 0 looks up only empty bags of one table, rank 1 both tables (one with no bags at all)."""
    specs = (TableSpec("a", 10, 3), TableSpec("b", 4, 2, pooling="mean", sharding="table"))
    bags = ShardedEmbeddingBags(comm, plan_placement(specs, 2), RowwiseAdagrad(lr=0.5), seed=2)
    before = [w.clone() for w in bags.shards]
    if comm.rank == 0:
        batch = {"a": (torch.empty(0, dtype=torch.int64), torch.tensor([0, 0]))}
    else:
        batch = {"a": (torch.tensor([1, 9, 9]), torch.tensor([0, 1])),
                 "b": (torch.empty(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))}
    pooled = bags(batch)
    sum(value.sum() for value in pooled.values()).backward()
    bags.apply_gradients()
    table = initial_rows(specs[0], 0, 10, seed=2)
    expected = torch.zeros(2, 3) if comm.rank == 0 else torch.stack([table[1], 2 * table[9]])
    start, stop = bags.placement.rows_of("a", comm.rank)
    moved = sorted(start + i for i in range(stop - start) if not torch.equal(bags.shards[0][i], before[0][i]))
    return {"shapes": {k: list(v.shape) for k, v in pooled.items()}, "lookup": torch.allclose(pooled["a"], expected),
            "moved": moved, "b_unchanged": torch.equal(bags.shards[1], before[1])}


def test_tables_missing_or_empty_on_some_ranks() -> None:
    zero, one = run_world(2, _uneven_batches, timeout=60)
    assert zero["shapes"] == {"a": [2, 3]} and one["shapes"] == {"a": [2, 3], "b": [0, 2]}
    assert zero["lookup"] and one["lookup"]
    assert zero["moved"] + one["moved"] == [1, 9]  # only the rows some rank touched
    assert zero["b_unchanged"] and one["b_unchanged"]
