"""The trained-state rule (model/trained_state.py) and PEFT adapters out of sparkdl (model/adapters.py),
without Spark: frozen parameters are left out of what travels and come back from the driver's copy."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from sparkdl.errors import ModelError, TrainingError
from sparkdl.model.trained import ModelParts, add_frozen_part, check_complete, module_from_files, skeleton_bytes
from sparkdl.model.trained_state import (check_same_frozen, frozen_keys, held_frozen_keys, load_trained_state,
                                         module_frozen_digest, trained_bytes, trained_state, trained_state_keys)
from sparkdl.model.tensor_files import write_tensors


def frozen_encoder(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 3))
    model[0].requires_grad_(False)  # a frozen encoder under a trainable head
    return model


def test_frozen_parameters_are_not_trained_state_and_buffers_are() -> None:
    model = frozen_encoder()
    assert frozen_keys(model) == {"0.weight", "0.bias"}
    assert trained_state_keys(model) == {"1.weight", "1.bias", "1.running_mean", "1.running_var",
                                         "1.num_batches_tracked", "2.weight", "2.bias"}
    assert set(trained_state(model)) == trained_state_keys(model)
    assert trained_bytes(model) == sum(t.numel() * t.element_size() for t in trained_state(model).values())


def test_a_tied_trainable_parameter_stays_under_both_names() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    assert trained_state_keys(model) == {"0.weight", "1.weight"}
    model[0].weight.requires_grad_(False)
    assert trained_state_keys(model) == set() and frozen_keys(model) == {"0.weight", "1.weight"}


def test_loading_the_trained_state_keeps_the_frozen_weights_and_refuses_a_partial_state() -> None:
    source, target = frozen_encoder(0), frozen_encoder(1)
    with torch.no_grad():
        source[2].weight.add_(1.0)
    frozen_before = target[0].weight.clone()
    load_trained_state(target, trained_state(source))
    assert torch.equal(target[2].weight, source[2].weight) and torch.equal(target[0].weight, frozen_before)
    load_trained_state(target, source.state_dict())  # a whole-model state (an older checkpoint) loads too
    assert torch.equal(target[0].weight, source[0].weight)
    partial = {k: v for k, v in trained_state(source).items() if k != "2.bias"}
    with pytest.raises(TrainingError, match="2.bias"):
        load_trained_state(target, partial)
    with pytest.raises(TrainingError, match="unknown"):
        load_trained_state(target, {**trained_state(source), "3.weight": torch.zeros(1)})


def test_the_frozen_fingerprint_tells_bases_built_differently_apart() -> None:
    same = {module_frozen_digest(frozen_encoder(0)) for _ in range(2)}
    assert len(same) == 1 and module_frozen_digest(frozen_encoder(1)) not in same
    assert module_frozen_digest(nn.Linear(2, 2)) == ""  # nothing frozen
    check_same_frozen(sorted(same) * 2)
    with pytest.raises(ModelError, match="different frozen"):
        check_same_frozen([module_frozen_digest(frozen_encoder(0)), module_frozen_digest(frozen_encoder(1))])


def test_the_driver_adds_its_frozen_weights_beside_the_ranks_parts(tmp_path) -> None:  # type: ignore[no-untyped-def]
    trained, driver = frozen_encoder(0), frozen_encoder(0)
    with torch.no_grad():
        trained[2].weight.mul_(3.0)
    part = tmp_path / "rank-0.safetensors"
    with open(part, "wb") as out:
        write_tensors(out, trained_state(trained))
    parts = ModelParts((str(part),), owned_directory=str(tmp_path))
    with pytest.raises(TrainingError, match="without 2"):
        check_complete(driver, parts.tensor_names())
    check_complete(driver, parts.tensor_names() | held_frozen_keys(driver))
    add_frozen_part(parts, driver)
    assert [os.path.basename(f) for f in parts.files] == ["rank-0.safetensors", "frozen.safetensors"]
    assert parts.nbytes == 0  # nothing more was sent
    served = module_from_files(skeleton_bytes(driver), parts.files)  # what the MLflow model loads
    for key, value in trained.state_dict().items():
        assert torch.equal(served.state_dict()[key], value), key
    add_frozen_part(parts, driver)  # the parts hold every frozen tensor now: nothing more written
    assert len(parts.files) == 2


def test_a_frozen_weight_the_driver_does_not_hold_is_an_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with torch.device("meta"):
        driver = frozen_encoder(0)
    parts = ModelParts((), owned_directory=str(tmp_path))
    assert held_frozen_keys(driver) == set()
    with pytest.raises(TrainingError, match="no values for 2 frozen"):
        add_frozen_part(parts, driver)


def test_adapters_need_a_peft_model() -> None:
    from sparkdl.model.adapters import merged_module, save_adapter

    with pytest.raises(ModelError, match="holds no PEFT adapter"):
        save_adapter(frozen_encoder(), "/nonexistent")
    with pytest.raises(ModelError, match="holds no PEFT adapter"):
        merged_module(frozen_encoder())


def test_a_lora_adapter_saved_in_peft_layout_loads_with_peft_alone_and_merges(tmp_path) -> None:  # type: ignore[no-untyped-def]
    peft = pytest.importorskip("peft")
    from sparkdl.model.adapters import merged_module, save_adapter

    def base() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    model = peft.get_peft_model(base(), peft.LoraConfig(r=2, target_modules=["0", "2"]))
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.add_(0.1)
    assert trained_state_keys(model) == {n for n, p in model.named_parameters() if p.requires_grad}
    written = save_adapter(model, str(tmp_path / "adapter"))
    assert {os.path.basename(p) for p in written} >= {"adapter_config.json", "adapter_model.safetensors"}
    loaded = peft.PeftModel.from_pretrained(base(), str(tmp_path / "adapter"))
    x = torch.randn(5, 8)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), atol=0, rtol=0)
        merged = merged_module(model)
        assert type(merged) is nn.Sequential and not any("lora" in n for n, _ in merged.named_parameters())
        torch.testing.assert_close(merged(x), model(x), atol=1e-6, rtol=1e-6)
    assert any("lora" in n for n, _ in model.named_parameters())  # the trained model is left as it was
