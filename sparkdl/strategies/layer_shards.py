"""One top-level layer's shard under sharded data parallel (strategies/sharded.py): this rank's 1/W
of its trainable parameters as one flat fp32 tensor, gathered into a buffer shared by every layer
only while the layer computes, and the reduction of its gradients into the shard."""
from __future__ import annotations

import torch
from torch import nn

from sparkdl.comm.base import Communicator
from sparkdl.errors import ConfigError


class Scratch:
    """One gather buffer and one gradient buffer, each the size of the largest layer, reused by
    every layer and step: a layer's parameters and gradients are views into them while it computes.
    Fresh allocations of these sizes every layer and step leave glibc's heap holding the freed ones
    (its mmap threshold adapts upwards), which a rank's RSS then shows as if it were state."""

    def __init__(self, numel: int, device: torch.device) -> None:
        self.gathered = torch.empty(numel, dtype=torch.float32, device=device)
        self.gradients = torch.empty(numel, dtype=torch.float32, device=device)


class LayerShard:
    """One top-level layer: this rank's flat shard of its trainable parameters (padded to a
    multiple of W), gathered into the scratch buffer only while it computes."""

    def __init__(self, module: nn.Module, comm: Communicator) -> None:
        self.module, self.comm = module, comm
        self.params = [p for p in module.parameters() if p.requires_grad]
        odd = sorted({str(p.dtype).replace("torch.", "") for p in self.params} - {"float32"})
        if odd:
            raise ConfigError(f"strategy='sharded' keeps fp32 parameters (their shards, gradients and optimizer "
                              f"state), but {type(module).__name__} has {', '.join(odd)} parameters",
                              hint="build the model in float32 (precision='bf16' trains under autocast with fp32 "
                                   "weights), or use strategy='data_parallel'")
        self.in_place = any(getattr(m, "inplace", False) is True for m in module.modules())
        self.shapes = [p.shape for p in self.params]
        self.numel = sum(p.numel() for p in self.params)
        self.shard_size = -(-self.numel // comm.size)
        self.full_size = self.shard_size * comm.size
        shard = torch.zeros(self.shard_size, dtype=torch.float32, device=comm.device)
        start = comm.rank * self.shard_size
        offset = 0
        for param in self.params:  # copy this rank's slice of the flat parameters, never the whole
            low, high = max(start, offset), min(start + self.shard_size, offset + param.numel())
            if low < high:
                shard[low - start: high - start] = param.detach().reshape(-1)[low - offset: high - offset].float()
            offset += param.numel()
        self.shard = nn.Parameter(shard)
        self.scratch: Scratch | None = None
        self.release()

    def gather(self, with_gradients: bool = False) -> None:
        """The full parameters as views into the gather buffer; `with_gradients`: their .grad as
        zeroed views into the gradient buffer, which autograd accumulates into in place."""
        if not self.params:
            return
        scratch = self.scratch
        full = self.comm.allgather_into(self.shard.detach(), out=scratch.gathered[: self.full_size])
        if with_gradients:
            scratch.gradients[: self.full_size].zero_()
        offset = 0
        for param, shape in zip(self.params, self.shapes):
            count = shape.numel()
            param.data = full[offset: offset + count].view(shape).to(param.dtype)
            if with_gradients:
                param.grad = scratch.gradients[offset: offset + count].view(shape)
            offset += count

    def release(self) -> None:
        for param in self.params:
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
            param.grad = None

    def scatter_gradients(self) -> None:
        """This rank's shard of the gradients averaged over ranks, added to what it holds (the
        earlier micro-batches of an accumulation window)."""
        if not self.params:
            return
        grads = self.scratch.gradients[: self.full_size]
        for param, offset in zip(self.params, offsets(self.params)):
            if param.grad is not None and param.grad.data_ptr() != grads[offset:].data_ptr():
                grads[offset: offset + param.numel()] = param.grad.reshape(-1)  # autograd replaced the view
        mine = self.comm.reduce_scatter(grads, op="avg")
        self.shard.grad = mine if self.shard.grad is None else self.shard.grad.add_(mine)


def offsets(params: list[nn.Parameter]) -> list[int]:
    offsets, offset = [], 0
    for param in params:
        offsets.append(offset)
        offset += param.numel()
    return offsets
