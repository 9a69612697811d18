"""The planner's pure cost model and choice (planner/cost.py, planner/plan.py): milliseconds, no torch."""
from __future__ import annotations

import pytest

from sparkdl.planner import cost
from sparkdl.planner.plan import Candidate, Plan, choose

GBPS = 1e9 / 8


def mlp_layers(widths: list[int]) -> tuple[cost.LayerCost, ...]:
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers.append(cost.LayerCost(params=a * b + b, flops=2.0 * a * b, out_bytes=4.0 * b, saved_bytes=4.0 * a,
                                     kind="Linear", in_features=a, out_features=b))
    return tuple(layers)


def work(widths: list[int], world: int = 4, rows: int = 64, flops: float = 5e10) -> cost.Workload:
    return cost.Workload(layers=mlp_layers(widths), world=world, rows=rows, flops_per_s=flops,
                         optimizer_bytes_per_param=16, input_bytes_per_row=4.0 * widths[0])


def test_allreduce_time_is_the_ring_formula() -> None:
    net = cost.Network(latency_s=1e-4, bandwidth_Bps=1e9)
    assert cost.allreduce_s(1e9, 4, net) == pytest.approx(6 * 1e-4 + 1.5)
    assert cost.allreduce_s(1e9, 1, net) == 0.0
    assert cost.allreduce_bytes(100.0, 2) == 100.0


def test_data_parallel_is_compute_plus_exposed_allreduce() -> None:
    w = work([1024, 1024, 10])
    fast, slow = cost.Network(1e-5, 10 * GBPS), cost.Network(1e-3, 0.01 * GBPS)
    a, b = cost.data_parallel(w, fast), cost.data_parallel(w, slow)
    assert a.compute_s == b.compute_s == pytest.approx(3 * 64 * w.flops_per_row / 5e10)
    assert b.comm_s > 100 * a.comm_s
    assert a.bytes_per_step == pytest.approx(1.5 * w.params * 4)
    assert a.memory_bytes == pytest.approx(16 * w.params + 64 * (1024 + 1024) * 4)


def test_diloco_divides_communication_by_h() -> None:
    w, net = work([1024, 1024, 10]), cost.Network(1e-3, 0.1 * GBPS)
    dp, di = cost.data_parallel(w, net), cost.diloco(w, net, 50)
    assert di.comm_s == pytest.approx(dp.comm_s / 50)
    assert di.bytes_per_step == pytest.approx(dp.bytes_per_step / 50)
    assert di.memory_bytes == pytest.approx(dp.memory_bytes + 8 * w.params)


def test_hybrid_follows_the_bubble_law_on_a_free_network() -> None:
    w = work([512] * 9, world=2)
    free = cost.Network(0.0, 1e30)
    one = cost.hybrid(w, free, [0, 4, 8], 1)
    many = cost.hybrid(w, free, [0, 4, 8], 8)
    # balanced stages: (m + K - 1) t; t = the stage's time for one micro-batch
    stage_full = cost.compute_s(sum(l.flops for l in w.layers[:4]), 2 * 64, 5e10)
    assert one.step_s == pytest.approx(2 * stage_full)
    assert many.step_s == pytest.approx((8 + 1) * stage_full / 8)
    # 1F1B holds fewer micro-batches than GPipe
    assert cost.hybrid(w, free, [0, 4, 8], 8, one_f_one_b=True).memory_bytes < \
        cost.hybrid(w, free, [0, 4, 8], 8, one_f_one_b=False).memory_bytes
    # each stage keeps about half of the parameters' state
    assert many.memory_bytes < cost.data_parallel(w, free).memory_bytes


def test_ist_subnet_size_and_savings() -> None:
    w = work([64, 1024, 1024, 10], world=2)
    sub = cost.ist_subnet_params(w)
    assert sub == pytest.approx(64 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10)
    net = cost.Network(1e-3, 0.01 * GBPS)
    ist, dp = cost.ist(w, net, 30), cost.data_parallel(w, net)
    assert ist.bytes_per_step < dp.bytes_per_step / 20
    assert ist.compute_s < dp.compute_s


