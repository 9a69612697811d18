"""The planner chooses by predicted time to data parallel's loss, not time per step (issue 53, parts 2
and 3): k (planner/steps_to_loss.py) prices the extra steps of an approximate strategy, a close call
goes to the exact strategy (data parallel among exact ones), and the choice holds across the
calibration's range. The embedding placement (planner/embeddings.py) is stable the same way and
counts the touched-row flags replicated tables send. Numbers only: no Spark, no timing."""
from __future__ import annotations

import random
import subprocess
import sys
from typing import Any

import pytest

from sparkdl.embeddings.placement import TableSpec
from sparkdl.planner.cost import Network, allreduce_bytes
from sparkdl.planner.embeddings import IdStats, decide_embeddings, replicated
from sparkdl.planner.plan import CLOSE_CALL, Candidate, Plan, choose, decide
from sparkdl.planner.steps_to_loss import (H_FIT, K_FIT, M_FIT, N_FIT, diloco_steps_factor, ist_steps_factor,
                                           steps_factor, with_steps_factors)


def candidate(strategy: str, compute_ms: float, comm_ms: float, k: float = 1.0, **options: Any) -> Candidate:
    return Candidate(strategy=strategy, options=tuple({"strategy": strategy, **options}.items()),
                     predicted_step_s=(compute_ms + comm_ms) / 1e3, bytes_per_step=1.0, memory_bytes=1.0,
                     feasible=True, reason="", compute_s=compute_ms / 1e3, comm_s=comm_ms / 1e3, steps_factor=k)


# -- k: the steps an approximate strategy needs, as a multiple of data parallel's ------------------

def test_k_is_fitted_to_the_projects_measurement_and_conservative_over_its_range() -> None:
    assert diloco_steps_factor(N_FIT, M_FIT, H_FIT) == pytest.approx(K_FIT)
    assert diloco_steps_factor(0.46e6, 4, 192) >= K_FIT  # the measured H range was 104-192
    # >= 1; falls with the model's size, rises with replicas and with H
    sizes = [diloco_steps_factor(n, 4, 100) for n in (1e5, 1e6, 1e8, 1e10)]
    assert sizes == sorted(sizes, reverse=True) and min(sizes) > 1.0
    replicas = [diloco_steps_factor(1e6, m, 100) for m in (1, 2, 4, 8, 16)]
    assert replicas[0] == 1.0 and replicas == sorted(replicas) and len(set(replicas)) == 5
    rounds = [diloco_steps_factor(1e6, 4, h) for h in (10, 50, 104, 200, 500)]
    assert rounds == sorted(rounds) and len(set(rounds[2:])) == 3
    # no discount below the fitted H: the bed measured k 1.67-2.0 at M=2, H=10 on a small GPT
    assert rounds[0] == rounds[1] == rounds[2] and diloco_steps_factor(137e3, 2, 10) >= 1.67
    # below 8 bits costs a little more; 8 and 16 bits cost nothing (ALGORITHMS.md)
    assert diloco_steps_factor(1e6, 4, 100, 4) > diloco_steps_factor(1e6, 4, 100, 8) == \
        diloco_steps_factor(1e6, 4, 100, 32)
    assert ist_steps_factor(2) == pytest.approx(2.0) and ist_steps_factor(8) > ist_steps_factor(4) > 1


def test_k_per_candidate_counts_islands_as_replicas_and_exact_strategies_as_one() -> None:
    islands = (("a", "b"), ("c", "d"))
    flat, _ = steps_factor("diloco", {"sync_every": 100}, 1e6, 4)
    grouped, rule = steps_factor("islands", {"sync_every": 100, "islands": islands}, 1e6, 4)
    assert grouped == pytest.approx(diloco_steps_factor(1e6, 2, 100)) and grouped < flat
    assert "M=2 replicas" in rule and "H=100" in rule and f"k={K_FIT:g}" in rule
    assert steps_factor("diloco", {"sync_every": 100, "sync_dtype": "int4"}, 1e6, 4)[0] > flat
    for exact in ("data_parallel", "hybrid", "sharded"):
        assert steps_factor(exact, {}, 1e6, 4) == (1.0, "")
    filled = with_steps_factors([candidate("data_parallel", 1, 1), candidate("diloco", 1, 0, sync_every=100)],
                                1e6, 4)
    assert [c.steps_factor for c in filled] == [1.0, pytest.approx(flat)] and filled[1].steps_rule


