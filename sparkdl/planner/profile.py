"""ModelProfile: what each top-level layer of a model costs, measured by a dry run on the driver.

For every layer of an nn.Sequential: parameters, the per-row shape and bytes of its output (what a
pipeline stage boundary sends), the bytes autograd saves for backward per row (what a micro-batch in
flight holds), and the measured time of its forward + backward pass on a small batch. Stage cuts
balance these measured times, not layer counts.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from sparkdl.errors import ModelError
from sparkdl.model.calling import primary_output
from sparkdl.model.layer_factories import real_layers

if TYPE_CHECKING:
    from sparkdl.data.assemble import ModelInputs  # one tensor, a tuple of them, or a dict (input_cols as a dict)


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
    seconds: float  # forward + backward of `rows` rows (fastest repeat; alike layers share the fastest)
    backward_seconds: float = 0.0  # the backward part of `seconds` (same repeat rule): when gradients arrive

    @property
    def backward_share(self) -> float:
        """What cost.LayerCost.backward_share takes: the measured share of backward (2/3 unmeasured)."""
        return min(1.0, self.backward_seconds / self.seconds) if self.seconds > 0 and self.backward_seconds > 0 \
            else 2.0 / 3.0


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


@dataclass(frozen=True)
class ModelInput:
    """What the planner feeds the model: zero-mean random float rows of `shape` (feature_cols runs),
    or a real sample batch of the run tiled to any number of rows (input_cols runs: token ids stay
    valid ids, images stay images), with its labels for timing a whole step."""

    shape: tuple[int, ...] = ()  # per row, of a single input tensor (() for several inputs)
    dtype: str = "float32"
    sample: "ModelInputs | None" = None  # a few rows of real inputs
    label: "torch.Tensor | None" = None  # their labels, or None
    label_shape: tuple[int, ...] = ()

    @classmethod
    def of(cls, value: "ModelInput | int | tuple[int, ...]") -> "ModelInput":
        if isinstance(value, ModelInput):
            return value
        return cls(shape=(value,) if isinstance(value, int) else tuple(value))

    @classmethod
    def from_sample(cls, inputs: Any, label: Any = None) -> "ModelInput":
        if isinstance(inputs, (tuple, list)) and len(inputs) == 1:
            inputs = inputs[0]  # one positional input: forward(x), as a pipeline's first stage gets it
        single = inputs if isinstance(inputs, torch.Tensor) else None
        if single is None and len(inputs) == 1:
            single = next(iter(inputs.values())) if isinstance(inputs, dict) else inputs[0]
        shape = tuple(single.shape[1:]) if single is not None else ()
        dtype = str(single.dtype).replace("torch.", "") if single is not None else "float32"
        label_shape = tuple(label.shape[1:]) if isinstance(label, torch.Tensor) else ()
        return cls(shape=shape, dtype=dtype, sample=inputs, label=label, label_shape=label_shape)

    @property
    def specs(self) -> tuple[tuple[str, tuple[int, ...], str], ...]:
        """Several (or keyword) inputs: (keyword or "", per-row shape, dtype) of each, in forward()
        order, what a pipeline's first stage rebuilds an empty batch from; () for one tensor."""
        if self.sample is None or isinstance(self.sample, torch.Tensor):
            return ()
        tensors = tensors_of(self.sample)
        names = list(self.sample) if isinstance(self.sample, dict) else [""] * len(tensors)
        return tuple((name, tuple(int(n) for n in t.shape[1:]), str(t.dtype).replace("torch.", ""))
                     for name, t in zip(names, tensors))

    def rows(self, count: int, generator: torch.Generator | None = None) -> Any:
        if self.sample is None:
            return torch.randn((count, *self.shape), generator=generator)
        return _tiled(self.sample, count)

    def labels(self, count: int) -> Any:
        return None if self.label is None else _tiled(self.label, count)

    @property
    def bytes_per_row(self) -> float:
        if self.sample is None:
            return 4.0 * math.prod(self.shape)
        tensors = tensors_of(self.sample)
        rows = max(1, int(tensors[0].shape[0]))
        return float(sum(t.numel() * t.element_size() for t in tensors)) / rows


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors of a model input (one tensor, or a dict, tuple or list of them): the sample's, a
    trial batch's (planner/step_trial.py); anything else in a container is left out."""
    if isinstance(value, torch.Tensor):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    return [v for v in items if isinstance(v, torch.Tensor)]


