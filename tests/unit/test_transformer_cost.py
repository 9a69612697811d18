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
    embedding = model.transformer.wpe.weight.numel()  # the token embedding is also the head's matrix product
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


def test_a_cut_transformer_is_priced_block_by_block() -> None:
    from sparkdl.planner.transformer_cost import planned_layers

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50,
                                                                 n_positions=16))
    layers = planned_layers(model, "causal_lm")
    assert layers is not None and len(layers) == 4  # embeddings, 2 blocks, norm + head
    assert planned_layers(model, "model") is None  # the model's own loss runs its whole forward
    facts = transformer_facts(model, torch.zeros(1, 8, dtype=torch.long))
    profiled = tuple(cost.LayerCost(params=sum(p.numel() for p in layer.parameters()), flops=1.0, out_bytes=4,
                                    saved_bytes=0.0, kind="x") for layer in layers)
    priced = priced_as_transformer(profiled, facts, "32")
    assert priced[0].flops == 1.0  # lookups as measured
    block = sum(p.numel() for p in layers[1].parameters())
    assert priced[1].flops == 2 * block * 8 + 4 * 8 * 8 * 32
    assert priced[3].flops == 2 * sum(p.numel() for p in layers[3].parameters()) * 8


def test_a_lora_fit_is_priced_on_its_trainable_parameters() -> None:
    """Gradients and syncs carry the adapter; the frozen base counts in memory only."""
    from sparkdl.planner.candidates import layer_costs
    from sparkdl.planner.profile import ModelInput

    peft = pytest.importorskip("peft")
    base = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50,
                                                                n_positions=16))
    lora = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["c_attn"]))
    sample = ModelInput(shape=(8,), dtype="int64", sample=torch.zeros(2, 8, dtype=torch.long))
    _, layers = layer_costs(lora, sample, 4, 1e9, 1.0)
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert sum(layer.params for layer in layers) == trainable
    assert sum(layer.frozen_params for layer in layers) == sum(p.numel() for p in lora.parameters()) - trainable
    work = cost.Workload(layers=layers, world=2, rows=4, flops_per_s=1e9, optimizer_bytes_per_param=16)
    estimate = cost.data_parallel(work, cost.Network(1e-4, 1e8))
    assert estimate.bytes_per_step == cost.allreduce_bytes(trainable * 4, 2)
    assert estimate.memory_bytes >= work.frozen_bytes > 0