def candidate(strategy: str, step: float, feasible: bool = True, k: float = 1.0, **options: object) -> Candidate:
    return Candidate(strategy=strategy, options=tuple({"strategy": strategy, **options}.items()),
                     predicted_step_s=step, bytes_per_step=1.0, memory_bytes=1.0, feasible=feasible,
                     reason="" if feasible else "over the memory budget", compute_s=step / 2, comm_s=step / 2,
                     steps_factor=k)


def test_cheap_communication_keeps_data_parallel_even_if_ist_computes_less() -> None:
    dp = Candidate("data_parallel", (("strategy", "data_parallel"),), 1.1, 1.0, 1.0, True, "", compute_s=1.0,
                   comm_s=0.1)
    index, reason = choose([dp, candidate("ist", 0.5, ist_sync_every=30)])
    assert index == 0 and "at most 20% of compute" in reason


def test_choose_takes_an_approximate_strategy_only_when_it_reaches_the_loss_sooner() -> None:
    index, reason = choose([candidate("data_parallel", 1.05), candidate("diloco", 1.0, sync_every=50)])
    assert index == 0 and "exact" in reason
    # 1.9x cheaper steps but k=2.0 the steps: later to the loss, exact kept
    index, reason = choose([candidate("data_parallel", 1.9), candidate("diloco", 1.0, k=2.0, sync_every=50)])
    assert index == 0 and "only 0.95x sooner" in reason and "k=2.00x the steps" in reason
    # a user's extra margin (approximate_min_speedup) on the time to loss
    index, _ = choose([candidate("data_parallel", 5.0), candidate("diloco", 1.0, k=2.0, sync_every=50)])
    assert index == 1
    index, reason = choose([candidate("data_parallel", 5.0), candidate("diloco", 1.0, k=2.0, sync_every=50)],
                           approximate_min_speedup=3.0)
    assert index == 0 and "needs >= 3.00x" in reason
    # the best exact one is compared, hybrid included
    index, _ = choose([candidate("data_parallel", 5.0), candidate("hybrid", 1.5, stages=2),
                       candidate("diloco", 1.0, k=2.0, sync_every=50)])
    assert index == 1
    # a run where the approximate one saves under 10 s keeps exact updates (200 steps x 0.04 s = 8 s)
    fast = [candidate("data_parallel", 0.05), candidate("diloco", 0.01, sync_every=50)]
    index, reason = choose(fast, steps=200)
    assert index == 0 and "too short" in reason and "save only 8.0 s" in reason
    assert choose(fast, steps=300)[0] == 1 and choose(fast)[0] == 1
    # nothing exact fits: the approximate one is taken whatever its speed-up
    index, reason = choose([candidate("data_parallel", 1.0, feasible=False), candidate("ist", 0.9, ist_sync_every=30)])
    assert index == 1 and "no exact strategy" in reason
    index, reason = choose([candidate("data_parallel", 2.0), candidate("diloco", 1.0, sync_every=50),
                            candidate("ist", 0.8, ist_sync_every=30)])
    assert index == 2 and "communication-bound" in reason
    index, _ = choose([candidate("data_parallel", 1.0, feasible=False), candidate("hybrid", 3.0, stages=2),
                       candidate("hybrid", 2.0, stages=4)])
    assert index == 2
    with pytest.raises(ValueError, match="no candidate"):
        choose([candidate("data_parallel", 1.0, feasible=False)])