def test_k_is_standard_library_only() -> None:
    code = "import sys, sparkdl.planner.steps_to_loss, sparkdl.planner.plan; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr


# -- choosing by time to loss ---------------------------------------------------------------------

def test_six_times_cheaper_steps_at_k_2_3_are_chosen_and_explained() -> None:
    candidates = [candidate("data_parallel", 10.0, 50.0), candidate("diloco", 9.5, 0.5, k=2.3, sync_every=104)]
    index, reason = choose(candidates)
    assert index == 1, reason
    assert "6.00x cheaper steps" in reason and "k=2.30x the steps" in reason and "2.6x sooner" in reason
    plan = Plan(candidates=tuple(candidates), chosen=index, world=4, latency_s=1e-3, bandwidth_Bps=2.5e6, steps=1000)
    text = plan.explain()
    assert "to loss (s)" in text and " 2.30 " in text
    assert "60.0" in text and "23.0" in text  # 1000 steps x 60 ms; 2.3 x 1000 x 10 ms
    params = plan.as_params()
    assert params["plan.steps_factor"] == "2.300" and params["plan.predicted_to_loss"] == "23.0 s"


def test_a_step_only_1_06x_cheaper_is_not_chosen() -> None:
    index, reason = choose([candidate("data_parallel", 3.0, 7.6), candidate("diloco", 9.9, 0.1, k=2.3)])
    assert index == 0 and "only 0.46x sooner" in reason and "1.06x cheaper steps" in reason
    # even at k=1 (no extra steps) 1.06x is a close call: exact
    index, reason = choose([candidate("data_parallel", 3.0, 7.6), candidate("diloco", 9.9, 0.1, k=1.0)])
    assert index == 0 and "a closer call goes to exact" in reason


def test_a_close_call_goes_to_the_exact_strategy() -> None:
    # time to loss 10% shorter: inside the band
    inside = [candidate("data_parallel", 40.0, 60.0), candidate("diloco", 37.0, 0.5, k=2.4)]
    assert candidates_ratio(inside) == pytest.approx(100 / 90, rel=1e-3) and choose(inside)[0] == 0
    # 20% shorter: outside it
    outside = [candidate("data_parallel", 40.0, 60.0), candidate("diloco", 34.0, 0.72, k=2.4)]
    assert candidates_ratio(outside) > 1 + CLOSE_CALL and choose(outside)[0] == 1


def candidates_ratio(candidates: list[Candidate]) -> float:
    return candidates[0].to_loss_s / candidates[1].to_loss_s


def test_among_exact_strategies_a_close_call_goes_to_data_parallel() -> None:
    dp, hybrid = candidate("data_parallel", 50.0, 60.0), candidate("hybrid", 100.0, 0.0, stages=2)
    index, reason = choose([dp, hybrid])
    assert index == 0 and "within 15%" in reason and "a close call goes to data parallel" in reason
    slower = candidate("data_parallel", 50.0, 70.0)
    assert choose([slower, hybrid])[0] == 1
    # the calibration's ends choose different exact layouts: data parallel, whichever end had it
    measured = [candidate("data_parallel", 50.0, 80.0), candidate("hybrid", 100.0, 1.0, stages=2)]
    optimistic = [candidate("data_parallel", 40.0, 20.0), candidate("hybrid", 90.0, 1.0, stages=2)]
    decision = decide(measured, optimistic)
    assert decision.index == 0 and "the calibration's ends disagree" in decision.reason


