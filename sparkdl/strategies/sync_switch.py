"""What a switch of data parallel's sync mode at an epoch boundary needs besides the weights
(strategies/data_parallel.py switch_sync; executor/replan.py decides when)."""
from __future__ import annotations

import torch

from sparkdl.comm.base import Communicator


def average_optimizer_state(comm: Communicator, optimizer: torch.optim.Optimizer) -> None:
    """Leaving DiLoCo: its inner optimizers kept their own moments per replica, while data parallel
    steps every rank on the same gradients, so every rank takes their mean (as the outer sync takes
    the weights'). Tensors some rank lacks (a parameter it never stepped) are left as they are; step
    counts (0-d) are the same on every rank already."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    states = [optimizer.state.get(p, {}) for p in params]
    mine = [sorted(k for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0)
            for state in states]
    every = comm.allgather_object(mine) if comm.size > 1 else [mine]
    for index, state in enumerate(states):
        for key in mine[index]:
            if all(key in keys[index] for keys in every):
                comm.allreduce(state[key], op="avg")
