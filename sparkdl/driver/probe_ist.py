"""One IST round of the run's model, timed on the ranks by the calibration probe (driver/probe.py).

IST's step is a subnet's step, and every `sync_every` steps the subnets go back into the full model
(an allgather of every rank's blocks, the shared bias averaged) and the next round's subnets are cut
and get fresh optimizers. On the bed a round's sync took 225-290 ms at 20 Mbit/s where the profile
priced its allgather at 148 ms (which is what the allgather alone takes there: the rest is the
sync's other work on 0.5-core hosts and the ranks reaching it apart), and the subnet's step ran 20-40 %
slower than its profile: IST's predicted step was half the measured one. So where IST is
a candidate (planner/ist_pricing.ist_trial_layout), the ranks run one real round of it with the run's
own layout: `sync_every - 1` steps timed alone, a check that every rank got through them (a rank that
failed never leaves the others in a collective), then the step that syncs.
"""
from __future__ import annotations

import copy
import pickle
import statistics
import time
from typing import Any

ROUND_BUDGET_S = 2.0  # a round is timed only when the slowest rank's model step x sync_every fits


def ist_round(ctx: Any, packed: tuple[str, bytes] | None, step_s: float) -> dict[str, float]:
    """This rank's figures of one IST round of the pickled trial (planner/step_trial.StepTrial
    with an `ist_layout`): "ist_step" (the median step between syncs), "ist_sync" (what the
    syncing step took beyond it), seconds, and "ist_every" (the round's steps); {} where no round
    was timed. Every rank calls it: all of them time the round, or none. `step_s`: this rank's
    timed model step (0: it failed)."""
    trial = _unpickled(packed)
    layout = getattr(trial, "ist_layout", None)
    fits = layout is not None and 0 < step_s and step_s * layout.sync_every <= ROUND_BUDGET_S
    model = _copied(trial.model) if fits else None  # what may fail on one rank, before any collective
    if not all(ctx.comm.allgather_object(model is not None)):
        return {}
    try:
        strategy, steps = _set_up(ctx.comm, trial, model), []
        for _ in range(layout.sync_every - 1):
            began = time.perf_counter()
            strategy.train_step(trial.inputs, trial.target)
            steps.append(time.perf_counter() - began)
        ok = True
    except Exception:  # noqa: BLE001 - a round that fails leaves IST priced from the profile
        ok = False
    if not all(ctx.comm.allgather_object(ok)):  # nobody enters the sync unless everyone will
        return {}
    began = time.perf_counter()
    strategy.train_step(trial.inputs, trial.target)
    syncing = time.perf_counter() - began
    step = statistics.median(steps) if steps else syncing
    return {"ist_step": step, "ist_sync": max(syncing - step, 0.0), "ist_every": layout.sync_every}


def _set_up(comm: Any, trial: Any, model: Any) -> Any:
    """IST on `model` (a copy of the trial's) with the run's optimizer and loss, as executor/loop.py
    sets a strategy up; the setup broadcasts rank 0's weights, so every rank enters it."""
    from sparkdl.model.objectives import build_optimizer, loss_function
    from sparkdl.strategies.ist import Ist

    strategy = Ist(comm, trial.ist_layout, trial.train)
    strategy.setup(model, lambda params: build_optimizer(trial.train, params), loss_function(trial.train))
    return strategy


def _copied(model: Any) -> Any:
    try:
        return copy.deepcopy(model)
    except Exception:  # noqa: BLE001 - a model that does not copy is not timed
        return None


def _unpickled(packed: tuple[str, bytes] | None) -> Any:
    if packed is None:
        return None
    try:
        return pickle.loads(packed[1])
    except Exception:  # noqa: BLE001 - model_step reports why; the round is just not timed
        return None
