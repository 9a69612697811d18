"""planner/transformer_cost.py: a transformer's work and activations counted from what it is."""
from __future__ import annotations

import pytest
import torch

from sparkdl.planner import cost
from sparkdl.planner.transformer_cost import priced_as_transformer, transformer_facts

transformers = pytest.importorskip("transformers")


def test_a_gpt2_is_counted_from_its_parameters_width_and_sequence() -> None:
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=100,
                                                                 n_positions=32))
    facts = transformer_facts(model, {"input_ids": torch.zeros(2, 16, dtype=torch.long)})
    assert facts is not None and (facts.blocks, facts.hidden, facts.heads, facts.sequence) == (3, 64, 4, 16)
    params = sum(p.numel() for p in model.parameters())  # the head is tied: counted once
    embedding = model.transformer.wte.weight.numel() + model.transformer.wpe.weight.numel()
    assert facts.params == params and facts.embedding_params == embedding
    assert facts.forward_flops_per_row() == 2 * (params - embedding) * 16 + 4 * 3 * 16 * 16 * 64
    assert facts.activation_bytes_per_row("32") == 2 * facts.activation_bytes_per_row("bf16") > 0
    layer = cost.LayerCost(params=params, flops=1.0, out_bytes=4, saved_bytes=1.0, kind="GPT2LMHeadModel")
    priced = priced_as_transformer((layer,), facts, "32")[0]
    assert priced.flops == facts.forward_flops_per_row() and priced.saved_bytes == facts.activation_bytes_per_row("32")
    assert "3 blocks x hidden 64" in facts.describe(8, "32", 0.0)


def test_other_models_and_float_inputs_are_priced_as_measured() -> None:
    assert transformer_facts(torch.nn.Sequential(torch.nn.Linear(4, 2)), torch.zeros(2, 4)) is None
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    assert transformer_facts(model, torch.zeros(2, 8)) is None  # no token ids: no sequence to count
