"""Corrected while it runs (issue 53, item 4): a run that strategy="auto" put on data parallel switches
to the plan's DiLoCo alternative at an epoch boundary when its measured steps show the link was the
bound, and back when DiLoCo's own syncs show it is not.

Every epoch, from the record every rank agrees on (executor/epoch_record.py: per-rank compute and
waits, allgathered; DiLoCo's sync seconds, allgathered by the strategy), so that every rank reaches
the same verdict after the same step (a collective that one rank skips hangs the others):

- the step: the slowest rank's (compute + waits) per loader step; compute: the slowest rank's;
- the link: what a whole-model exchange of data parallel's gradients costs per step. Under data
  parallel the least any rank waited (the slowest rank waits for no peer, only for the wire); under
  DiLoCo the least any rank spent inside its syncs' exchanges per whole-model sync (timed on the
  thread that ran them, hidden or not), scaled to fp32 and to one exchange per optimizer step.
- re-priced: data parallel = compute + link; DiLoCo = compute + link x wire share / H, times its
  steps factor k (it needs k x the steps to reach data parallel's loss: planner/steps_to_loss.py).

Data parallel -> DiLoCo when, in WINDOW epochs in a row (executor/pace.py's "sustained"), the step is
more than TOLERANCE slower than predicted, by at least pace.py's MIN_LOST_S (noise on sub-millisecond
steps never passes it), the link explains at least LINK_EXPLAINS of the excess, and
DiLoCo re-priced reaches the loss at least LEAVE_EXACT times sooner. DiLoCo -> data parallel when, in
WINDOW epochs in a row with syncs, it is no longer BACK_TO_EXACT times sooner (a close call is exact).
An epoch of DiLoCo without a sync says nothing of the link and leaves the streak as it is.
Standard library only (the unit tests run the rule without torch or Spark).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from sparkdl.executor.pace import MIN_LOST_S, WINDOW
from sparkdl.wire.replan import ReplanFigures

TOLERANCE = 0.25  # measured against predicted step beyond this is drift (the 25 %)
LINK_EXPLAINS = 0.5  # the link's time per step must explain at least this share of the excess
LEAVE_EXACT = 1.25  # DiLoCo must reach data parallel's loss this many times sooner to leave exact...
BACK_TO_EXACT = 1.10  # ...and the run goes back once it is no longer this many times sooner
NAMES = {"allreduce": "data parallel", "diloco": "DiLoCo"}


@dataclass(frozen=True)
class Pace:
    """One epoch's measured figures per loader step, the same on every rank."""

    step_s: float  # the slowest rank's step: compute and waits
    compute_s: float  # the slowest rank's compute
    link_s: float  # a whole-model fp32 exchange per optimizer step, per loader step (data parallel's link)


@dataclass(frozen=True)
class Verdict:
    switch: bool  # this epoch alone says: switch
    drift: float  # measured / predicted - 1, for the current sync
    exact_s: float  # data parallel's step, measured (under it) or re-priced
    diloco_s: float  # DiLoCo's step, measured (under it) or re-priced
    win: float  # data parallel's time to loss over DiLoCo's: exact_s / (k x diloco_s)


def pace_of(record: Mapping[str, Any], sync: str, figures: ReplanFigures, accumulate: int = 1) -> Pace | None:
    """The epoch's Pace from its agreed record; None when it says nothing of the link (no steps, or
    DiLoCo without a sync in the epoch)."""
    steps = int(record.get("steps", 0))
    compute, waits = record.get("compute_seconds_by_rank", []), record.get("wait_seconds_by_rank", [])
    if steps <= 0 or not compute or len(compute) != len(waits):
        return None
    step_s = max(c + w for c, w in zip(compute, waits)) / steps
    compute_s = max(compute) / steps
    if sync == "allreduce":
        return Pace(step_s, compute_s, min(waits) / steps)
    exchanges = int(record.get("outer_syncs", 0)) / max(int(record.get("outer_fragments", 1)), 1)
    seconds = record.get("outer_sync_seconds_by_rank", [])
    if exchanges <= 0 or not seconds:
        return None
    per_exchange = min(seconds) / exchanges / figures.wire_share  # as data parallel's fp32 gradients
    return Pace(step_s, compute_s, per_exchange / max(accumulate, 1))


def judge(sync: str, pace: Pace, figures: ReplanFigures) -> Verdict:
    """This epoch's verdict for a run training with `sync` (module docstring)."""
    predicted = figures.predicted_step_s(sync)
    drift = pace.step_s / predicted - 1.0 if predicted > 0 else 0.0
    k = max(figures.diloco_steps_factor, 1.0)
    if sync == "allreduce":
        exact = pace.step_s
        diloco = pace.compute_s + pace.link_s * figures.wire_share / max(figures.sync_every, 1)
        win = exact / (k * diloco) if diloco > 0 else 0.0
        excess = pace.step_s - predicted
        # pace.py's absolute floor too: sub-millisecond steps (a loopback link, shared cores) are noise
        explained = excess >= MIN_LOST_S and pace.link_s >= LINK_EXPLAINS * excess
        return Verdict(drift > TOLERANCE and explained and win >= LEAVE_EXACT, drift, exact, diloco, win)
    exact, diloco = pace.compute_s + pace.link_s, pace.step_s
    win = exact / (k * diloco) if diloco > 0 else 0.0
    return Verdict(win < BACK_TO_EXACT, drift, exact, diloco, win)


