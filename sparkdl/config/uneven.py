"""Checks of DiLoCo's options for uneven workers (strategies/diloco_uneven.py): Dynamic Local Updates,
Delayed Nesterov and DSSP-style bounded staleness. Imports nothing from sparkdl but errors and values."""
from __future__ import annotations

from typing import Any

from sparkdl.config.values import choice, positive_int_or_zero
from sparkdl.errors import ConfigError

LOCAL_UPDATES = ("fixed", "dynamic")
OUTER_OPTIMIZERS = ("nesterov", "delayed_nesterov")


def staleness_bounds(value: Any) -> tuple[int, int]:
    """(s_L, s_U) from train.max_staleness: an int s is (s, s); a pair is the bounds; 0 is off."""
    if isinstance(value, (list, tuple)):
        return int(value[0]), int(value[1])
    return int(value), int(value)


def uses_uneven_sync(train: Any) -> bool:
    """Any of the uneven-worker options away from its default (the outer sync of diloco_uneven.py), or
    DiLoCo's replicas re-splitting their batches by speed (batch_balance="dynamic": replicas then see
    different row counts per round, and pseudo-gradients must be weighted by them, as DyLU's are)."""
    return train.local_updates != "fixed" or train.outer_optimizer != "nesterov" or \
        staleness_bounds(train.max_staleness)[1] > 0 or \
        (train.sync == "diloco" and getattr(train, "batch_balance", "equal") == "dynamic")


def check_uneven_workers(train: Any) -> None:
    choice("train.local_updates", train.local_updates, LOCAL_UPDATES)
    choice("train.outer_optimizer", train.outer_optimizer, OUTER_OPTIMIZERS)
    positive_int_or_zero("train.outer_momentum_every", train.outer_momentum_every)
    value = train.max_staleness
    whole = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                for v in (value if isinstance(value, (list, tuple)) else [value]))
    if not whole or (isinstance(value, (list, tuple)) and (len(value) != 2 or value[0] > value[1])):
        raise ConfigError(f"train.max_staleness must be an integer s >= 0 (rounds a replica may run ahead; 0 = "
                          f"off) or a pair [s_L, s_U] with 0 <= s_L <= s_U, got {value!r}",
                          hint="for example max_staleness=2, or max_staleness=[3, 15] to adapt s at run time (DSSP)")
    if not uses_uneven_sync(train):
        return
    if train.strategy not in ("data_parallel", "auto"):
        raise ConfigError("train.local_updates/outer_optimizer/max_staleness shape DiLoCo's outer synchronisation, "
                          f"but train.strategy={train.strategy!r}",
                          hint="set strategy='data_parallel' with sync='diloco' (or strategy='auto')")
    streamed = [f"{key}={getattr(train, key)!r}" for key, default in
                (("fragments", 1), ("fragment_sync_delay", 0), ("fragment_update_alpha", 0.0), ("islands", 0))
                if getattr(train, key) != default]
    if streamed:
        raise ConfigError(f"train.local_updates/outer_optimizer/max_staleness/batch_balance='dynamic' work on plain "
                          f"DiLoCo, but "
                          f"{', '.join('train.' + s for s in streamed)} streams it",
                          hint="max_staleness overlaps whole rounds (it replaces fragment_sync_delay): leave "
                               "fragments, fragment_sync_delay, fragment_update_alpha and islands at their defaults")
    if train.local_updates == "dynamic" and train.accumulate_steps > 1:
        raise ConfigError(f"train.local_updates='dynamic' repeats a fast replica's inner steps on its batch, but "
                          f"train.accumulate_steps={train.accumulate_steps} spreads one step over several batches",
                          hint="use accumulate_steps=1 (a larger batch_size) with dynamic local updates")