def test_plan_is_validated_and_explains_every_candidate() -> None:
    candidates = (candidate("data_parallel", 0.002), candidate("hybrid", 0.004, stages=2, microbatches=8),
                  candidate("ist", 0.001, feasible=False),
                  Candidate("ist", (("strategy", "ist"),), float("inf"), float("inf"), float("inf"), False,
                            "not an MLP"))
    plan = Plan(candidates=candidates, chosen=0, world=4, latency_s=1e-4, bandwidth_Bps=1 * GBPS, emulated=True,
                memory_budget=2**30)
    text = plan.explain()
    assert "EMULATED" in text and "hybrid(stages=2, microbatches=8)" in text and "over the memory budget" in text
    assert text.count("\n") >= 5 and plan.strategy == "data_parallel"
    assert "inf" not in text  # candidates ruled out before pricing show "-"
    assert plan.as_params()["plan.choice"] == "data_parallel"
    with pytest.raises(ValueError, match="not feasible"):
        Plan(candidates=candidates, chosen=2, world=4, latency_s=0, bandwidth_Bps=1)
    with pytest.raises(ValueError, match="do not divide"):
        Plan(candidates=(candidate("hybrid", 1.0, stages=3),), chosen=0, world=4, latency_s=0, bandwidth_Bps=1)


# -- heterogeneity (DT-FM) ---------------------------------------------------------------------------
from sparkdl.model.layouts import batch_shares, place_hybrid, placement_cost  # noqa: E402


def test_batch_shares_follow_measured_speed() -> None:
    assert batch_shares([1.0, 1.0], 64) == [32, 32]
    assert batch_shares([3.0, 1.0], 64) == [48, 16]
    shares = batch_shares([2.0, 1.0, 1.0], 100)
    assert sum(shares) == 100 and shares[0] == 50
    assert min(batch_shares([100.0, 1.0], 10)) >= 1
    with pytest.raises(ValueError):
        batch_shares([1.0, 0.0], 8)


def two_datacenters(world: int = 4, fast: float = 10e9, slow: float = 10e6) -> tuple[list[list[float]], list[list[float]]]:
    """Ranks 0 and 2 in one datacenter, 1 and 3 in the other (interleaved, so rank order is no hint)."""
    site = [r % 2 for r in range(world)]
    latency = [[0.0 if i == j else (1e-4 if site[i] == site[j] else 2e-2) for j in range(world)] for i in range(world)]
    bandwidth = [[float("inf") if i == j else (fast if site[i] == site[j] else slow) for j in range(world)]
                 for i in range(world)]
    return latency, bandwidth


def test_hybrid_places_data_parallel_groups_on_fast_links() -> None:
    latency, bandwidth = two_datacenters()
    grid = place_hybrid(latency, bandwidth, stages=2, stage_grad_bytes=[40e6, 40e6], activation_bytes=256e3)
    stage_groups = [sorted(grid[d][k] for d in range(2)) for k in range(2)]
    assert sorted(stage_groups) == [[0, 2], [1, 3]]  # each stage's replicas share a datacenter
    # ... and that beats the naive grid, whose data-parallel groups straddle the slow link
    naive = [[0, 1], [2, 3]]
    chosen = [[grid[d][k] for d in range(2)] for k in range(2)]
    assert placement_cost(chosen, latency, bandwidth, [40e6, 40e6], 256e3) < \
        placement_cost(naive, latency, bandwidth, [40e6, 40e6], 256e3) / 10


def test_local_search_handles_larger_worlds() -> None:
    latency, bandwidth = two_datacenters(world=12)
    grid = place_hybrid(latency, bandwidth, stages=2, stage_grad_bytes=[40e6, 40e6], activation_bytes=256e3)
    stage_sites = [{grid[d][k] % 2 for d in range(6)} for k in range(2)]
    assert all(len(sites) == 1 for sites in stage_sites)
    assert sorted(r for row in grid for r in row) == list(range(12))
    anchored = place_hybrid(latency, bandwidth, stages=2, stage_grad_bytes=[40e6, 40e6], activation_bytes=256e3,
                            last_stage=0)
    assert any(row[-1] == 0 for row in anchored)  # rank 0 reports the loss: a last stage
    assert all(len({anchored[d][k] % 2 for d in range(6)}) == 1 for k in range(2))