@dataclass
class Streak:
    """Epochs in a row whose verdict was "switch": one (a first epoch's warm-up, a neighbour's burst) is
    not enough; the same WINDOW as executor/pace.py's Sustained."""

    window: int = WINDOW
    count: int = 0

    def update(self, switch: bool) -> bool:
        self.count = self.count + 1 if switch else 0
        return self.count >= self.window


def target_options(sync: str, figures: ReplanFigures, dynamic_balance: bool) -> dict[str, Any]:
    """The train options of the sync a switch goes to. With batch_balance="dynamic" DiLoCo is the plain
    one (its replicas see different row counts: strategies/diloco_uneven.py weighs them), H and wire kept."""
    if sync == "diloco":
        return {"sync": "allreduce"}
    options = dict(figures.diloco_options, sync="diloco")
    if dynamic_balance:
        options = {k: v for k, v in options.items() if k in ("sync", "sync_every", "sync_dtype")}
    return options


def switch_note(epoch: int, sync: str, verdict: Verdict, figures: ReplanFigures, window: int) -> dict[str, Any]:
    """The history's account of a switch after `epoch` (the monitor says its `reason` once)."""
    to = "allreduce" if sync == "diloco" else "diloco"
    predicted = figures.predicted_step_s(sync)
    measured = verdict.diloco_s if sync == "diloco" else verdict.exact_s
    k = max(figures.diloco_steps_factor, 1.0)
    if sync == "allreduce":
        why = (f"the measured step was {measured * 1e3:.1f} ms against {predicted * 1e3:.1f} ms predicted "
               f"({verdict.drift:+.0%}) for {window} epochs, the link bound; {figures.diloco_label} re-priced on "
               f"the measured link at {verdict.diloco_s * 1e3:.1f} ms a step (k={k:.2f}) reaches the loss "
               f"{verdict.win:.2f}x sooner")
    else:
        why = (f"DiLoCo's syncs show the link is not the bound: data parallel re-priced at {verdict.exact_s * 1e3:.1f} "
               f"ms a step against DiLoCo's {measured * 1e3:.1f} ms (k={k:.2f}) for {window} epochs: "
               f"DiLoCo only {verdict.win:.2f}x sooner, under {BACK_TO_EXACT:.2f}x")
    return {"after_epoch": epoch, "from": sync, "to": to, "measured_step_s": measured, "predicted_step_s": predicted,
            "estimated_step_s": verdict.diloco_s if to == "diloco" else verdict.exact_s, "win": verdict.win,
            "reason": f"sparkdl: re-planned after epoch {epoch}: {NAMES[sync]} -> {NAMES[to]} from epoch "
                      f"{epoch + 1} on: {why}"}


class Replanner:
    """The loop's re-planning, epoch by epoch, for a DataParallel strategy that can switch its sync."""

    def __init__(self, figures: ReplanFigures, strategy: Any, accumulate: int, dynamic_balance: bool) -> None:
        self.figures, self.strategy = figures, strategy
        self.accumulate, self.dynamic_balance = accumulate, dynamic_balance
        self.streak = Streak()

    @classmethod
    def of(cls, spec: Any, strategy: Any) -> "Replanner | None":
        """None unless strategy="auto" chose data parallel (spec.replan, planner/resolved.py) on
        several ranks whose strategy averages itself (strategies/data_parallel.py can_switch_sync)."""
        figures = spec.replan
        if figures is None or spec.launch.num_workers < 2 or not getattr(strategy, "can_switch_sync", False):
            return None
        return cls(figures, strategy, spec.train.accumulate_steps, spec.train.batch_balance == "dynamic")

    def after_epoch(self, record: dict[str, Any], epoch: int, last: bool) -> None:
        """Add the epoch's sync and measured/predicted step to its record; switch after WINDOW epochs in
        a row say so (never after the last epoch: there is no next one)."""
        sync = self.strategy.sync_mode
        record["sync"] = sync
        record["step_predicted_s"] = self.figures.predicted_step_s(sync)
        pace = pace_of(record, sync, self.figures, self.accumulate)
        if pace is None:
            return
        verdict = judge(sync, pace, self.figures)
        record.update(step_measured_s=pace.step_s, step_drift=verdict.drift, replan_win=verdict.win)
        if not self.streak.update(verdict.switch) or last:
            return
        record["replanned"] = switch_note(epoch, sync, verdict, self.figures, self.streak.window)
        self.strategy.switch_sync(target_options(sync, self.figures, self.dynamic_balance))
        self.streak = Streak()
