"""IST as a candidate of the planner: when it may train a run (its layout for the calibration's
timed round, driver/probe_ist.py) and its estimate (cost.ist: from the round timed on the ranks
where there is one, else from the driver's profile of one rank's subnet)."""
from __future__ import annotations

import math
from typing import Any

from torch import nn

from sparkdl.config import DataConfig, LaunchConfig
from sparkdl.planner import cost
from sparkdl.planner.profile import ModelInput

IST_R = 30  # the sync period IST is priced and timed at


def ist_refusal(data: DataConfig, tensor_input: bool) -> str:
    """Why IST cannot train this run at all, whatever the model ("" when it may)."""
    if tensor_input:
        return "IST trains MLPs on one float feature vector, not input_cols tensors"
    return "IST trains without per-row weights (weight_col)" if data.weight_col else ""


def ist_trial_layout(model: nn.Module, data: DataConfig, launch: LaunchConfig, num_features: "ModelInput | int"
                     ) -> Any:
    """IST's layout for this run when IST is a candidate it may choose (an MLP on one float feature
    vector, no row weights, wide enough for the ranks): the calibration then times one IST round on
    the ranks (planner/step_trial.py). None otherwise."""
    from sparkdl.strategies.ist import ist_layout, narrow_layers

    if launch.num_workers < 2 or ist_refusal(data, ModelInput.of(num_features).sample is not None):
        return None
    try:
        layout = ist_layout(model, launch.num_workers, IST_R, "scale", 0)
    except Exception:  # noqa: BLE001 - not an IST model: its candidate says why
        return None
    return None if narrow_layers(layout) else layout


def ist_estimate(model: nn.Module, work: cost.Workload, net: cost.Network, subnet: tuple[cost.LayerCost, ...] | None,
                 refused: str, measured: tuple[float, float] = (0.0, 0.0)) -> tuple[cost.Estimate, bool, str]:
    """IST's estimate, whether it may run and why not: refused for the run (`refused`), or for a model
    too narrow per worker (IST/GIST papers: accuracy drops; the step time would not show it)."""
    from sparkdl.strategies.ist import MIN_NEURONS_PER_RANK, ist_layout, narrow_layers

    unpriced = cost.Estimate(math.inf, 0, 0, math.inf, math.inf)
    if refused:
        return unpriced, False, refused
    workers = work.world
    try:
        narrow = narrow_layers(ist_layout(model, workers, IST_R, "scale", 0))
        eligible, why = (False, f"{narrow[0]} < {MIN_NEURONS_PER_RANK} x {workers}: accuracy risk") if narrow \
            else (True, "")
    except Exception as exc:  # noqa: BLE001 - the eligibility message is the reason shown
        eligible, why = False, str(exc).splitlines()[0][:120]
    return (cost.ist(work, net, IST_R, subnet, measured) if eligible else unpriced), eligible, why
