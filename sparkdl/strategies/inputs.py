"""What every strategy does with a batch: move it, call the model on it, and weigh its loss.

A batch's inputs are one tensor (feature_cols runs), a tuple of tensors (positional forward
arguments) or a dict (keyword arguments), each with the batch as dim 0 (data/assemble.py).

Per-row weights (weight_col) make the built-in losses sum(w * l) / sum(w) over the *global* batch:
each rank's share is its weighted sum over the global weight total (one scalar allreduce), times
the number of ranks its gradients are averaged over, so averaging stays exact with weights.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from torch import nn

# How a model is called and its output read is model/calling.py's rule (every path that runs a model).
from sparkdl.model.calling import Inputs, call_model, loss_input, primary_output  # noqa: E402,F401


InputSpec = tuple[tuple[str, tuple[int, ...], str], ...]  # (keyword or "" when positional, per-row shape, dtype)


def input_spec(inputs: Inputs) -> InputSpec:
    """The structure of a batch's inputs, without its rows (a single tensor: one unnamed entry)."""
    names = list(inputs) if isinstance(inputs, dict) else [""] * len(flat_inputs(inputs))
    return tuple((name, tuple(int(n) for n in t.shape[1:]), str(t.dtype).replace("torch.", ""))
                 for name, t in zip(names, flat_inputs(inputs)))


def flat_inputs(inputs: Inputs) -> list[torch.Tensor]:
    if isinstance(inputs, torch.Tensor):
        return [inputs]
    return list(inputs.values()) if isinstance(inputs, dict) else list(inputs)


def rebuilt_inputs(spec: InputSpec, tensors: list[torch.Tensor]) -> Inputs:
    """`tensors` (in flat_inputs order) back in the structure `spec` describes."""
    if len(spec) == 1 and not spec[0][0]:
        return tensors[0]
    if spec and spec[0][0]:
        return {name: t for (name, _, _), t in zip(spec, tensors)}
    return tuple(tensors)


def to_device(inputs: Inputs, device: Any) -> Inputs:
    """Nested too: a sparse_cols batch is (dense, {column: Bag}), and a Bag moves itself."""
    if isinstance(inputs, dict):
        return {k: to_device(v, device) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return tuple(to_device(v, device) for v in inputs)
    return inputs.to(device, non_blocking=True) if inputs is not None else None


def batch_rows(inputs: Inputs) -> int:
    if isinstance(inputs, dict):
        return batch_rows(next(iter(inputs.values())))
    if isinstance(inputs, (tuple, list)):
        return batch_rows(inputs[0])
    return int(inputs.num_bags if hasattr(inputs, "num_bags") else inputs.shape[0])


def takes_weight(loss_fn: Callable[..., Any]) -> bool:
    """A custom loss accepting `weight=` gets the per-row weights and normalises them itself."""
    try:
        return "weight" in inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):
        return False


def weighted_terms(loss_fn: Any, output: Any, label: torch.Tensor, weight: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over rows of w * loss, sum of w over what counts) of a batch; a custom loss taking
    `weight=` gives (its own value, 1)."""
    output = loss_input(loss_fn, output)
    per_element = getattr(loss_fn, "per_element", None)
    if per_element is None:
        return loss_fn(output, label, weight=weight), torch.ones((), dtype=torch.float32, device=label.device)
    losses, counted = per_element(output, label)
    shape = (weight.shape[0],) + (1,) * (losses.dim() - 1)
    w = weight.to(losses.dtype).reshape(shape)
    return (losses * w).sum(), (counted * w).sum().detach()


def global_share(numerator: torch.Tensor, denominator: torch.Tensor, total: torch.Tensor, ranks: int) -> torch.Tensor:
    """This rank's part of the global weighted mean, scaled so that averaging gradients over
    `ranks` gives the gradient of sum(w * l) / sum(w) over all of them (0 when no weight counts)."""
    return numerator * (ranks / total.clamp_min(torch.finfo(torch.float32).tiny))


def loss_and_weight_sum(loss_fn: Any, output: Any, label: torch.Tensor, weight: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(mean loss of this batch for reporting, weighted numerator, local weight sum); the last two
    None without weights."""
    if weight is None:
        return loss_fn(loss_input(loss_fn, output), label), None, None
    numerator, denominator = weighted_terms(loss_fn, output, label, weight)
    mean = numerator.detach() / denominator.clamp_min(torch.finfo(torch.float32).tiny)
    return mean, numerator, denominator


def weight_total(loss_fn: Any, label: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """The denominator weighted_terms gives these rows (sum of w over what counts), from the labels
    alone, before any forward pass; None for a custom loss (it normalises its own weights)."""
    counted = getattr(loss_fn, "counted", None)
    if counted is None:
        return None
    mask = counted(label)
    return (mask * weight.to(mask.dtype).reshape((weight.shape[0],) + (1,) * (mask.dim() - 1))).sum()