def test_among_approximate_strategies_a_close_call_goes_to_the_fewest_extra_steps() -> None:
    # the bed's 20 Mbit/s MLP: DiLoCo (k 1.71) and IST (k 2.0) 6 % apart in time to loss, in either order
    dp = candidate("data_parallel", 8.0, 520.0)
    for ist_ms in (12.5, 13.4):
        diloco, ist = candidate("diloco", 8.7, 6.1, k=1.71, sync="diloco"), candidate("ist", 4.0, ist_ms - 4.0, k=2.0)
        for order in ([dp, diloco, ist], [dp, ist, diloco]):
            index, _ = choose(order)
            assert order[index] is diloco
    # beyond the close call the shorter time to loss wins, whatever its k
    diloco, ist = candidate("diloco", 8.7, 6.1, k=1.71, sync="diloco"), candidate("ist", 4.0, 5.0, k=2.0)
    assert diloco.to_loss_s > 1.15 * ist.to_loss_s
    index, _ = choose([dp, diloco, ist])
    assert index == 2
    # repeated plans of the run choose alike through decide's two calibration ends too
    assert decide([dp, diloco, candidate("ist", 4.0, 8.5, k=2.0)],
                  [dp, candidate("diloco", 8.0, 6.0, k=1.71, sync="diloco"), candidate("ist", 3.8, 8.0, k=2.0)]).index == 1


def jittered(rng: random.Random, comm_ms: tuple[float, float], k: float) -> tuple[list[Candidate], list[Candidate]]:
    """One calibration of the same run on the same hosts: the allreduce somewhere in the measured
    range [best, median], the best repeat a little below the median; compute with 5% noise."""
    low, high = comm_ms
    median = rng.uniform(low + 0.3 * (high - low), high)
    best = rng.uniform(low, low + 0.2 * (high - low))
    compute = 40.0 * rng.uniform(0.95, 1.05)

    def priced(comm: float) -> list[Candidate]:
        return [candidate("data_parallel", compute, comm), candidate("diloco", compute, comm / 100, k=k, sync_every=100)]

    return priced(median), priced(best)


@pytest.mark.parametrize("comm_ms, expected", [
    ((20.0, 160.0), "data_parallel"),  # DiLoCo wins as measured but not at the best repeats: exact, every time
    ((250.0, 400.0), "diloco"),  # a genuinely slow link: DiLoCo at both ends, every time
])
def test_repeated_plans_with_calibration_jitter_choose_the_same_candidate(comm_ms: tuple[float, float],
                                                                          expected: str) -> None:
    rng = random.Random(53)
    choices = set()
    for _ in range(40):
        measured, optimistic = jittered(rng, comm_ms, k=2.3)
        choices.add(measured[decide(measured, optimistic).index].strategy)
    assert choices == {expected}


def test_without_the_calibrations_range_the_same_jitter_would_flip() -> None:
    """The measured end alone (the old single-calibration choice) flips across the same jitter."""
    rng = random.Random(53)
    choices = {m[choose(m)[0]].strategy for m, _ in (jittered(rng, (20.0, 160.0), 2.3) for _ in range(40))}
    assert len(choices) > 1


# -- the embedding placement --------------------------------------------------------------------

def test_the_replicated_byte_estimate_counts_the_touched_row_flags() -> None:
    # The run: one 9,704 x 8 table on 2 ranks, 349,344 B counted a step (310,528 B of
    # gradients and 38,816 B of flags, one float per row in the same allreduce).
    table = TableSpec("item", 9704, 8)
    net = Network(latency_s=1e-4, bandwidth_Bps=1e9)
    assert replicated([table], 2, net, "adam").bytes_per_step == 349_344
    assert replicated([table], 4, net, "adam").bytes_per_step == pytest.approx(allreduce_bytes(9704 * 9 * 4, 4))
    from sparkdl.embeddings.replicated import ring_bytes  # what the executor counts

    assert ring_bytes(9704 * (8 + 1) * 4, 2) == 349_344


def stats_of(table: TableSpec, per_rank: float, world: int = 4) -> IdStats:
    return IdStats(table.name, table.num_rows, 1.0, 512, world, per_rank, min(world * per_rank, table.num_rows), 0)


