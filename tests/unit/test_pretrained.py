"""model/pretrained.py: a Hugging Face model directory loaded where it trains; the driver's copy
reads the weights only when frozen parameters (an adapter's base) will never come back."""
from __future__ import annotations

import pickle

import pytest
import torch

from sparkdl.errors import ModelError
from sparkdl.model.pretrained import Pretrained, driver_model, pretrained

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                                                 n_positions=16))
    path = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(path)
    return str(path), model


def test_the_ranks_read_the_weights_and_the_driver_only_the_config(saved) -> None:  # type: ignore[no-untyped-def]
    path, model = saved
    spec = pretrained(path)
    assert len(pickle.dumps(spec)) < 1024
    loaded = spec()
    torch.testing.assert_close(loaded.transformer.h[0].attn.c_attn.weight, model.transformer.h[0].attn.c_attn.weight)
    torch.manual_seed(1)
    copy = driver_model(spec)()
    assert type(copy) is type(model)
    assert not torch.equal(copy.transformer.h[0].attn.c_attn.weight, model.transformer.h[0].attn.c_attn.weight)


def test_an_adapters_frozen_base_is_read_on_the_driver(saved) -> None:  # type: ignore[no-untyped-def]
    path, model = saved
    spec = pretrained(path, adapter=peft.LoraConfig(r=2, target_modules=["c_attn"]))
    copy = driver_model(spec)()
    base = copy.base_model.model.transformer.h[0].attn.c_attn.base_layer.weight
    torch.testing.assert_close(base, model.transformer.h[0].attn.c_attn.weight)
    assert sum(p.numel() for p in copy.parameters() if p.requires_grad) < 1000


def test_a_wrong_path_or_task_says_so(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ModelError, match="cannot be loaded"):
        Pretrained(str(tmp_path / "missing"))()
    with pytest.raises(ModelError, match="no model config"):
        Pretrained(str(tmp_path / "missing")).skeleton()
    with pytest.raises(ModelError, match="names no transformers class"):
        Pretrained(str(tmp_path), task="nonsense")._class()
    with pytest.raises(ModelError, match="path"):
        pretrained("")
