"""Data parallel: every rank holds the whole model; gradients are averaged exactly each step.

Averaging goes through the Communicator (not DistributedDataParallel) so the same strategy runs
on every backend and the bytes it sends are counted at one place. Gradients are flattened into a
few large buckets because per-tensor collectives are latency bound on small layers.
"""
from __future__ import annotations

import torch
from torch import nn

from sparkdl.comm.base import ALLREDUCE, BROADCAST, Communicator
from sparkdl.strategies.base import LossFn, OptimizerFactory, Strategy

BUCKET_BYTES = 25 << 20


def broadcast_module(comm: Communicator, module: nn.Module, src: int = 0) -> None:
    """Every rank ends with src's parameters and buffers."""
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            comm.broadcast(tensor.data, src=src)


def average_gradients(comm: Communicator, params: list[nn.Parameter], bucket_bytes: int = BUCKET_BYTES) -> None:
    bucket: list[nn.Parameter] = []
    size = 0
    for param in params:
        if param.grad is None:
            # Every rank must contribute the same buffer layout, even for a branch unused this step.
            param.grad = torch.zeros_like(param)
        bucket.append(param)
        size += param.grad.numel() * param.grad.element_size()
        if size >= bucket_bytes:
            _reduce_bucket(comm, bucket)
            bucket, size = [], 0
    if bucket:
        _reduce_bucket(comm, bucket)


def _reduce_bucket(comm: Communicator, bucket: list[nn.Parameter]) -> None:
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for param in bucket:
        by_dtype.setdefault(param.grad.dtype, []).append(param)
    for params in by_dtype.values():
        grads = [p.grad for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.allreduce(flat, op="avg")
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset: offset + grad.numel()].view_as(grad))
            offset += grad.numel()


class DataParallel(Strategy):
    name = "data_parallel"
    requires = frozenset({ALLREDUCE, BROADCAST})

    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory, loss_fn: LossFn) -> None:
        self._model = model.to(self.comm.device)
        broadcast_module(self.comm, self._model)
        self._params = [p for p in self._model.parameters() if p.requires_grad]
        optimizer = make_optimizer(self._model.parameters())
        wrapped = self.comm.wrap_optimizer(optimizer, self._model) if self.comm.size > 1 else None
        # A backend's own distributed optimizer averages inside step(); otherwise we average here.
        self._backend_averages = wrapped is not None
        self._optimizer = wrapped or optimizer
        self._grad_bytes = sum(p.numel() * p.element_size() for p in self._params)
        self._loss_fn = loss_fn

    def train_step(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self._model.train()
        self._optimizer.zero_grad()  # torch 2 defaults to set_to_none; Horovod's wrapper takes no argument
        loss = self._loss_fn(self._model(features), labels)
        loss.backward()
        if self._backend_averages:
            self.comm.record_allreduce(self._grad_bytes)
        elif self.comm.size > 1:
            average_gradients(self.comm, self._params)
        self._optimizer.step()
        return loss.detach()

    def end_epoch(self) -> None:
        # Buffers (BatchNorm running stats) drift apart per rank; rank 0's copy is the one kept.
        if self.comm.size > 1:
            with torch.no_grad():
                for buffer in self._model.buffers():
                    self.comm.broadcast(buffer.data, src=0)

    def module(self) -> nn.Module:
        return self._model
