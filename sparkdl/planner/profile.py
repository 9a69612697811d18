"""ModelProfile: what each top-level layer of a model costs, measured by a dry run on the driver.

For every layer of an nn.Sequential: parameters, the per-row shape and bytes of its output (what a
pipeline stage boundary sends), the bytes autograd saves for backward per row (what a micro-batch in
flight holds), and the measured time of its forward + backward pass on a small batch. Stage cuts
balance these measured times, not layer counts.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn

from sparkdl.errors import ModelError


@dataclass(frozen=True)
class LayerProfile:
    index: int
    kind: str  # class name, for messages and explain tables
    params: int
    param_bytes: int
    out_shape: tuple[int, ...]  # per row
    out_dtype: str
    out_bytes: int  # per row: what crosses a stage boundary after this layer
    saved_bytes: float  # per row: activations autograd keeps for backward
    seconds: float  # forward + backward of `rows` rows (median of repeats)


@dataclass(frozen=True)
class ModelProfile:
    layers: tuple[LayerProfile, ...]
    input_shape: tuple[int, ...]
    rows: int  # batch size the timings were measured with

    @property
    def param_bytes(self) -> int:
        return sum(layer.param_bytes for layer in self.layers)

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers)

    @property
    def saved_bytes_per_row(self) -> float:
        return sum(layer.saved_bytes for layer in self.layers)


def profile_sequential(model: nn.Sequential, input_shape: tuple[int, ...], rows: int = 64,
                       repeats: int = 3) -> ModelProfile:
    """Run each layer on `rows` zero-mean random rows; the model's weights are left untouched."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn((rows, *input_shape), generator=generator)
    was_training = model.training
    model.train()
    layers = []
    try:
        for index, layer in enumerate(model):
            out, saved, seconds = _measure(layer, x, repeats)
            if not isinstance(out, torch.Tensor):
                raise ModelError(f"layer {index} ({type(layer).__name__}) returns {type(out).__name__}, not one "
                                 "tensor, so the model cannot be cut into pipeline stages there",
                                 hint="make every top-level layer of the nn.Sequential take and return one tensor, "
                                      "or wrap the layers that pass tuples into one module")
            params = sum(p.numel() for p in layer.parameters())
            layers.append(LayerProfile(
                index=index, kind=type(layer).__name__, params=params,
                param_bytes=sum(p.numel() * p.element_size() for p in layer.parameters()),
                out_shape=tuple(out.shape[1:]), out_dtype=str(out.dtype).replace("torch.", ""),
                out_bytes=out[0].numel() * out.element_size(), saved_bytes=saved / rows, seconds=seconds))
            x = out.detach()
    finally:
        model.train(was_training)
        for param in model.parameters():
            param.grad = None
    return ModelProfile(layers=tuple(layers), input_shape=tuple(input_shape), rows=rows)


def _measure(layer: nn.Module, x: torch.Tensor, repeats: int) -> tuple[object, float, float]:
    param_ptrs = {p.data_ptr() for p in layer.parameters()}
    saved = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.data_ptr() not in param_ptrs:
            saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    times = []
    out: object = None
    for attempt in range(repeats + 1):  # the first run warms up allocators and kernels
        saved[0] = 0
        inputs = x.detach().requires_grad_(x.is_floating_point())
        started = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = layer(inputs)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.backward(torch.ones_like(out))
        if attempt:
            times.append(time.perf_counter() - started)
        if not isinstance(out, torch.Tensor):
            break
    return out, float(saved[0]), statistics.median(times) if times else 0.0
