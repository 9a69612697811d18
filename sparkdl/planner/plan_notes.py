"""The words of a plan: why each candidate was or was not chosen, and the notes under the table
(what the calibration measured, what the decision hinged on). Split from planner/candidates.py,
which prices the candidates."""
from __future__ import annotations

from typing import TYPE_CHECKING

from sparkdl.config import DataConfig, LaunchConfig
from sparkdl.planner.cluster import ClusterInfo
from sparkdl.planner.ends import HETEROGENEOUS, CalibrationEnd
from sparkdl.planner.plan import CLOSE_CALL, ISLANDS_WITHIN, Candidate, Decision, needed_speedup
from sparkdl.planner.uneven import speeds_note

if TYPE_CHECKING:
    from sparkdl.planner.candidates import ModelCosts


def explained(candidates: list[Candidate], decision: Decision, approximate_min_speedup: float) -> list[Candidate]:
    """The candidates with the chosen one's reason, and for every other feasible one why not: its
    step and its time to data parallel's loss (k x step) against the chosen one's."""
    out = list(candidates)
    chosen = out[decision.index]
    out[decision.index] = Candidate(**{**chosen.__dict__, "reason": decision.reason})
    needed = needed_speedup(approximate_min_speedup)
    for i, c in enumerate(out):
        if c.feasible and i != decision.index:  # why not this one
            why = (f"{c.predicted_step_s / chosen.predicted_step_s:.2f}x the chosen step, "
                   f"{c.to_loss_s / chosen.to_loss_s:.2f}x its time to loss")
            if c.strategy in ("diloco", "ist", "islands") and c.predicted_step_s < chosen.predicted_step_s:
                if chosen.strategy == "islands":
                    why += f"; {c.strategy} keeps more replicas apart than islands (preferred within {ISLANDS_WITHIN:g}x)"
                elif chosen.to_loss_s < needed * c.to_loss_s:
                    why += (f"; approximate (k={c.steps_factor:.2f}), and not {needed:.2f}x sooner to the loss than "
                            f"the exact choice (a close call, within {CLOSE_CALL:.0%}, goes to exact)")
                elif decision.hinge:
                    why += "; approximate, and its advantage does not hold at both ends of the calibration"
                else:
                    why += "; approximate, and the exact choice's communication is cheap or the run short"
            out[i] = Candidate(**{**c.__dict__, "reason": why})
    return out


def plan_notes(data: DataConfig, launch: LaunchConfig, cluster: ClusterInfo, costs: "ModelCosts", ends: list[CalibrationEnd],
           unequal: bool, decision: Decision) -> list[str]:
    measured, workers = ends[0], launch.num_workers
    slowest, fastest = min(measured.speeds), max(measured.speeds)
    notes = [f"compute: {slowest / 1e9:.1f} GFLOP/s per rank (slowest of {workers}"
             + (", EMULATED speeds" if launch.emulate_speed else "")
             + (f"; fastest {fastest / 1e9:.1f}" if fastest > HETEROGENEOUS * slowest else "")
             + f"), profiled with {costs.threads} thread(s) at batch {data.batch_size}",
             *([speeds_note(measured.speeds)] if fastest > HETEROGENEOUS * slowest else []),
             "emulated network: timings are for the emulated links, not this cluster's" if launch.emulate_network
             else f"network: slowest measured link of {workers} ranks"]
    if cluster.collective_bandwidth_Bps:
        ring_latency, ring_bandwidth = measured.net.ring
        notes.append(f"collectives: the measured allreduce behaves as a ring of {ring_latency * 1e3:.3g} ms and "
                     f"{ring_bandwidth * 8 / 1e9:.3g} Gbit/s per hop")
    if len(ends) > 1:
        best = ends[1]
        ring_latency, ring_bandwidth = best.net.ring
        notes.append(f"calibration's optimistic end (best of each measurement's repeats): {min(best.speeds) / 1e9:.1f} "
                     f"GFLOP/s per rank, ring of {ring_latency * 1e3:.3g} ms and {ring_bandwidth * 8 / 1e9:.3g} Gbit/s "
                     "per hop; an approximate strategy must reach the loss sooner at both ends"
                     + ("; the ranks are equal there (a short probe may fit in a throttled host's CPU quota: "
                        "the measured speeds decide balancing)"
                        if unequal and max(best.speeds) <= HETEROGENEOUS * min(best.speeds) else ""))
    if cluster.flops_repeats or cluster.bandwidth_rounds:
        notes.append(f"calibration confidence: compute median within {100 * cluster.flops_rse:.1f}% (relative "
                     f"standard error, up to {cluster.flops_repeats} repeats a rank), link bandwidth within "
                     f"{100 * cluster.bandwidth_rse:.1f}% (up to {cluster.bandwidth_rounds} round trips a pair); "
                     "repeated until within 5% or the probe's budget ran out")
    if cluster.probe_s > 0 and cluster.probe_task_s > 0:
        notes.append(f"calibration time: the probe job took {cluster.probe_s:.1f} s on the driver, "
                     f"{cluster.probe_task_s:.1f} s of it measuring on the ranks (the rest: starting the job and its "
                     f"Python workers); the model's profile on the driver {costs.profile_s:.1f} s")
    if cluster.probes > 1:
        notes.append(f"calibration: best of {cluster.probes} probes (the first one's ends disagreed)")
    if costs.transformer_note:
        notes.append(costs.transformer_note)
    if decision.hinge:
        notes.append(f"decision hinged on: {decision.hinge}")
    return notes
