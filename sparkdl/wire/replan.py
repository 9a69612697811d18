"""ReplanFigures: what the planner predicted for a run under strategy="auto" that chose data parallel,
carried to the ranks so that they can correct the choice while the run goes on (issue 53, item 4;
executor/replan.py decides, strategies/data_parallel.py switches).

The chosen candidate's predicted step and the alternative's: the best DiLoCo-family candidate of
the same plan (plain or streamed, its H and wire), with its predicted step and its steps factor k
(planner/steps_to_loss.py: DiLoCo needs k x data parallel's steps to reach its loss). The driver
builds it from the resolved plan's Plan (`replan_figures`, fit_stages.train_spec); a rank reads it
from the TrainSpec. Standard library and sparkdl.config only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sparkdl.config.uneven import uses_uneven_sync

# Bits a DiLoCo sync sends per parameter for each train.sync_dtype (data parallel sends fp32 gradients).
WIRE_BITS = {"fp32": 32.0, "fp16": 16.0, "bf16": 16.0, "int8": 8.0, "int4": 4.0}


@dataclass(frozen=True)
class ReplanFigures:
    exact_step_s: float  # data parallel's predicted step (the chosen candidate), seconds
    diloco_step_s: float  # the alternative DiLoCo candidate's predicted step, seconds
    # its train options (sync="diloco", sync_every = H, and fragments/fragment_sync_delay/sync_dtype/
    # fragment_update_alpha where the candidate is streamed), as the candidate's options name them
    diloco_options: tuple[tuple[str, Any], ...]
    diloco_steps_factor: float = 1.0  # k >= 1: DiLoCo's steps to data parallel's loss per data-parallel step
    diloco_label: str = "diloco"  # the candidate's label in the plan's table (explain())

    @property
    def sync_every(self) -> int:
        """H: inner optimizer steps between two syncs of the whole model."""
        return int(dict(self.diloco_options).get("sync_every", 1))

    @property
    def wire_share(self) -> float:
        """A DiLoCo sync's bytes per parameter over data parallel's fp32 gradient bytes."""
        return WIRE_BITS.get(str(dict(self.diloco_options).get("sync_dtype", "fp32")), 32.0) / 32.0

    @property
    def fragments(self) -> int:
        return int(dict(self.diloco_options).get("fragments", 1))

    def predicted_step_s(self, sync: str) -> float:
        return self.diloco_step_s if sync == "diloco" else self.exact_step_s


def replan_figures(auto: Any, train: Any) -> ReplanFigures | None:
    """The figures a run re-plans by, from the planner's Plan (`auto`, planner/plan.py) and the run's
    final train section: only where the planner chose exact data parallel (strategy="auto", or a kept
    plan of it) and priced a DiLoCo candidate beside it, on a run whose DiLoCo would be the plain or
    streamed sync (not islands, not the uneven-worker options), and not with train.replan="off".
    None otherwise: the run keeps its layout."""
    if auto is None or train.replan == "off" or train.strategy != "data_parallel" or train.sync != "allreduce" \
            or train.islands or uses_uneven_sync(train):
        return None
    chosen = auto.choice
    alternatives = [c for c in auto.candidates if c.strategy == "diloco" and c.feasible
                    and math.isfinite(c.predicted_step_s) and not dict(c.options).get("islands")]
    if chosen.strategy != "data_parallel" or not alternatives or not chosen.predicted_step_s > 0:
        return None
    # by time to data parallel's loss: k x step (k from planner/steps_to_loss.py where the plan has it)
    best = min(alternatives, key=lambda c: getattr(c, "steps_factor", 1.0) * c.predicted_step_s)
    return ReplanFigures(exact_step_s=float(chosen.predicted_step_s), diloco_step_s=float(best.predicted_step_s),
                         diloco_options=tuple((k, v) for k, v in best.options if k != "strategy"),
                         diloco_steps_factor=float(getattr(best, "steps_factor", 1.0)), diloco_label=best.label)
