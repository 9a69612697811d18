"""How a model is called on a batch and how its output is read: the one rule every path that runs
a model follows (training in every strategy, validation, the driver's probe, the planner's
profile, transform and the MLflow model).

A batch's inputs are one tensor, a tuple (positional forward arguments) or a dict (keywords), each
with the batch as dim 0 (data/assemble.py). What a model returns may be:
- a tensor: the output;
- a mapping (a Hugging Face `ModelOutput` is an OrderedDict of its non-None fields, or a plain
  dict): its `logits`, else its first tensor that is not `loss`;
- a tuple or list (Hugging Face's `return_dict=False`): its first tensor of at least one dimension
  (a leading 0-d tensor is the loss the model computed from `labels`).
With `loss="model"` the label column is passed as the forward's `labels` keyword and the model's
own loss (`output.loss`, or a leading 0-d tensor) is what trains.

Standard library and torch only: never imports transformers (a ModelOutput is read as a mapping).
"""
from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from sparkdl.errors import ModelError

Inputs = Any  # torch.Tensor | tuple[torch.Tensor, ...] | dict[str, torch.Tensor]
LABELS_KEYWORD = "labels"  # the forward keyword a model computing its own loss takes its labels under


def call_model(module: nn.Module, inputs: Inputs) -> Any:
    """The model's raw output for a batch. An nn.Sequential given several inputs (or keyword
    inputs) hands them to its first layer and runs the rest on what that returns: Sequential.forward
    takes one tensor, and this is how a multi-input model stays cuttable into pipeline stages."""
    if isinstance(module, nn.Sequential) and len(module) and _structured(inputs):
        output = call_model(module[0], inputs)
        for layer in list(module)[1:]:
            output = layer(output)
        return output
    if isinstance(inputs, dict):
        return module(**inputs)
    if isinstance(inputs, (tuple, list)):
        return module(*inputs)
    return module(inputs)


def _structured(inputs: Inputs) -> bool:
    return isinstance(inputs, dict) or (isinstance(inputs, (tuple, list)) and len(inputs) != 1)


def output_of(module: nn.Module, inputs: Inputs) -> torch.Tensor:
    """The output tensor a batch gives (call_model then primary_output)."""
    return primary_output(call_model(module, inputs))


def primary_output(output: Any) -> torch.Tensor:
    """The tensor sparkdl's losses, metrics and predictions read from whatever the model returned
    (the module docstring's rule); anything else is returned as it is, for the callers' shape checks
    to name."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        logits = output.get("logits")
        if isinstance(logits, torch.Tensor):
            return logits
        for key, value in output.items():
            if key != "loss" and isinstance(value, torch.Tensor):
                return value
        return output
    if isinstance(output, (tuple, list)):
        for value in output:
            if isinstance(value, torch.Tensor) and value.dim() >= 1:
                return value
    return output


def model_loss(output: Any) -> torch.Tensor:
    """The loss the model computed itself from its `labels` (loss="model")."""
    loss = None
    if isinstance(output, Mapping):
        loss = output.get("loss")
    elif isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor) and output[0].dim() == 0:
        loss = output[0]
    elif isinstance(output, torch.Tensor) and output.dim() == 0:
        loss = output
    if not isinstance(loss, torch.Tensor):
        raise ModelError("loss='model' needs the model to compute its loss from `labels`, but its output holds no "
                         f"loss ({_describe(output)})",
                         hint="pass a model whose forward takes labels= and returns .loss (Hugging Face's *For* "
                              "models do), or choose a sparkdl loss such as 'cross_entropy' or 'causal_lm'")
    return loss


def _describe(output: Any) -> str:
    if isinstance(output, Mapping):
        return f"{type(output).__name__} with {sorted(output)}"
    if isinstance(output, (tuple, list)):
        return f"a {type(output).__name__} of {len(output)}"
    return type(output).__name__


class ModelLoss:
    """loss="model": the model's own loss, read from its output (picklable; no per-element form,
    so per-row weights cannot apply: checked on the driver)."""

    name = "model"

    def __call__(self, output: Any, label: Any = None) -> torch.Tensor:
        return model_loss(output)

    def __repr__(self) -> str:
        return "ModelLoss()"


def loss_input(loss_fn: Any, output: Any) -> Any:
    """What a loss is given: the model's whole output for loss="model" (it reads `.loss`), the
    primary tensor for every other loss (built-in or the user's callable)."""
    if isinstance(loss_fn, ModelLoss):
        return output
    tensor = primary_output(output)
    if isinstance(tensor, torch.Tensor) and tensor.dtype in (torch.bfloat16, torch.float16):
        return tensor.float()  # losses are taken in fp32
    return tensor


def scored_labels(loss_fn: Any, label: torch.Tensor) -> torch.Tensor:
    """The labels an output is scored against for accuracy and metrics: what the loss compares
    each output position with (a causal LM's labels shifted by one)."""
    predicted = getattr(loss_fn, "predicted", None)
    return predicted(label) if predicted is not None else label


def forward_parameters(module: Any) -> tuple[tuple[str, ...], bool]:
    """(the names forward() takes, in order, self excluded; whether it also takes **kwargs)."""
    forward = getattr(module, "forward", None)
    try:
        signature = inspect.signature(forward)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return (), True
    names = tuple(n for n, p in signature.parameters.items()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    if isinstance(module, type):  # a class's forward: drop self
        names = names[1:]
    varkw = any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values())
    return names, varkw


def bound_inputs(module: Any, columns: tuple[str, ...] | list[str], model_loss_wanted: bool) -> dict[str, str] | None:
    """input_cols given as a list, bound to the forward's parameters: {keyword: column} when every
    column is named after a forward parameter (`input_ids`, `attention_mask`, ...), or (the model
    computes its loss, so its labels go by keyword) positionally onto the first parameters; None:
    keep the positional call. Sequentials keep theirs (their first layer takes the inputs)."""
    is_class = isinstance(module, type) and issubclass(module, nn.Module)
    if isinstance(module, nn.Sequential) or (not isinstance(module, nn.Module) and not is_class) \
            or (is_class and issubclass(module, nn.Sequential)):
        return None
    names, _ = forward_parameters(module)
    if names and all(c in names for c in columns):
        return {c: c for c in columns}
    if model_loss_wanted and len(names) >= len(columns):
        return dict(zip(names, columns))
    return None
