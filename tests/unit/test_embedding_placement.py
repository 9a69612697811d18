"""Sharded embeddings' pure parts, without processes: placement of tables over W ranks, bucketing of a
batch's distinct ids by owner, the bags' checks, the sparse optimizers against torch's own, the
rank-independent initial rows and the exchange buffers' packing."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from sparkdl.embeddings import Bag, TableSpec, initial_rows, plan_placement
from sparkdl.embeddings.bags import as_bag
from sparkdl.embeddings.bucketing import bucket, owners
from sparkdl.embeddings.exchange import pack, unpack
from sparkdl.embeddings.optimizers import RowwiseAdagrad, SparseAdam
from sparkdl.embeddings.sharded import INIT_BLOCK_ROWS
from sparkdl.errors import ConfigError, SparkdlError


@pytest.mark.parametrize("num_rows,world", [(10, 3), (2, 3), (1, 1), (1000, 7)])
def test_row_wise_blocks_cover_the_table_and_owner_lookup_agrees(num_rows: int, world: int) -> None:
    placement = plan_placement([TableSpec("t", num_rows, 4)], world)
    ranges = [placement.rows_of("t", r) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == num_rows
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, in rank order
    sizes = [stop - start for start, stop in ranges]
    assert max(sizes) - min(sizes) <= 1
    ids = torch.arange(num_rows)
    vectorized = owners(ids, placement.bounds[0]).tolist()
    for row in range(num_rows):
        owner = placement.owner_of_row("t", row)
        start, stop = ranges[owner]
        assert start <= row < stop and vectorized[row] == owner


def test_table_wise_tables_are_whole_on_one_rank_and_balanced_by_bytes() -> None:
    specs = [TableSpec(f"t{i}", rows, dim, sharding="table")
             for i, (rows, dim) in enumerate([(1000, 8), (900, 8), (500, 4), (400, 4), (300, 4), (100, 2)])]
    specs.append(TableSpec("big", 3000, 2, sharding="row"))
    placement = plan_placement(specs, 3)
    for spec in specs[:-1]:
        ranges = [placement.rows_of(spec.name, r) for r in range(3)]
        holders = [r for r, (start, stop) in enumerate(ranges) if stop > start]
        assert len(holders) == 1 and ranges[holders[0]] == (0, spec.num_rows)
        assert all(placement.owner_of_row(spec.name, row) == holders[0] for row in (0, spec.num_rows - 1))
    loads = placement.bytes_per_rank()
    assert sum(loads) == sum(s.nbytes for s in specs)
    assert max(loads) - min(loads) <= max(s.nbytes for s in specs[:-1])  # greedy LPT bound
    assert plan_placement(specs, 3) == placement  # a pure function of the specs and W
    # The two largest table-wise tables do not share a rank when others are empty.
    assert placement.owner_of_row("t0", 0) != placement.owner_of_row("t1", 0)


@pytest.mark.parametrize("make,words", [
    (lambda: TableSpec("a", 0, 4), "num_rows"),
    (lambda: TableSpec("a", 4, 0), "dim"),
    (lambda: TableSpec("a", 4, 2, pooling="max"), "pooling"),
    (lambda: TableSpec("a", 4, 2, sharding="column"), "sharding"),
    (lambda: TableSpec("", 4, 2), "name"),
    (lambda: plan_placement([TableSpec("a", 4, 2), TableSpec("a", 5, 2)], 2), "repeat"),
    (lambda: plan_placement([TableSpec("a", 4, 2)], 0), "world_size"),
    (lambda: plan_placement([], 2), "no embedding tables"),
    (lambda: plan_placement([TableSpec("a", 4, 2)], 2).rows_of("b", 0), "'b'"),
    (lambda: plan_placement([TableSpec("a", 4, 2)], 2).owner_of_row("a", 4), "outside"),
])
def test_bad_specs_are_refused_with_the_option_named(make, words: str) -> None:
    with pytest.raises(ConfigError, match=words) as info:
        make()
    assert info.value.hint


def test_bucketing_asks_each_owner_once_per_distinct_id() -> None:
    bounds = plan_placement([TableSpec("t", 20, 2)], 3).bounds[0]  # (0, 6, 13, 20)
    ids = torch.tensor([15, 3, 3, 7, 19, 15, 0, 12], dtype=torch.int64)
    got = bucket(ids, bounds)
    assert got.unique[got.inverse].tolist() == ids.tolist()
    assert got.counts.tolist() == [2, 2, 2]  # {0, 3}, {7, 12}, {15, 19}
    asked = got.unique[got.order].tolist()
    assert asked == [0, 3, 7, 12, 15, 19]
    assert got.local_rows.tolist() == [0, 3, 1, 6, 2, 6]
    empty = bucket(torch.empty(0, dtype=torch.int64), bounds)
    assert empty.counts.tolist() == [0, 0, 0] and empty.local_rows.numel() == 0


def test_bags_from_lengths_and_their_checks() -> None:
    spec = TableSpec("tags", 10, 3)
    bag = Bag.from_lengths(torch.tensor([1, 2, 3], dtype=torch.int64), torch.tensor([2, 0, 1]))
    assert bag.offsets.tolist() == [0, 2, 2] and bag.num_bags == 3
    assert as_bag(spec, (bag.ids, bag.offsets)).num_bags == 3
    with pytest.raises(SparkdlError, match=r"'tags'.*id 10 is outside \[0, 10\)"):
        as_bag(spec, (torch.tensor([1, 10]), torch.tensor([0])))
    with pytest.raises(ConfigError, match="int64"):
        as_bag(spec, (torch.tensor([1.0]), torch.tensor([0])))
    with pytest.raises(ConfigError, match="offsets"):
        as_bag(spec, (torch.tensor([1, 2]), torch.tensor([1])))
    with pytest.raises(ConfigError, match="sum pooling"):
        as_bag(TableSpec("m", 10, 3, pooling="mean"), (torch.tensor([1]), torch.tensor([0]), torch.ones(1)))
    with pytest.raises(ConfigError, match="shaped like ids"):
        as_bag(spec, (torch.tensor([1, 2]), torch.tensor([0]), torch.ones(3)))


def test_sparse_adam_matches_torch_sparse_adam_bit_for_bit_on_touched_rows() -> None:
    torch.manual_seed(0)
    table = nn.EmbeddingBag(12, 4, mode="sum", sparse=True)
    weight = table.weight.detach().clone()
    reference = torch.optim.SparseAdam(table.parameters(), lr=0.05)
    ours = SparseAdam(lr=0.05)
    state = ours.init_state(weight)
    for step in range(4):
        ids = torch.tensor([step, 3, 3, 7 + step % 2], dtype=torch.int64)
        reference.zero_grad()
        (table(ids, torch.tensor([0, 2])).pow(2).sum() * (step + 1)).backward()
        grad = table.weight.grad.coalesce()
        ours.update(weight, state, grad.indices()[0], grad.values())
        reference.step()
    torch.testing.assert_close(weight, table.weight.detach(), rtol=0, atol=0)
    torch.testing.assert_close(state["exp_avg"], reference.state[table.weight]["exp_avg"], rtol=0, atol=0)
    assert int(state["step"]) == int(reference.state[table.weight]["step"]) == 4
    assert weight[11].tolist() == table.weight[11].tolist()  # untouched rows never move


def test_rowwise_adagrad_keeps_one_accumulator_per_row() -> None:
    weight = torch.ones(5, 2)
    optimizer = RowwiseAdagrad(lr=0.5, eps=1e-8)
    state = optimizer.init_state(weight)
    optimizer.update(weight, state, torch.tensor([1, 3]), torch.tensor([[3.0, 4.0], [0.0, 0.0]]))
    assert state["sum"].tolist() == [0.0, 12.5, 0.0, 0.0, 0.0]  # mean of 9 and 16
    expected = 1 - 0.5 * torch.tensor([3.0, 4.0]) / (12.5 ** 0.5 + 1e-8)
    torch.testing.assert_close(weight[1], expected)
    assert weight[[0, 2, 3, 4]].eq(1).all()
    with pytest.raises(ConfigError, match="lr"):
        RowwiseAdagrad(lr=0.0)
    with pytest.raises(ConfigError, match="betas"):
        SparseAdam(betas=(0.9, 1.0))


def test_initial_rows_do_not_depend_on_who_draws_them() -> None:
    spec = TableSpec("users", INIT_BLOCK_ROWS * 2 + 100, 3)
    whole = initial_rows(spec, 0, spec.num_rows, seed=7)
    assert whole.shape == (spec.num_rows, 3)
    assert whole.abs().max() <= (1 / spec.num_rows) ** 0.5
    edges = [(0, 10), (INIT_BLOCK_ROWS - 5, INIT_BLOCK_ROWS + 5), (spec.num_rows - 1, spec.num_rows), (4, 4)]
    for start, stop in edges:
        assert torch.equal(initial_rows(spec, start, stop, seed=7), whole[start:stop])
    assert not torch.equal(initial_rows(spec, 0, 10, seed=8), whole[:10])
    assert not torch.equal(initial_rows(TableSpec("items", spec.num_rows, 3), 0, 10, seed=7), whole[:10])


def test_pack_and_unpack_are_inverse_over_tables_of_different_widths() -> None:
    dims = torch.tensor([2, 3])
    counts = torch.tensor([[1, 0], [2, 1]])
    chunks = [[torch.full((1, 2), 1.0), torch.empty(0, 3)], [torch.full((2, 2), 2.0), torch.full((1, 3), 3.0)]]
    flat = pack(chunks, flat=True)
    assert flat.numel() == 2 + 4 + 3
    back = unpack(flat, counts, dims)
    for r in range(2):
        for t in range(2):
            assert torch.equal(back[r][t], chunks[r][t].reshape(-1, int(dims[t])))
