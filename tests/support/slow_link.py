"""A link that is slow for the first steps of a fit, from the test side (no hook in the library): a
loss that, on the executors, wraps EmulatedNetwork.allreduce (launch.emulate_network puts every rank's
communicator in one) so that model-sized allreduces take `delay_s` longer while this rank has trained
at most `slow_steps` steps, and every training step computes for `compute_s`. Small allreduces (the
epoch's sums, weight totals) are left alone. The wrapper acts only for the loss object that installed
it last, whose steps are then spent, so a reused Python worker's later fits are not slowed."""
from __future__ import annotations

import time

import torch

MODEL_SIZED = 100  # elements: the test's model has 162 parameters, the epoch's sums 3


class SlowLinkLoss:
    def __init__(self, slow_steps: int, delay_s: float, compute_s: float) -> None:
        self.slow_steps, self.delay_s, self.compute_s = slow_steps, delay_s, compute_s
        self.steps = 0

    def __call__(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from pyspark import TaskContext

        if TaskContext.get() is not None and torch.is_grad_enabled():  # a rank's training step
            self._install()
            self.steps += 1
            time.sleep(self.compute_s)
        return torch.nn.functional.cross_entropy(outputs, labels)

    def _install(self) -> None:
        from sparkdl.comm.emulated import EmulatedNetwork

        if getattr(EmulatedNetwork, "_slow_link_of", None) is self:
            return
        original = getattr(EmulatedNetwork, "_slow_link_original", EmulatedNetwork.allreduce)
        loss = self

        def allreduce(comm: EmulatedNetwork, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
            if loss.steps <= loss.slow_steps and tensor.numel() >= MODEL_SIZED:
                time.sleep(loss.delay_s)
            return original(comm, tensor, op)

        EmulatedNetwork._slow_link_original = original
        EmulatedNetwork.allreduce = allreduce
        EmulatedNetwork._slow_link_of = self