def _tiled(inputs: Any, count: int) -> Any:
    """`count` rows cycling over the sample's rows."""
    if isinstance(inputs, dict):
        return {k: _tiled(v, count) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return tuple(_tiled(v, count) for v in inputs)
    return inputs[torch.arange(count) % max(1, inputs.shape[0])]


def _fresh(x: Any) -> Any:
    """Inputs detached, floats requiring grad (what a pipeline stage receives)."""
    if isinstance(x, dict):
        return {k: _fresh(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return tuple(_fresh(v) for v in x)
    return x.detach().requires_grad_(x.is_floating_point())


def _call(layer: nn.Module, x: Any) -> Any:
    if isinstance(x, dict):
        return layer(**x)
    return layer(*x) if isinstance(x, tuple) else layer(x)


def boundary_dtype(out_dtype: torch.dtype, precision: str) -> torch.dtype:
    """What a pipeline stage sends after a layer with this output: bf16 training sends bf16 for
    any fp32 activation (half the bytes; the receiving stage runs under autocast anyway)."""
    return torch.bfloat16 if precision == "bf16" and out_dtype == torch.float32 else out_dtype


def profile_sequential(model: nn.Sequential, input_shape: "ModelInput | tuple[int, ...] | int", rows: int = 64,
                       repeats: int = 3, precision: str = "32", whole_model: bool = False) -> ModelProfile:
    """Run each layer on `rows` rows (random, or the run's sample tiled: ModelInput) as training
    will (under bf16 autocast for precision="bf16"); the model's weights are left untouched.
    `whole_model`: the Sequential wraps one whole model, whose output is read by model/calling's rule
    (a Hugging Face ModelOutput's logits); a real layer must return one tensor to be a boundary."""
    generator = torch.Generator().manual_seed(0)
    model_input = ModelInput.of(input_shape)
    x = model_input.rows(rows, generator)
    was_training = model.training
    model.train()
    layers = []
    signatures = []
    try:
        for index, layer in enumerate(real_layers(model)):  # a meta copy: each layer real only while profiled
            signatures.append(_signature(layer, x))
            out, saved, seconds, backward = _measure(layer, x, repeats, precision, whole_model)
            if not isinstance(out, torch.Tensor):
                raise ModelError(f"layer {index} ({type(layer).__name__}) returns {type(out).__name__}, not one "
                                 "tensor, so the model cannot be cut into pipeline stages there",
                                 hint="make every top-level layer of the nn.Sequential take and return one tensor, "
                                      "or wrap the layers that pass tuples into one module")
            params = sum(p.numel() for p in layer.parameters())
            sent = boundary_dtype(out.dtype, precision)
            layers.append(LayerProfile(
                index=index, kind=type(layer).__name__, params=params,
                param_bytes=sum(p.numel() * p.element_size() for p in layer.parameters()),
                out_shape=tuple(out.shape[1:]), out_dtype=str(sent).replace("torch.", ""),
                out_bytes=out[0].numel() * sent.itemsize, saved_bytes=saved / rows, seconds=seconds,
                backward_seconds=backward))
            x = out.detach()
    finally:
        model.train(was_training)
        for param in model.parameters():
            param.grad = None
    return ModelProfile(layers=_alike_cost_alike(layers, signatures), input_shape=model_input.shape, rows=rows)


def _signature(layer: nn.Module, x: Any) -> tuple:
    """What a layer's cost depends on: its class, its parameters' names, shapes and dtypes, and the
    shapes of what it is fed. Layers with the same signature do the same work."""
    params = tuple((name, tuple(p.shape), str(p.dtype)) for name, p in layer.named_parameters())
    inputs = tuple((tuple(t.shape), str(t.dtype)) for t in tensors_of(x))
    return type(layer).__qualname__, params, inputs


def _alike_cost_alike(layers: list[LayerProfile], signatures: list[tuple]) -> tuple[LayerProfile, ...]:
    """Every layer takes the fastest time measured among the layers of its signature. On a loaded
    driver a measurement can only come out slower than the work, by however much another process
    took the core at that moment: twelve identical transformer blocks timed 8 ms to 230 ms apart
    moved pipeline cuts from fit to fit. The fastest of alike measurements is the least disturbed."""
    import dataclasses

    fastest: dict[tuple, float] = {}
    fastest_backward: dict[tuple, float] = {}
    for layer, signature in zip(layers, signatures):
        fastest[signature] = min(fastest.get(signature, math.inf), layer.seconds)
        fastest_backward[signature] = min(fastest_backward.get(signature, math.inf), layer.backward_seconds)
    return tuple(dataclasses.replace(layer, seconds=fastest[signature], backward_seconds=fastest_backward[signature])
                 for layer, signature in zip(layers, signatures))


def _measure(layer: nn.Module, x: Any, repeats: int, precision: str = "32",
             whole_model: bool = False) -> tuple[object, float, float, float]:
    """(output, bytes saved for backward, fastest forward + backward, fastest backward alone): the
    backward part says when within a step this layer's gradients arrive (planner/overlap.py)."""
    from contextlib import nullcontext

    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision == "bf16" else nullcontext
    param_ptrs = {p.data_ptr() for p in layer.parameters()}
    saved = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.data_ptr() not in param_ptrs:
            saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    times, backward_times = [], []
    out: object = None
    for attempt in range(repeats + 1):  # the first run warms up allocators and kernels
        saved[0] = 0
        inputs = _fresh(x)
        started = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast():
            out = _call(layer, inputs)
            out = primary_output(out) if whole_model else out  # a whole Hugging Face model: its logits
        backward_started = time.perf_counter()
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.backward(torch.ones_like(out))
        if attempt:
            ended = time.perf_counter()
            times.append(ended - started)
            backward_times.append(ended - backward_started)
        if not isinstance(out, torch.Tensor):
            break
    # The fastest repeat: load on the driver only ever adds time to a measurement.
    return out, float(saved[0]), min(times) if times else 0.0, min(backward_times) if backward_times else 0.0


@dataclass(frozen=True)
class GradientTimes:
    """One measured backward of a whole model: each trainable parameter's bytes and when (seconds
    after backward began) its gradient was final, in the model's parameter order."""

    param_bytes: tuple[int, ...]
    ready_s: tuple[float, ...]
    backward_s: float


def gradient_times(model: nn.Module, inputs: Any, loss_of: Any, repeats: int = 3) -> GradientTimes:
    """Time backward on `inputs` with a post-accumulate hook per trainable parameter (what
    strategies/grad_overlap.py starts its buckets on): the repeat with the fastest backward (load
    only ever adds time), after one warm-up. `loss_of(output)` makes the scalar loss. Gradients are
    cleared afterwards; the weights are untouched."""
    params = [p for p in model.parameters() if p.requires_grad]
    stamps = [0.0] * len(params)
    hooks = [p.register_post_accumulate_grad_hook(lambda _p, i=i: stamps.__setitem__(i, time.perf_counter()))
             for i, p in enumerate(params)]
    best: GradientTimes | None = None
    try:
        for attempt in range(max(1, repeats) + 1):
            loss = loss_of(_call(model, inputs))
            started = time.perf_counter()
            loss.backward()
            ended = time.perf_counter()
            measured = GradientTimes(tuple(p.numel() * p.element_size() for p in params),
                                     tuple(s - started for s in stamps), ended - started)
            if attempt and (best is None or measured.backward_s < best.backward_s):
                best = measured
            for p in params:
                p.grad = None
    finally:
        for hook in hooks:
            hook.remove()
    assert best is not None
    return best
