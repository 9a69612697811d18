"""What a pipeline cuts, and the tensors two stages share (strategies/hybrid.py composes these).

A model is cut between its top-level layers: an nn.Sequential's children, or a Hugging Face
transformer's embeddings, blocks and head (model/transformer_layers.py). A stage's module keeps the
model's own state_dict keys (`3.weight` for a Sequential, `transformer.h.3.attn.c_attn.weight` for
a transformer), so the driver merges the stages' states into the model it was given.

Tied tensors (the LM head sharing the token embedding) live on the first and the last stage. Each
holds its own copy; after backward the holders of a replica sum the copies' gradients (Megatron's
rule), so both take the same step and stay equal, and gradient clipping counts the tensor once.
"""
from __future__ import annotations

import collections
import math
from typing import Any, Sequence

import torch
from torch import nn

from sparkdl.comm.base import Communicator
from sparkdl.errors import ConfigError, ModelError
from sparkdl.model.layouts import HybridLayout
from sparkdl.model.transformer_layers import LOOKED_FOR, TransformerCut, check_cut, transformer_layers
from sparkdl.strategies.stepping import OptimizerSteps

TIED_TAG = 7 << 24  # hybrid.py's message kinds are 1..6 << 24


def pipeline_layers(model: nn.Module, sample: Any = None) -> nn.Sequential:
    """The model as the sequence of layers a pipeline cuts: a Sequential as it is, a transformer as
    its cut (checked against the model's own output on `sample` inputs when given)."""
    if isinstance(model, nn.Sequential):
        return model
    cut = _cut(model)
    if sample is not None:
        check_cut(model, cut, sample)
    return cut.sequential()


def stage_module(model: nn.Module, layout: HybridLayout, stage: int
                 ) -> tuple[nn.Module, tuple[tuple[tuple[int, str], ...], ...]]:
    """(stage `stage`'s module, the cut's tied groups: (layer index, key) each; () for a Sequential)."""
    layers = layout.stage_layers(stage)
    if isinstance(model, nn.Sequential):
        # Keys keep the full model's layer indices, so the driver merges the stages' state dicts.
        return nn.Sequential(collections.OrderedDict((str(i), model[i]) for i in layers)), ()
    cut = _cut(model)
    if len(cut.layers) != layout.cuts[-1]:
        raise ModelError(f"the hybrid layout cuts {layout.cuts[-1]} layers, but {type(model).__name__} cuts into "
                         f"{len(cut.layers)}", hint="plan the run again for this model")
    return cut.stage(layers), cut.tied


def _cut(model: nn.Module) -> TransformerCut:
    cut = transformer_layers(model) if isinstance(model, nn.Module) else None
    if cut is None:
        raise ModelError(f"strategy='hybrid' cuts an nn.Sequential at its top-level layers, or a Hugging Face "
                         f"transformer between its blocks, but the model is a {type(model).__name__} (looked for "
                         f"{LOOKED_FOR})",
                         hint="build the model as nn.Sequential(...), pass model=[stage0, stage1, ...] (a list of "
                              "stage modules), or a GPT-2, Llama-style or BERT-style Hugging Face model")
    return cut


def stage_of(cuts: Sequence[int], layer: int) -> int:
    return next(k for k in range(len(cuts) - 1) if cuts[k] <= layer < cuts[k + 1])


class TiedGradients:
    """The tensors this stage holds together with other stages of its replica: after backward
    (and after averaging over replicas) every holder sends its copy's gradient to the others and
    adds them up in stage order, so every holder gets the same bits."""

    def __init__(self, comm: Communicator, layout: HybridLayout, replica: int, stage: int, module: nn.Module,
                 tied: Sequence[Sequence[tuple[int, str]]], steps: OptimizerSteps) -> None:
        self._comm = comm
        params = dict(module.named_parameters(remove_duplicate=False))
        ranks = layout.grid[replica]
        self._groups: list[tuple[int, nn.Parameter, list[int], int]] = []
        for index, group in enumerate(tied):
            stages = sorted({stage_of(layout.cuts, layer) for layer, _ in group})
            if len(stages) < 2 or stage not in stages:
                continue
            key = next(key for layer, key in group if stage_of(layout.cuts, layer) == stage)
            if not params[key].requires_grad:
                continue  # frozen (the embedding under a LoRA adapter): no gradient, both copies stay as built
            self._groups.append((index, params[key], [ranks[s] for s in stages], stages.index(stage)))
        if self._groups and steps.grad_clip > 0 and steps.scaler is not None:
            # fp16's GradScaler unscales inside the step, so the stages would clip by their own norms and
            # the tied copies drift apart.
            raise ConfigError(f"grad_clip={steps.grad_clip} with precision='fp16' cannot clip a pipeline whose "
                              "stages share a tied tensor (the token embedding and the LM head)",
                              hint="use precision='bf16' or '32', or grad_clip=0")

    @property
    def shared(self) -> bool:
        return bool(self._groups)

    def duplicates(self) -> list[nn.Parameter]:
        """This stage's copies that an earlier stage also holds (a norm counts each tensor once)."""
        return [param for _, param, _, position in self._groups if position > 0]

    def sum_gradients(self) -> None:
        for index, param, holders, position in self._groups:
            own = (param.grad if param.grad is not None else torch.zeros_like(param)).contiguous()
            me = holders[position]
            received = {rank: torch.empty_like(own) for rank in holders if rank != me}
            works = [self._comm.irecv(buffer, rank, TIED_TAG + index) for rank, buffer in received.items()]
            works += [self._comm.send(own, rank, TIED_TAG + index) for rank in received]
            for work in works:
                work.wait()
            parts = [own if rank == me else received[rank] for rank in holders]
            total = parts[0].clone()
            for part in parts[1:]:
                total += part
            param.grad = total


def stage_step(steps: OptimizerSteps, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor],
               comm: Communicator, tied: TiedGradients, replicas: int) -> None:
    """A stage's optimizer step once its gradients are averaged over the replicas: the tied tensors'
    gradients summed, clipped by the whole pipeline's norm (as one process clips the model; with
    fp16's scaler each stage clips its own), every stage skipping a non-finite step together
    (nonfinite_loss="skip": a stage's own gradients may all be finite)."""
    tied.sum_gradients()  # after averaging: every holder adds the same values in the same order
    clip = steps.grad_clip
    if clip > 0 and steps.scaler is None:
        clip_pipeline(comm, params, tied.duplicates(), clip, replicas)
        steps.grad_clip = 0.0
    try:
        steps.step(optimizer, params, agree=lambda flag: comm.allreduce(flag, op="sum"))
    finally:
        steps.grad_clip = clip


def clip_pipeline(comm: Communicator, params: Sequence[torch.Tensor], duplicates: Sequence[torch.Tensor],
                  max_norm: float, replicas: int) -> None:
    """clip_grad_norm_'s rule over the whole model a replica's stages hold (as one process would
    clip it): every rank's squared norm, tied copies counted once, summed over all ranks (each
    stage's gradients are equal on its replicas after averaging, hence / replicas)."""
    skip = {id(p) for p in duplicates}
    grads = [p.grad for p in params if p.grad is not None]
    squares = torch.zeros(1, dtype=torch.float32, device=comm.device)
    for param in params:
        if param.grad is not None and id(param) not in skip:
            squares += param.grad.detach().float().pow(2).sum()
    total = comm.allreduce(squares, op="sum")
    norm = math.sqrt(max(float(total[0]) / max(replicas, 1), 0.0))
    factor = max_norm / (norm + 1e-6)
    if factor < 1.0:
        for grad in grads:
            grad.mul_(factor)