def test_shares_by_speed_keep_the_global_batch_and_the_mean_gradient() -> None:
    from sparkdl.executor.balance import balanced_steps, loss_weight, shares_by_speed

    shares = shares_by_speed([1.0, 1 / 3], batch_size=32)
    assert shares == [48, 16]
    # an epoch still covers every row once over all ranks: 100 + 90 rows, 64 per step
    assert balanced_steps([100, 90], 64, drop_last=False) == 3 and balanced_steps([100, 90], 64, drop_last=True) == 2
    # weighted means, averaged over ranks, are the mean over all rows
    weights = [loss_weight(shares, r) for r in range(2)]
    means = [2.0, 6.0]  # mean loss of each rank's rows
    assert sum(w * m for w, m in zip(weights, means)) / 2 == pytest.approx((48 * 2.0 + 16 * 6.0) / 64)


def test_the_hybrid_grid_is_placed_by_executor_not_by_calibration_rank() -> None:
    from sparkdl.model.layouts import place_on_executors

    fast, slow = (1e-4, 10e9), (2e-2, 10e6)
    links = [("dc1:1", "dc1:2", *fast), ("dc2:1", "dc2:2", *fast), ("dc1:1", "dc2:1", *slow),
             ("dc1:1", "dc2:2", *slow), ("dc1:2", "dc2:1", *slow), ("dc1:2", "dc2:2", *slow)]
    # This job's ranks landed on the executors in another order than the calibration's.
    executors = ["dc1:1", "dc2:1", "dc2:2", "dc1:2"]
    grid = place_on_executors(links, executors, stages=2, stage_grad_bytes=[4e8, 4e8], boundary_bytes=1e4)
    assert grid is not None and grid[0][-1] == 0 and sorted(r for ranks in grid for r in ranks) == [0, 1, 2, 3]
    for stage in range(2):  # each stage's data-parallel group stays inside one datacenter
        group = {executors[grid[d][stage]].split(":")[0] for d in range(2)}
        assert len(group) == 1, grid
    # two ranks on one executor use the best measured link; an executor never measured: no placement
    assert place_on_executors(links, ["dc1:1", "dc1:1", "dc2:1", "dc2:1"], 2, [4e8, 4e8], 1e4) is not None
    assert place_on_executors(links, ["dc1:1", "dc3:1", "dc2:1", "dc2:2"], 2, [4e8, 4e8], 1e4) is None


def test_accumulation_pays_the_gradient_sync_once_per_window() -> None:
    from dataclasses import replace

    net = cost.Network(1e-3, 0.1 * GBPS)
    one, four = work([1024, 1024, 10]), replace(work([1024, 1024, 10]), accumulate=4)
    dp1, dp4 = cost.data_parallel(one, net), cost.data_parallel(four, net)
    assert dp4.compute_s == dp1.compute_s and dp4.comm_s == pytest.approx(dp1.comm_s / 4)
    assert dp4.bytes_per_step == pytest.approx(dp1.bytes_per_step / 4)  # per micro-batch; per optimizer step equal
    assert cost.diloco(four, net, 10).comm_s == pytest.approx(cost.diloco(one, net, 10).comm_s / 4)
    h1, h4 = cost.hybrid(one, net, [0, 1, 2], 4), cost.hybrid(four, net, [0, 1, 2], 4)
    assert h4.step_s < h1.step_s and h4.bytes_per_step < h1.bytes_per_step


def test_sharded_sends_twice_data_parallel_and_keeps_a_wth_of_the_state() -> None:
    w, net = work([1024, 1024, 1024, 10]), cost.Network(1e-4, 1 * GBPS)
    dp, zero = cost.data_parallel(w, net), cost.sharded(w, net)
    assert zero.bytes_per_step == pytest.approx(2 * dp.bytes_per_step)  # two gathers + the reduction
    largest = max(layer.params for layer in w.layers)
    boundaries = 64 * 4 * (1024 + 1024)  # each later layer's input for the batch
    assert zero.memory_bytes == pytest.approx(16 * w.params / 4 + 8 * largest + boundaries + 64 * 4 * 1024)
    assert zero.compute_s > dp.compute_s  # every layer but the last runs its forward twice
    assert zero.step_s > dp.step_s  # so sharding is worth it only where memory says so
