"""A trained PEFT adapter out of sparkdl: saved in PEFT's own layout, or merged into its base.

The module sparkdl trained is the user's: a `peft.PeftModel` itself, or a module holding one (a
wrapper that picks `.logits`, say). `save_adapter` writes what `PeftModel.save_pretrained` writes
(adapter_config.json + adapter_model.safetensors, the adapter's tensors only), so that
`PeftModel.from_pretrained(base, path)` with peft alone gives the trained model back; `merged_module`
folds the adapter into a copy of the base weights (peft's merge_and_unload) for scoring without peft.
`peft` is imported only here, and only when asked.
"""
from __future__ import annotations

import copy
import os
import tempfile
from typing import Any

from torch import nn

from sparkdl.errors import ModelError

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def peft_model_in(module: nn.Module) -> tuple[str, nn.Module]:
    """(its attribute path, "" for the module itself; the PeftModel) of the outermost PeftModel in
    `module`, or a ModelError when there is none."""
    try:
        from peft import PeftModel
    except ImportError:
        raise ModelError("saving or merging an adapter needs the peft package",
                         hint="pip install peft (or sparkdl[hf])") from None
    for name, child in module.named_modules():
        if isinstance(child, PeftModel):
            return name, child
    raise ModelError(f"the trained model ({type(module).__name__}) holds no PEFT adapter (peft.PeftModel)",
                     hint="wrap the model with peft.get_peft_model(model, LoraConfig(...)) before fitting; a plain "
                          "model is saved whole with TorchModel.save(path)")


def save_adapter(module: nn.Module, path: str) -> list[str]:
    """The adapter of `module` in PEFT's layout under `path` (a local directory, or any URI
    storage/files.py reaches: written through a local directory first; adapters are small).
    Returns the paths written."""
    from sparkdl.storage.files import is_local_path, join, locate, write_atomic

    _, peft_model = peft_model_in(module)
    if is_local_path(path):
        peft_model.save_pretrained(path, safe_serialization=True)
        return [os.path.join(path, name) for name in _written(path)]
    written = []
    with tempfile.TemporaryDirectory(prefix="sparkdl-adapter-") as local:
        peft_model.save_pretrained(local, safe_serialization=True)
        for name in _written(local):
            with open(os.path.join(local, name), "rb") as source:
                write_atomic(locate(path).child(name), source.read())
            written.append(join(path, name))
    return written


def _written(directory: str) -> list[str]:
    """The files save_pretrained wrote for the default adapter (named adapters go in subdirectories)."""
    names = sorted(n for n in os.listdir(directory) if os.path.isfile(os.path.join(directory, n)))
    missing = [n for n in ADAPTER_FILES if n not in names]
    if missing:
        raise ModelError(f"peft did not write {', '.join(missing)} under {directory!r}",
                         hint="check the installed peft version (0.21 or later writes both)")
    return names


def merged_module(module: nn.Module) -> nn.Module:
    """A copy of `module` with its adapter merged into the base weights and peft's wrapping gone
    (the plain model, e.g. a transformers GPT2LMHeadModel, where the PeftModel stood). The trained
    module itself is left as it is."""
    name, _ = peft_model_in(module)
    copied = copy.deepcopy(module)
    peft_copy = copied.get_submodule(name) if name else copied
    plain = peft_copy.merge_and_unload()
    plain.eval()
    if not name:
        return plain
    owner, _, attribute = name.rpartition(".")
    setattr(copied.get_submodule(owner) if owner else copied, attribute, plain)
    return copied
