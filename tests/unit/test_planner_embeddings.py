"""The planner's price of replicated against sharded embedding tables (sparkdl/planner/embeddings.py):
pure numbers, no torch work, no Spark."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from sparkdl.embeddings.placement import TableSpec
from sparkdl.errors import ConfigError
from sparkdl.planner.cost import Network
from sparkdl.planner.embeddings import (IdStats, decide_embeddings, expected_distinct, measure_ids, replicated,
                                        sharded)

MBIT_100 = Network(latency_s=0.5e-3, bandwidth_Bps=100e6 / 8)
GBIT_10 = Network(latency_s=1e-3, bandwidth_Bps=10e9 / 8)


def stats_of(table: TableSpec, per_rank: float, world: int = 4) -> IdStats:
    return IdStats(table.name, table.num_rows, 1.0, 512, world, per_rank, min(world * per_rank, table.num_rows), 0)


def power_law(num_ids: int, exponent: float) -> list[float]:
    return [1.0 / (i + 1) ** exponent for i in range(num_ids)]


def test_distinct_ids_match_an_exact_count_on_a_power_law_sample() -> None:
    rng = random.Random(7)
    ids, weights = range(20_000), power_law(20_000, 1.1)
    sample = Counter(rng.choices(ids, weights=weights, k=200_000))
    counts = sorted(sample.values(), reverse=True)
    batch = 2048
    exact = sum(len(set(rng.choices(ids, weights=weights, k=batch))) for _ in range(40)) / 40
    estimate = expected_distinct(counts, batch)
    assert abs(estimate - exact) / exact < 0.03, (estimate, exact)
    # The summary the driver collects: the top 500 counts, the rest as (ids, total).
    top, rest = counts[:500], counts[500:]
    summary = expected_distinct(top, batch, tail_ids=len(rest), tail_total=sum(rest))
    assert abs(summary - exact) / exact < 0.10, (summary, exact)
    assert batch > exact  # a power law repeats its head: far fewer distinct ids than draws


def test_expected_distinct_limits_and_the_closed_form() -> None:
    assert expected_distinct([5, 5, 5, 5], 1) == pytest.approx(1.0)
    assert expected_distinct([5, 5, 5, 5], 10**6) == pytest.approx(4.0)
    # k equally likely ids: k (1 - (1 - 1/k)^n)
    assert expected_distinct([3] * 100, 50) == pytest.approx(100 * (1 - 0.99 ** 50))
    assert expected_distinct([], 10) == 0.0
    with pytest.raises(ConfigError, match="tail_ids"):
        expected_distinct([1], 10, tail_ids=0, tail_total=5)


def test_measure_ids_counts_lookups_per_row_and_caps_at_the_table() -> None:
    # 1000 sampled rows of a two-hot column over 10 ids: 2 lookups per row, at most 10 distinct.
    stats = measure_ids("tags", 10, [200] * 10, sample_rows=1000, batch_rows=64, world=4)
    assert stats.ids_per_row == pytest.approx(2.0)
    assert stats.distinct_per_rank == pytest.approx(10 * (1 - 0.9 ** 128))
    assert stats.distinct_per_step <= 10 and stats.touched_share <= 1.0
    with pytest.raises(ConfigError, match="batch_rows"):
        measure_ids("tags", 10, [1], sample_rows=10, batch_rows=0, world=4)


def test_sharded_bytes_follow_the_touched_rows_not_the_table_size() -> None:
    small, large = TableSpec("item", 10**5, 16), TableSpec("item", 10**7, 16)
    sent = {t.num_rows: sharded([t], {"item": stats_of(t, 1000)}, 4, MBIT_100, "rowwise_adagrad").bytes_per_step
            for t in (small, large)}
    # ids out 8 x 1000 x 3/4, rows served 3 x 1000/4 x 16 x 4, gradients 1000 x 3/4 x 16 x 4, counts 8 x 3
    assert sent[10**5] == sent[10**7] == pytest.approx(6000 + 48000 + 48000 + 24)
    doubled = sharded([large], {"item": stats_of(large, 2000)}, 4, MBIT_100, "rowwise_adagrad").bytes_per_step
    assert doubled == pytest.approx(2 * (sent[10**7] - 24) + 24)
    full = {t.num_rows: replicated([t], 4, MBIT_100, "rowwise_adagrad").bytes_per_step for t in (small, large)}
    assert full[10**7] == pytest.approx(100 * full[10**5])


def test_replicated_for_a_tiny_table_on_a_fast_link_sharded_for_a_large_one_at_100_mbit() -> None:
    tiny = TableSpec("country", 200, 8)
    fast = decide_embeddings([tiny], {"country": stats_of(tiny, 150)}, 4, GBIT_10)
    assert fast.choice.name == "replicated" and not fast.sharded
    assert fast.choice.step_s < min(o.step_s for o in fast.options[1:])
    big = TableSpec("item", 10**7, 16)
    slow = decide_embeddings([big], {"item": stats_of(big, 400)}, 4, MBIT_100)
    assert slow.sharded and slow.choice.name == "sharded(row-wise)"
    assert slow.choice.bytes_per_step * 1000 < slow.options[0].bytes_per_step


def test_few_small_tables_on_many_ranks_go_table_wise_and_a_large_one_row_wise() -> None:
    # 16 ranks, 1 ms latency: three whole small tables spare the requests and gradients to every peer
    # (3 owners to message instead of 15).
    net = Network(latency_s=1e-3, bandwidth_Bps=1e9 / 8)
    small = [TableSpec(name, 10**5, 32) for name in ("a", "b", "c")]  # 12 MiB each: too large to allreduce
    stats = {t.name: stats_of(t, 300, 16) for t in small}
    decision = decide_embeddings(small, stats, 16, net)
    assert decision.choice.name == "sharded(table-wise)"
    by_name = {o.name: o for o in decision.options}
    assert decision.choice.step_s < by_name["sharded(row-wise)"].step_s
    assert decision.choice.messages < by_name["sharded(row-wise)"].messages
    assert "table-wise: a, b, c" in decision.explain()
    # A large table whole on one rank: its owner serves 15 ranks' lookups alone, so it stays row-wise.
    item = TableSpec("item", 10**7, 64)
    mixed = decide_embeddings(small + [item], {**stats, "item": stats_of(item, 5000, 16)}, 16, net)
    assert dict(mixed.choice.shardings)["item"] == "row"
    whole = next(o for o in mixed.options if o.name == "sharded(table-wise)")
    assert whole.step_s > 2 * mixed.choice.step_s


def test_replicated_is_refused_when_the_tables_exceed_one_rank() -> None:
    # Replicated would be faster here (1 ms latency: one allreduce beats four all-to-alls) but with its
    # gradient and optimizer state the table does not fit 512 KiB.
    table = TableSpec("user", 2000, 64)
    stats = {"user": stats_of(table, 50)}
    free = decide_embeddings([table], stats, 4, GBIT_10)
    assert free.choice.name == "replicated"
    bounded = decide_embeddings([table], stats, 4, GBIT_10, memory_budget=512 * 1024)
    assert bounded.sharded and not bounded.options[0].feasible
    assert "exceed one rank's 512.0 KiB" in bounded.options[0].reason
    with pytest.raises(ConfigError, match="launch.max_memory_per_rank"):
        decide_embeddings([table], stats, 4, GBIT_10, memory_budget=16 * 1024)


def test_explain_names_the_choice_and_the_reason() -> None:
    table = TableSpec("item", 5 * 10**7, 16)  # 3.0 GiB of weights
    decision = decide_embeddings([table], {"item": stats_of(table, 3000)}, 4, MBIT_100, memory_budget=2 * 2**30)
    text = decision.explain()
    assert "chosen: sharded(row-wise)" in text and "100 Mbit/s" in text
    assert "vs replicated" in text and "exceed one rank's 2.0 GiB" in text
    marked = [line for line in text.splitlines() if line.startswith("*")]
    assert len(marked) == 1 and "sharded(row-wise)" in marked[0]
    replicated_line = next(line for line in text.splitlines() if line.strip().startswith("replicated"))
    assert " no " in replicated_line
    assert "sharding: row-wise: item" in text


def test_one_rank_needs_no_communication_and_keeps_replicated() -> None:
    table = TableSpec("item", 1000, 8)
    decision = decide_embeddings([table], {"item": stats_of(table, 100, 1)}, 1, MBIT_100)
    assert decision.choice.name == "replicated" and decision.choice.step_s == 0.0


def test_missing_statistics_and_unknown_optimizers_are_refused() -> None:
    table = TableSpec("item", 1000, 8)
    with pytest.raises(ConfigError, match="item"):
        decide_embeddings([table], {}, 4, MBIT_100)
    with pytest.raises(ConfigError, match="rowwise_adagrad"):
        decide_embeddings([table], {"item": stats_of(table, 10)}, 4, MBIT_100, optimizer="sgd")


def test_the_planner_prices_embeddings_without_loading_torch() -> None:
    """The planner's cost model imports the placement through sparkdl.embeddings, whose other
    modules need torch: the package loads them on first use only."""
    import subprocess
    import sys

    code = "import sys, sparkdl.planner.embeddings; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr
