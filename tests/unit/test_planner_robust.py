"""A switch to an approximate strategy must not hinge on one noisy calibration (issue 16, part 7b).

On a loaded 2-core host auto picked IST for a 64-1024-1024-10 MLP, predicting 7.9 ms against 36.7 ms
for the best exact layout (data parallel with batches shared by speed: the ranks were also measured
unequal). The planner now prices every candidate at both ends of the calibration (as measured, and
at its optimistic end: best repeats, ranks within HETEROGENEOUS counted as equal) and switches only
when the approximate candidate wins at both. No Spark, no timing: costs are numbers.
"""
from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from sparkdl.config import RunConfig
from sparkdl.planner import cost
from sparkdl.planner.candidates import ModelCosts, price_plan
from sparkdl.planner.cluster import ClusterInfo
from sparkdl.planner.plan import Candidate, decide
from sparkdl.planner.profile import LayerProfile, ModelProfile

INF = float("inf")
OPS = frozenset({"allreduce", "broadcast", "allgather", "send_recv", "barrier", "subgroup"})


# k (planner/steps_to_loss.py) as the planner would set it for 2 ranks: IST 1.25; DiLoCo a round 2.0.
STEPS_FACTOR = {"ist": 1.25, "diloco": 2.0}


def candidate(label: str, compute_ms: float, comm_ms: float) -> Candidate:
    strategy, _, extra = label.partition(":")
    options: dict[str, Any] = {"strategy": strategy}
    if extra:
        options["batch_balance"] = extra
    return Candidate(strategy=strategy, options=tuple(options.items()),
                     predicted_step_s=(compute_ms + comm_ms) / 1e3, bytes_per_step=1.0, memory_bytes=1.0,
                     feasible=True, reason="", compute_s=compute_ms / 1e3, comm_s=comm_ms / 1e3,
                     steps_factor=STEPS_FACTOR.get(strategy, 1.0))


def test_the_issues_numbers_keep_exact_updates_when_only_the_measured_end_favours_ist() -> None:
    # measured: IST 7.9 ms, data_parallel(batch_balance=speed) 36.7 ms: 4.6x
    measured = [candidate("data_parallel", 13.3, 26.7), candidate("data_parallel:speed", 10.0, 26.7),
                candidate("ist", 7.6, 0.3)]
    # optimistic end: the allreduce takes 3.4 ms, not 26.7: IST's step is only 1.3x cheaper, and with
    # k=1.25 the steps it reaches the loss about as soon as data parallel
    optimistic = [candidate("data_parallel", 5.0, 3.4), candidate("data_parallel:speed", 5.0, 3.4),
                  candidate("ist", 6.3, 0.16)]
    decision = decide(measured, optimistic)
    assert decision.index == 1 and measured[decision.index].strategy == "data_parallel"
    assert "reaches the loss 3.7x sooner at the measured end but only 1.0x sooner to the loss at the optimistic end" \
        in decision.reason
    assert "the network and compute terms decide together" in decision.reason and "kept exact" in decision.reason
    assert decision.hinge and decision.hinge in decision.reason
    # one calibration alone (today's rule) would have switched
    assert measured[decide(measured).index].strategy == "ist"


def test_both_ends_favouring_ist_switch() -> None:
    measured = [candidate("data_parallel", 13.3, 26.7), candidate("ist", 7.6, 0.3)]
    optimistic = [candidate("data_parallel", 5.0, 20.0), candidate("ist", 4.0, 0.2)]
    decision = decide(measured, optimistic)
    assert decision.index == 1 and not decision.hinge
    assert "reaches data parallel's loss 4.1x sooner than the best exact strategy" in decision.reason
    assert "5.06x cheaper steps than data_parallel's 40.00 ms, k=1.25x the steps" in decision.reason
    assert "4.8x sooner at the calibration's optimistic end too" in decision.reason


def test_another_approximate_candidate_that_wins_at_both_ends_is_taken() -> None:
    measured = [candidate("data_parallel", 10.0, 30.0), candidate("diloco", 10.0, 0.6), candidate("ist", 7.0, 0.3)]
    # at the optimistic end IST's subnet gains less than DiLoCo's skipped allreduce
    optimistic = [candidate("data_parallel", 4.0, 12.0), candidate("diloco", 4.0, 0.3), candidate("ist", 12.0, 0.2)]
    decision = decide(measured, optimistic)
    assert decision.index == 1 and "sooner only at the measured end" in decision.reason


def test_only_the_optimistic_end_favouring_an_approximate_strategy_keeps_exact() -> None:
    measured = [candidate("data_parallel", 40.0, 4.0), candidate("ist", 10.0, 0.1)]  # allreduce cheap: 10%
    optimistic = [candidate("data_parallel", 9.0, 3.0), candidate("ist", 2.3, 0.1)]
    decision = decide(measured, optimistic)
    assert decision.index == 0 and "at most 20% of compute" in decision.reason
    assert "sooner at the optimistic end but at the measured end data parallel's allreduce is cheap" in decision.hinge
    assert "the compute term decides" in decision.hinge


