"""The shards of sharded data parallel (strategies/sharded.py).

A `LayerShard` is this rank's 1/W of a set of trainable parameters as one flat fp32 tensor, gathered
only while they compute, and the reduction of their gradients into it. A `Layer` is one step of
the model's forward: its module, the shard of the parameters only it uses and the shards of
parameters it shares with other layers (tied weights: a token embedding and the output layer). A
shared parameter lives in exactly one shard, gathered by each layer that uses it; each use
reduce-scatters its gradient into that shard, so the optimizer sees the sum of both uses, as in
the whole model. (One reduction per use sends the tied tensor's gradient once more than keeping
it whole from the head's backward to the embedding's would, but never holds a whole-vocabulary
gradient through the backward: memory is what sharding is for.)
"""
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
    """This rank's flat shard of `params` (padded to a multiple of W). Gathered into `scratch`
    when one is set (a layer's own parameters: one buffer for every layer), else into buffers of
    its own made for the gather and dropped at release (shared parameters, gathered while a layer's
    own are: they cannot use the same buffer)."""

    def __init__(self, params: list[nn.Parameter], comm: Communicator, what: str) -> None:
        self.params, self.comm = params, comm
        odd = sorted({str(p.dtype).replace("torch.", "") for p in self.params} - {"float32"})
        if odd:
            raise ConfigError(f"strategy='sharded' keeps fp32 parameters (their shards, gradients and optimizer "
                              f"state), but {what} has {', '.join(odd)} parameters",
                              hint="build the model in float32 (precision='bf16' trains under autocast with fp32 "
                                   "weights), or use strategy='data_parallel'")
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
        self._own: Scratch | None = None  # buffers made for one gather (no shared scratch)
        self.release()

    def gather(self, with_gradients: bool = False) -> None:
        """The full parameters as views into the gather buffer; `with_gradients`: their .grad as
        zeroed views into the gradient buffer, which autograd accumulates into in place."""
        if not self.params:
            return
        scratch = self._buffers()
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

    def _buffers(self) -> Scratch:
        if self.scratch is not None:
            return self.scratch
        if self._own is None:
            self._own = Scratch(self.full_size, self.comm.device)
        return self._own

    def release(self) -> None:
        for param in self.params:
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
            param.grad = None
        self._own = None

    def scatter_gradients(self) -> None:
        """This rank's shard of the gradients averaged over ranks, added to what it holds (the
        earlier micro-batches of an accumulation window, or another layer's use of the same
        parameters)."""
        if not self.params:
            return
        grads = self._buffers().gradients[: self.full_size]
        for param, offset in zip(self.params, offsets(self.params)):
            if param.grad is not None and param.grad.data_ptr() != grads[offset:].data_ptr():
                grads[offset: offset + param.numel()] = param.grad.reshape(-1)  # autograd replaced the view
        mine = self.comm.reduce_scatter(grads, op="avg")
        self.shard.grad = mine if self.shard.grad is None else self.shard.grad.add_(mine)


class Layer:
    """One layer of the cut model: its module, the shard of the parameters only it uses (`own`)
    and the shards of those it shares with other layers, gathered and released together."""

    def __init__(self, module: nn.Module, own: LayerShard, shared: list[LayerShard]) -> None:
        self.module, self.own, self.shared = module, own, shared
        self.in_place = any(getattr(m, "inplace", False) is True for m in module.modules())

    @property
    def shards(self) -> list[LayerShard]:
        return [self.own, *self.shared]

    def gather(self, with_gradients: bool = False) -> None:
        for shard in self.shards:
            shard.gather(with_gradients)

    def release(self) -> None:
        for shard in self.shards:
            shard.release()

    def scatter_gradients(self) -> None:
        for shard in self.shards:
            shard.scatter_gradients()


def shared_groups(modules: list[nn.Module]) -> list[tuple[tuple[int, ...], list[nn.Parameter]]]:
    """The trainable parameters more than one layer uses, grouped by the layers that use them (one
    shard per group), in the order they first appear."""
    users: dict[int, list[int]] = {}
    first: dict[int, nn.Parameter] = {}
    for index, module in enumerate(modules):
        for param in module.parameters():
            if param.requires_grad:
                users.setdefault(id(param), []).append(index)
                first.setdefault(id(param), param)
    groups: dict[tuple[int, ...], list[nn.Parameter]] = {}
    for key, layers in users.items():
        if len(layers) > 1:
            groups.setdefault(tuple(layers), []).append(first[key])
    return list(groups.items())


def gathered_numels(modules: list[nn.Module]) -> list[int]:
    """How many trainable parameters each layer holds whole while it computes (its own and those it
    shares): what a memory estimate takes the largest of (sharded.model_layers gives the layers)."""
    return [sum(p.numel() for p in module.parameters() if p.requires_grad) for module in modules]


def build_layers(modules: list[nn.Module], comm: Communicator) -> tuple[list[Layer], list[LayerShard]]:
    """Every layer with its shards, and the shared shards (after the layers' own in the optimizer's
    order)."""
    groups = shared_groups(modules)
    shared_ids = {id(p) for _, params in groups for p in params}
    shared = [LayerShard(params, comm, f"the parameters layers {', '.join(map(str, users))} share")
              for users, params in groups]
    layers = []
    for index, module in enumerate(modules):
        params = [p for p in module.parameters() if p.requires_grad and id(p) not in shared_ids]
        uses = [shard for (users, _), shard in zip(groups, shared) if index in users]
        layers.append(Layer(module, LayerShard(params, comm, type(module).__name__), uses))
    return layers, shared


def own_layer(module: nn.Module, comm: Communicator) -> Layer:
    """A layer that shares nothing (one built from its own factory)."""
    return Layer(module, LayerShard([p for p in module.parameters() if p.requires_grad], comm,
                                    type(module).__name__), [])


def offsets(params: list[nn.Parameter]) -> list[int]:
    offsets, offset = [], 0
    for param in params:
        offsets.append(offset)
        offset += param.numel()
    return offsets