def crossover_latency(table: TableSpec, stats: dict[str, IdStats], bandwidth: float) -> float:
    """The latency at which replicated and sharded cost the same for this table (bisection)."""
    def gap(latency: float) -> float:  # sharded's four all-to-alls pay more latencies than one allreduce
        options = decide_embeddings([table], stats, 4, Network(latency, bandwidth)).options
        return min(o.step_s for o in options[1:]) - options[0].step_s

    low, high = 1e-7, 1e-1
    assert gap(low) < 0 < gap(high)
    for _ in range(60):
        mid = (low * high) ** 0.5
        low, high = (mid, high) if gap(mid) < 0 else (low, mid)
    return (low * high) ** 0.5


def test_the_embedding_placement_is_stable_across_the_calibrations_range() -> None:
    table = TableSpec("item", 20_000, 8)
    stats = {"item": stats_of(table, 2000)}
    bandwidth = 1e9 / 8
    cross = crossover_latency(table, stats, bandwidth)
    # Loaded: the median latency well above the crossover, its best repeat well below it.
    loaded = decide_embeddings([table], stats, 4, Network(20 * cross, bandwidth),
                               optimistic=Network(cross / 20, bandwidth))
    quiet = decide_embeddings([table], stats, 4, Network(cross / 10, bandwidth),
                              optimistic=Network(cross / 20, bandwidth))
    assert loaded.sharded and quiet.sharded
    assert "flips across the calibration's range" in loaded.reason and "the default" in loaded.reason
    # The measured end alone would have flipped (the 1.96 ms against 0.078 ms).
    assert not decide_embeddings([table], stats, 4, Network(20 * cross, bandwidth)).sharded
    # Within 15% of each other at one end: a close call, the default again.
    near = decide_embeddings([table], stats, 4, Network(cross * 0.97, bandwidth))
    assert near.sharded and "a close call" in near.reason
    # Far from the crossover at both ends: the cheaper one, replicated here.
    slow = decide_embeddings([table], stats, 4, Network(50 * cross, bandwidth), optimistic=Network(20 * cross, bandwidth))
    assert not slow.sharded and "the default" not in slow.reason


def test_a_candidate_cannot_reach_the_loss_in_fewer_steps_than_data_parallel() -> None:
    with pytest.raises(ValueError, match="steps_factor must be >= 1"):
        candidate("diloco", 1.0, 0.0, k=0.5)


def test_diloco_takes_the_h_with_the_least_time_to_loss_not_the_most_compute() -> None:
    from sparkdl.planner.steps_to_loss import rounds_factor
    from sparkdl.planner.uneven import H_MIN, diloco_rounds

    k = rounds_factor(137e3, 2)
    utilised = diloco_rounds(0.1, 3.0)  # 90% compute: H=270
    chosen = diloco_rounds(0.1, 3.0, steps_factor=k)
    assert utilised == 270 and H_MIN <= chosen < utilised
    to_loss = {h: k(h) * (0.1 + 3.0 / h) for h in (chosen, utilised)}
    assert to_loss[chosen] < to_loss[utilised]  # fewer steps to the loss outweigh the costlier syncs
    assert diloco_rounds(0.1, 3.0, multiple=4, steps_factor=k) % 4 == 0  # whole fragments still
    # a sync far dearer than a step: the longest round is still the one that reaches the loss soonest
    assert diloco_rounds(0.01, 10.0, steps_factor=k) == diloco_rounds(0.01, 10.0) == 500


def test_near_tied_exact_layouts_go_to_the_first_listed_on_every_plan() -> None:
    from sparkdl.planner.plan import best_exact

    def hybrid(microbatches: int, step: float) -> Candidate:
        return Candidate("hybrid", (("strategy", "hybrid"), ("microbatches", microbatches)), step, 0.0, 0.0, True,
                         "")

    # the bed's repeated plans: 8 microbatches at 82.3 ms then 84.4 ms against 4 at 84.4 then 82.3
    first = [hybrid(4, 0.0844), hybrid(8, 0.0823), hybrid(16, 0.095)]
    second = [hybrid(4, 0.0823), hybrid(8, 0.0844), hybrid(16, 0.095)]
    assert best_exact(first, [0, 1, 2])[0] == best_exact(second, [0, 1, 2])[0] == 0
    clear = [hybrid(4, 0.120), hybrid(8, 0.0823)]  # 46 % apart: no tie, the faster runs
    assert best_exact(clear, [0, 1])[0] == 1