def test_the_ends_must_price_the_same_candidates() -> None:
    with pytest.raises(ValueError, match="same candidates"):
        decide([candidate("data_parallel", 1.0, 1.0)], [candidate("ist", 1.0, 1.0)])


# -- through the planner's pricing (candidates.price_plan), with the issue's model ----------------

def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def layer_costs(widths: tuple[int, ...]) -> tuple[cost.LayerCost, ...]:
    out = []
    for k, (a, b) in enumerate(zip(widths, widths[1:])):
        out.append(cost.LayerCost(params=a * b + b, flops=2.0 * a * b, out_bytes=4.0 * b, saved_bytes=4.0 * a,
                                  kind="Linear", in_features=a, out_features=b, overhead_s=40e-6))
        if k < len(widths) - 2:
            out.append(cost.LayerCost(params=0, flops=float(b), out_bytes=4.0 * b, saved_bytes=4.0 * b, kind="ReLU",
                                      overhead_s=15e-6))
    return tuple(out)


def model_costs(driver_flops: float = 2e10) -> ModelCosts:
    """What profile_model would measure for mlp(), as fixed numbers (and IST's 64-512-512-10 subnet)."""
    full = layer_costs((64, 1024, 1024, 10))
    profile = ModelProfile(layers=tuple(
        LayerProfile(i, c.kind, c.params, 4 * c.params, (int(c.out_bytes) // 4,), "float32", int(c.out_bytes),
                     c.saved_bytes, 3 * 64 * c.flops / driver_flops + c.overhead_s) for i, c in enumerate(full)),
        input_shape=(64,), rows=64)
    return ModelCosts(profile, full, layer_costs((64, 512, 512, 10)), 300e-6, driver_flops, 1, 64)


def calibration(flops: tuple[float, float], latency: float, bandwidth: float, best_flops: tuple[float, ...] = (),
                best_latency: float = 0.0, best_bandwidth: float = 0.0) -> ClusterInfo:
    def pair(value: float, diagonal: float) -> tuple[tuple[float, ...], ...]:
        return ((diagonal, value), (value, diagonal))

    spread: dict[str, Any] = {}
    if best_flops:
        spread = dict(best_flops_per_s=best_flops, best_latency_s=pair(best_latency, 0.0),
                      best_bandwidth_Bps=pair(best_bandwidth, INF), best_collective_latency_s=best_latency,
                      best_collective_bandwidth_Bps=best_bandwidth)
    return ClusterInfo(master="local-cluster[2,2,1024]", workers=2, executors=("h:1", "h:2"), flops_per_s=flops,
                       latency_s=pair(latency, 0.0), bandwidth_Bps=pair(bandwidth, INF), measured_at=0.0, probe_s=1.0,
                       rank_executors=("h:1", "h:2"), collective_latency_s=latency, collective_bandwidth_Bps=bandwidth,
                       threads_per_rank=(1, 1), **spread)


def plan(cluster: ClusterInfo, epochs: int = 100, **options: Any) -> Any:
    # The issue's figures were measured with gradients averaged after backward: priced that way here.
    options.setdefault("overlap_grads", False)
    config = RunConfig.from_kwargs(feature_cols=[f"x{i}" for i in range(64)], label_col="label", batch_size=64,
                                   num_workers=2, epochs=epochs, **options).validate()
    return price_plan(mlp(), config.data, config.train, config.launch, model_costs(), cluster, OPS, num_rows=1797)


# Under load: ranks measured unequal (35 and 18 GFLOP/s) and a slow, jittery loopback (1.5 ms, 2.4
# Gbit/s); their best repeats: 50 and 46 GFLOP/s (equal within 1.5x), 0.03 ms and 40 Gbit/s.
NOISY = dict(flops=(3.5e10, 1.8e10), latency=1.5e-3, bandwidth=3e8, best_flops=(5e10, 4.6e10), best_latency=3e-5,
             best_bandwidth=5e9)


def test_a_noisy_calibration_keeps_exact_updates_and_explain_says_why() -> None:
    one_end = plan(calibration(**{k: v for k, v in NOISY.items() if not k.startswith("best")}))
    assert one_end.strategy == "ist"  # the measured end alone: the issue's switch
    assert any(c.label == "data_parallel(batch_balance=dynamic)" for c in one_end.candidates)
    robust = plan(calibration(**NOISY))
    assert robust.strategy == "data_parallel", robust.explain()
    text = robust.explain()
    assert "sooner at the measured end but at the optimistic end data parallel's allreduce is cheap" in text
    assert "the network term decides" in text and "decision hinged on" in text and robust.hinge
    ist = next(c for c in robust.candidates if c.strategy == "ist")
    assert "does not hold at both ends" in ist.reason
    # equal at the optimistic end, unequal as measured: balancing changes no update, so the measured
    # speeds decide it (a CPU-quota'd host runs a short probe at full speed)
    assert any(c.label == "data_parallel(batch_balance=dynamic)" for c in robust.candidates)
    assert "the ranks are equal there" in text
    assert robust.as_params()["plan.hinge"] == robust.hinge


def test_a_clean_calibration_switches_to_ist() -> None:
    # a genuinely slow link (2.4 Gbit/s, 1.5 ms; best repeats 2.7 Gbit/s, 1.2 ms): IST wins at both ends
    clean = plan(calibration(flops=(4.5e10, 4.3e10), latency=1.5e-3, bandwidth=3e8, best_flops=(5e10, 4.5e10),
                             best_latency=1.2e-3, best_bandwidth=3.4e8))
    assert clean.strategy == "ist" and not clean.hinge, clean.explain()
    assert "at the calibration's optimistic end too" in clean.choice.reason


def test_a_short_run_stays_exact_at_both_ends() -> None:
    short = plan(calibration(**NOISY), epochs=1)
    assert short.strategy == "data_parallel" and "too short" in short.choice.reason and not short.hinge


def test_declared_figures_are_the_same_at_both_ends() -> None:
    # an emulated 10 Mbit/s link is not noisy: IST wins at both ends whatever the compute noise
    slow = plan(calibration(**NOISY), emulate_network={"latency_ms": 1.0, "gbps": 0.01})
    assert slow.strategy in ("ist", "diloco") and not slow.hinge, slow.explain()
    # declared speeds are unequal at both ends: batches shared by speed are offered
    speeds = plan(calibration(**NOISY), emulate_speed=[1.0, 0.25], emulate_network={"latency_ms": 0.0, "gbps": 1000.0})
    assert any(c.label == "data_parallel(batch_balance=dynamic)" for c in speeds.candidates)


def test_sharded_is_priced_and_the_executors_python_memory_bounds_every_candidate() -> None:
    from dataclasses import replace

    from sparkdl.planner.budget import rank_memory_budget

    cluster = calibration((5e10, 5e10), 1e-4, 1e9)
    free = plan(cluster)
    (sharded,) = [c for c in free.candidates if c.strategy == "sharded"]
    (dp,) = [c for c in free.candidates if c.strategy == "data_parallel"]
    assert sharded.feasible and sharded.bytes_per_step == pytest.approx(2 * dp.bytes_per_step)
    # one 1024 x 1024 layer is most of this model: its gathered copy and gradients eat most of the saving
    assert sharded.memory_bytes < dp.memory_bytes
    # 2 ranks on 2 executors: each rank may hold what its executor's Python workers may
    limited = replace(cluster, pyspark_memory=f"{int((sharded.memory_bytes + dp.memory_bytes) / 2)}b")
    config = RunConfig.from_kwargs(feature_cols=[f"x{i}" for i in range(64)], label_col="label", batch_size=64,
                                   num_workers=2, epochs=100).validate()
    assert rank_memory_budget(config.launch, limited) == pytest.approx(int((sharded.memory_bytes + dp.memory_bytes) / 2))
    bounded = plan(limited)
    by_name = {c.strategy: c for c in bounded.candidates if c.strategy in ("data_parallel", "sharded")}
    assert not by_name["data_parallel"].feasible and "over the budget" in by_name["data_parallel"].reason
    assert by_name["sharded"].feasible
    chosen = bounded.candidates[bounded.chosen]
    assert chosen.feasible and chosen.memory_bytes <= rank_memory_budget(config.launch, limited)
    assert rank_memory_budget(config.launch, replace(cluster, pyspark_memory="512")) == 512 * 2**20  # Spark's MiB


def test_explain_states_the_calibrations_confidence_and_the_exposed_gradient_buckets() -> None:
    from dataclasses import replace

    settled = replace(calibration((2e10, 2e10), 1e-4, 2.5e6), flops_rse=0.012, flops_repeats=16, bandwidth_rse=0.034,
                      bandwidth_rounds=7)
    text = plan(settled, overlap_grads=True).explain()
    assert "calibration confidence: compute median within 1.2%" in text and "up to 16 repeats" in text
    assert "link bandwidth within 3.4% (up to 7 round trips a pair)" in text
    # 20 Mbit/s: the gradient buckets' allreduce cannot hide behind backward (the last bucket never does)
    line = next(n for n in text.splitlines() if "data parallel's gradients:" in n)
    assert "overlapped with backward" in line and "exposed" in line
    unmeasured = plan(calibration((2e10, 2e10), 1e-4, 2.5e6)).explain()
    assert "calibration confidence" not in unmeasured  # a calibration cached before repeats were counted
