"""What ranks of unequal speed cost, and what balancing them recovers (issue 43, item 6).

Lock-step strategies run at the slowest rank's pace: every candidate is priced at the slowest
calibrated speed. When the calibration finds ranks more than HETEROGENEOUS apart at both of its
ends, the planner also prices data parallel with the global batch re-split by speed (DT-FM;
ALGORITHMS.md "Uneven workers"): every rank then takes about the mean rank's time per step, at
the price of moving the slow ranks' surplus rows (one step ahead, hidden behind compute unless the
link is slower than that). `batch_balance="dynamic"` where the backend moves rows point to point,
else the calibrated shares of `batch_balance="speed"`.

DiLoCo's rounds: sync_every is chosen from the measured compute and sync times, not from a fixed
list: the smallest H at which the outer sync costs at most (1 - UTILISATION) of the round's time
(the scaling-law papers' rule: larger H only loses quality; INTELLECT-1 ran at 83-90% compute
utilisation), clamped to [H_MIN, H_MAX] and to at most 1/MIN_ROUNDS of the run's steps (a run of few
rounds is barely DiLoCo: "tens for small tasks"); the planner then takes the H up to that one with the
least predicted time to data parallel's loss (k(H) steps of compute + sync / H). Standard library only.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable, Sequence

from sparkdl.planner import cost

UTILISATION = 0.9  # DiLoCo's target share of compute in a round
H_MIN, H_MAX = 10, 500  # the paper's H = 500; tens for small tasks
MIN_ROUNDS = 20  # outer rounds a run should have at least
DRIFT_BOUND = 2.0  # measured speed ratios this far from the calibration's: the plan no longer fits


def diloco_rounds(compute_s: float, sync_s: float, multiple: int = 1, run_steps: int | None = None,
                  steps_factor: Callable[[int], float] | None = None) -> int:
    """The smallest H with sync_s / H <= (1 - UTILISATION) / UTILISATION x compute_s (one inner
    step's compute), rounded up to a multiple of `multiple` (the fragments) and of 5 above 10.
    With `steps_factor` (k(H), planner/steps_to_loss.py): the H up to that one with the least time to
    data parallel's loss, k(H) x (compute_s + sync_s / H): k rises with H, so on a slow link a
    smaller H whose syncs cost more per step can still reach the loss sooner."""
    if compute_s <= 0 or sync_s <= 0:
        return H_MIN * max(multiple, 1) if multiple > H_MIN else H_MIN
    needed = sync_s * UTILISATION / ((1.0 - UTILISATION) * compute_s)
    ceiling = H_MAX if not run_steps else min(H_MAX, max(H_MIN, run_steps // MIN_ROUNDS))
    every = min(max(math.ceil(needed - 1e-9), H_MIN), ceiling)  # 90.00000000000003 is 90
    utilised = _rounded(every, multiple)
    if steps_factor is None:
        return utilised
    shorter = sorted({_rounded(h, multiple) for h in range(H_MIN, utilised + 1)})
    return min((h for h in shorter if h <= utilised), key=lambda h: (steps_factor(h) * (compute_s + sync_s / h), h),
               default=utilised)


def _rounded(every: int, multiple: int) -> int:
    """`every` rounded up to a multiple of `multiple` (the fragments) and of 5 above H_MIN."""
    step = math.lcm(max(multiple, 1), 5 if every > H_MIN else 1)
    return math.ceil(every / step) * step


def balanced(work: cost.Workload, net: cost.Network, speeds: Sequence[float], row_bytes: float,
             overlap: float = 0.0) -> cost.Estimate:
    """Data parallel with rows re-split by speed: compute at the mean rank's speed (every rank's share
    takes about as long), the allreduce as lock-step's, plus the slow ranks' surplus rows moving over
    the slowest link, hidden behind a step's compute unless longer."""
    mean = sum(speeds) / len(speeds)
    estimate = cost.data_parallel(replace(work, flops_per_s=mean), net, overlap)
    moved_rows = sum(max(0.0, work.rows - work.rows * len(speeds) * s / sum(speeds)) for s in speeds)
    move_bytes = moved_rows * row_bytes
    move_s = net.latency_s + move_bytes / net.bandwidth_Bps if move_bytes else 0.0
    exposed = max(0.0, move_s - estimate.compute_s)
    per_rank = move_bytes / len(speeds)
    return cost.Estimate(estimate.step_s + exposed, estimate.compute_s, estimate.comm_s + exposed,
                         estimate.bytes_per_step + per_rank, estimate.memory_bytes)


def speeds_note(speeds: Sequence[float]) -> str:
    """Every rank's calibrated speed, and what lock-step costs on them."""
    slowest, fastest = min(speeds), max(speeds)
    listed = ", ".join(f"r{r} {s / 1e9:.1f}" for r, s in enumerate(speeds))
    mean = sum(speeds) / len(speeds)
    return (f"rank speeds (GFLOP/s): {listed}; lock-step strategies run at the slowest rank's pace "
            f"({fastest / slowest:.1f}x below the fastest), balanced ones at about the mean's "
            f"({mean / slowest:.2f}x the slowest)")


def drift(calibrated: Sequence[float], measured: Sequence[float], bound: float = DRIFT_BOUND) -> str | None:
    """Why the measured speeds no longer fit the calibration (None while they do): some rank's speed
    relative to the median moved by more than `bound` times either way."""
    if len(calibrated) != len(measured) or len(measured) < 2 or min(measured) <= 0 or min(calibrated) <= 0:
        return None
    base_c, base_m = sorted(calibrated)[len(calibrated) // 2], sorted(measured)[len(measured) // 2]
    worst = max(range(len(measured)), key=lambda r: _moved(calibrated[r] / base_c, measured[r] / base_m))
    moved = _moved(calibrated[worst] / base_c, measured[worst] / base_m)
    if moved <= bound:
        return None
    return (f"rank {worst} runs at {measured[worst] / base_m:.2f}x the median's speed, "
            f"{calibrated[worst] / base_c:.2f}x at the start ({moved:.1f}x apart, bound {bound:g}x)")


def _moved(before: float, after: float) -> float:
    return max(before / after, after / before)
