"""A transformer priced from what it is: parameter count, blocks, width, sequence length and batch.

A measured layer time on a loaded driver only ever comes out slower than the work, and a whole
Hugging Face model profiled as one layer says nothing of its blocks. So for a transformer of a
known family (model/transformer_layers.py) the planner takes its compute from the standard
count (Kaplan et al. 2020, Narayanan et al. 2021): a forward pass costs 2 FLOPs per parameter
per token (embedding lookups excluded) plus the attention scores and their weighted sum,
4 x T x d per layer per token; training costs three forward passes. Activation memory per
token and layer follows Korthikanti et al. 2022 (34 d + 5 a T bytes at 16 bits, twice at 32),
the planner's per-row memory. `explain()` shows both beside the measured time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class TransformerFacts:
    model: str  # the model's class name
    blocks: int
    hidden: int
    heads: int
    sequence: int  # tokens per row the planner saw in the sample rows
    params: int  # every parameter (trainable or not)
    trainable: int
    embedding_params: int  # looked up, not multiplied

    def forward_flops_per_row(self) -> float:
        dense = 2.0 * (self.params - self.embedding_params) * self.sequence
        attention = 4.0 * self.blocks * self.sequence * self.sequence * self.hidden
        return dense + attention

    def activation_bytes_per_row(self, precision: str) -> float:
        per_token_layer = 34.0 * self.hidden + 5.0 * self.heads * self.sequence
        scale = 1.0 if precision in ("bf16", "16") else 2.0
        return per_token_layer * self.sequence * self.blocks * scale

    def describe(self, batch: int, precision: str, measured_flops_per_row: float) -> str:
        flops = self.forward_flops_per_row()
        measured = f"; measured {measured_flops_per_row / 1e6:.3g} MFLOP" if measured_flops_per_row else ""
        return (f"transformer {self.model}: {self.blocks} blocks x hidden {self.hidden}, {self.heads} heads, "
                f"sequence {self.sequence}, {self.params / 1e6:.3g}M parameters ({self.trainable / 1e6:.3g}M "
                f"trainable); per row {flops / 1e6:.3g} MFLOP forward (x3 to train){measured}, activations "
                f"{self.activation_bytes_per_row(precision) / 2**20:.3g} MiB; a batch of {batch}: "
                f"{3 * flops * batch / 1e9:.3g} GFLOP a step")


def planned_layers(model: nn.Module, loss: Any) -> nn.Sequential | None:
    """The layers the planner prices and a pipeline cuts: an nn.Sequential's, a transformer's cut at
    its blocks (model/transformer_layers.py; not with loss="model", which needs the whole forward),
    or None (one layer: no pipeline)."""
    if isinstance(model, nn.Sequential):
        return model
    if loss == "model":
        return None
    from sparkdl.model.transformer_layers import cut_if_known

    cut = cut_if_known(model)  # a model the cut refuses is one layer here; hybrid says why when named
    return cut.sequential() if cut is not None else None


def transformer_facts(model: nn.Module, sample_inputs: Any) -> TransformerFacts | None:
    """The facts of a transformer of a known family, None for any other model (or no token input)."""
    from sparkdl.model.transformer_layers import cut_if_known

    cut = cut_if_known(model)  # a model the cut refuses is priced as measured
    if cut is None:
        return None
    hf_config = getattr(model, "config", None) or getattr(getattr(model, "base_model", None), "config", None)
    hidden = _first(hf_config, "hidden_size", "n_embd", "d_model")
    heads = _first(hf_config, "num_attention_heads", "n_head")
    sequence = _sequence(sample_inputs)
    if not hidden or not heads or not sequence:
        return None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_weight = getattr(head, "weight", None)
    # looked up only: an embedding the output layer shares is also a matrix product (the logits)
    embedding = sum(m.weight.numel() for m in model.modules()
                    if isinstance(m, nn.Embedding) and m.weight is not head_weight)
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return TransformerFacts(model=type(model).__name__, blocks=max(1, len(cut.layers) - 2), hidden=int(hidden),
                            heads=int(heads), sequence=sequence, params=params, trainable=trainable,
                            embedding_params=embedding)


def _first(hf_config: Any, *names: str) -> int:
    for name in names:
        value = getattr(hf_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def _sequence(inputs: Any) -> int:
    ids = inputs.get("input_ids") if isinstance(inputs, dict) else None
    if ids is None and isinstance(inputs, dict):
        ids = next((v for v in inputs.values() if isinstance(v, torch.Tensor) and not v.is_floating_point()), None)
    if ids is None and isinstance(inputs, (tuple, list)) and inputs:
        ids = inputs[0]
    if ids is None and isinstance(inputs, torch.Tensor):
        ids = inputs
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
        return 0
    return int(ids.shape[1])


def priced_as_transformer(layers: tuple[Any, ...], facts: TransformerFacts | None, precision: str) -> tuple[Any, ...]:
    """The profiled layers with a transformer's per-row work and activations counted rather than
    timed (the measured fixed cost per call stays): the whole model as one layer, or its cut
    (embeddings, one layer per block, final norm + head: 2 FLOPs per parameter per token, the
    blocks' attention besides, the lookups as measured); other models as measured."""
    import dataclasses

    if facts is None:
        return layers
    if len(layers) == 1:
        return (dataclasses.replace(layers[0], flops=facts.forward_flops_per_row(),
                                    saved_bytes=max(layers[0].saved_bytes, facts.activation_bytes_per_row(precision))),)
    if len(layers) != facts.blocks + 2:
        return layers
    tokens, per_block = facts.sequence, facts.activation_bytes_per_row(precision) / facts.blocks
    attention = 4.0 * tokens * tokens * facts.hidden
    priced = [layers[0]]
    for layer in layers[1:-1]:
        priced.append(dataclasses.replace(layer, flops=2.0 * (layer.params + layer.frozen_params) * tokens + attention,
                                          saved_bytes=max(layer.saved_bytes, per_block)))
    head = layers[-1]
    priced.append(dataclasses.replace(head, flops=2.0 * (head.params + head.frozen_params) * tokens))
    return tuple(priced)
