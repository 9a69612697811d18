"""The pieces of a pipeline step that need no communicator: micro-batch sizes and inputs, a
stage's validation inputs, boundary dtypes by name, and the meter of a stage's saved activations
(strategies/hybrid.py composes them)."""
from __future__ import annotations

from typing import Any, Iterable

import torch

from sparkdl.strategies.inputs import InputSpec, rebuilt_inputs


def micro_inputs(gathered: list[torch.Tensor], spec: InputSpec, sizes: list[int]) -> list[Any]:
    """The first stage's inputs of each micro-batch, in the batch's own structure."""
    return [rebuilt_inputs(spec, list(parts)) for parts in zip(*(torch.split(t, sizes) for t in gathered))]


def concatenated_inputs(batches: list[list[torch.Tensor]], spec: InputSpec, device: Any) -> list[torch.Tensor]:
    """Each input tensor of a rank's validation batches, concatenated (empty, shaped by the layout's
    spec, for a rank without validation rows)."""
    return [torch.cat([flat[j] for flat in batches]) if batches else
            torch.empty((0, *shape), dtype=torch_dtype(dtype), device=device) for j, (_, shape, dtype) in enumerate(spec)]


def microbatch_sizes(rows: int, microbatches: int) -> list[int]:
    """Rows of each micro-batch (sizes differ by at most one); fewer micro-batches than requested
    only when a short last batch has fewer rows than that."""
    count = max(1, min(microbatches, rows))
    return [rows // count + (1 if i < rows % count else 0) for i in range(count)]


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name.replace("torch.", ""))


class ActivationMeter:
    """Bytes autograd saves for backward (activations, not parameters), per micro-batch in flight."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self._param_ptrs = {p.data_ptr() for p in params}
        self.current = 0
        self.live = 0
        self.peak = 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.data_ptr() not in self._param_ptrs:
            self.current += tensor.numel() * tensor.element_size()
        return tensor

    def started(self) -> None:
        self.current = 0

    def add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)
