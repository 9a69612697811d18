"""model/calling.py: one rule for reading what a model returns and binding inputs to its forward(),
on real Hugging Face outputs and models (tiny, from configs)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from sparkdl.errors import ConfigError, ModelError
from sparkdl.model.calling import (ModelLoss, bound_inputs, call_model, forward_parameters, loss_input, model_loss,
                                   primary_output, scored_labels)
from sparkdl.model.losses import BuiltinLoss

transformers = pytest.importorskip("transformers")


def tiny_gpt2() -> nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50,
                                                                 n_positions=16, bos_token_id=0, eos_token_id=0))


def test_a_model_output_is_read_as_its_logits_and_its_loss() -> None:
    model = tiny_gpt2()
    ids = torch.randint(0, 50, (3, 8))
    out = call_model(model, {"input_ids": ids, "labels": ids})
    assert primary_output(out) is out.logits
    assert model_loss(out) is out.loss
    assert loss_input(ModelLoss(), out) is out
    torch.testing.assert_close(BuiltinLoss("causal_lm")(primary_output(out), ids), out.loss)


def test_tuples_dicts_and_tensors() -> None:
    logits, loss = torch.randn(2, 3), torch.tensor(0.5)
    assert primary_output(logits) is logits
    assert primary_output((loss, logits)) is logits  # return_dict=False with labels: (loss, logits, ...)
    assert model_loss((loss, logits)) is loss
    assert primary_output({"embedding": logits}) is logits
    assert primary_output({"loss": loss, "logits": logits}) is logits
    with pytest.raises(ModelError, match="loss='model'"):
        model_loss({"logits": logits})
    half = torch.randn(2, 3, dtype=torch.bfloat16)
    assert loss_input(BuiltinLoss("mse"), {"logits": half}).dtype == torch.float32


def test_inputs_bind_by_name_or_positionally_for_the_models_own_loss() -> None:
    model = tiny_gpt2()
    assert bound_inputs(model, ["input_ids", "attention_mask"], False) == {"input_ids": "input_ids",
                                                                          "attention_mask": "attention_mask"}
    assert bound_inputs(model, ["tokens"], False) is None  # positional, as before
    assert bound_inputs(model, ["tokens"], True) == {"input_ids": "tokens"}
    assert bound_inputs(type(model), ["tokens"], True) == {"input_ids": "tokens"}  # the class (pretrained paths)
    assert bound_inputs(nn.Sequential(nn.Linear(2, 2)), ["input"], True) is None
    names, varkw = forward_parameters(model)
    assert names[0] == "input_ids" and "labels" in names and varkw


def test_causal_lm_scores_the_next_token() -> None:
    labels = torch.tensor([[5, 6, 7, -100]])
    assert scored_labels(BuiltinLoss("causal_lm"), labels).tolist() == [[6, 7, -100, -100]]
    assert scored_labels(BuiltinLoss("cross_entropy"), labels) is labels
    counted = BuiltinLoss("causal_lm").counted(labels)
    assert counted.tolist() == [[1.0, 1.0, 0.0, 0.0]]


def test_text_options_are_checked() -> None:
    from sparkdl.config import DataConfig

    with pytest.raises(ConfigError, match="packing=True needs data.tokenizer"):
        DataConfig(input_cols=["t"], packing=True).validate()
    with pytest.raises(ConfigError, match="max_length"):
        DataConfig(input_cols=["t"], tokenizer="tok.json", max_length=0).validate()
    with pytest.raises(ConfigError, match="needs input_cols"):
        DataConfig(feature_cols=["a"], tokenizer="tok.json").validate()
    with pytest.raises(ConfigError, match="label_col"):
        DataConfig(input_cols=["t"], tokenizer="tok.json", packing=True, label_col="y").validate()
    with pytest.raises(ConfigError, match="tokenizer must be"):
        DataConfig(input_cols=["t"], tokenizer=42).validate()
