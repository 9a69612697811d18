"""Which tensors of a model are its trained state: the one rule every path follows.

A frozen parameter (requires_grad=False: the base model under a PEFT adapter, a frozen encoder) is
the same on every rank and on the driver: each built it from the same instance, factory + seed or
pretrained path. So it is neither synced (DiLoCo's outer step, the start-up broadcast), checkpointed
nor returned: the trained state is every trainable parameter and every buffer (BatchNorm's running
statistics change in training, and are small). The driver's own copy of the model supplies the
frozen tensors (driver side: `frozen_state`, written once beside the ranks' parts for the MLflow
model and a lazily loaded TorchModel). A fingerprint of the frozen tensors (`frozen_digest`) lets
the ranks and the driver check that they did build the same ones.
Worker-side: torch only.
"""
from __future__ import annotations

import hashlib
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from sparkdl.errors import ModelError, TrainingError

DIGEST_SAMPLES = 4096  # elements hashed per tensor: a differently built tensor differs nearly everywhere


def trained_state_keys(module: nn.Module) -> set[str]:
    """The state-dict keys that training changes: all but those of frozen parameters (a key whose
    parameter is tied to a trainable one stays, being that one)."""
    return {name for name, value in module.state_dict(keep_vars=True).items() if not _frozen(value)}


def frozen_keys(module: nn.Module) -> set[str]:
    """The state-dict keys of frozen parameters: supplied by whoever holds the model, never sent."""
    return {name for name, value in module.state_dict(keep_vars=True).items() if _frozen(value)}


def held_frozen_keys(module: nn.Module) -> set[str]:
    """The frozen keys whose values this copy of the model holds (not on the meta device)."""
    return {name for name, value in module.state_dict(keep_vars=True).items() if _frozen(value) and not value.is_meta}


def _frozen(value: Any) -> bool:
    return isinstance(value, nn.Parameter) and not value.requires_grad


def trained_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The trained state, detached on the CPU (a tensor already there is not copied)."""
    keys = trained_state_keys(module)
    return {name: _on_cpu(value) for name, value in module.state_dict().items() if name in keys}


def frozen_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The frozen parameters by state-dict key (aliases of one tensor each named), detached on the CPU
    (a meta tensor stays one: a driver's copy that does not hold it)."""
    keys = frozen_keys(module)
    return {name: _on_cpu(value) for name, value in module.state_dict().items() if name in keys}


def _on_cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach() if tensor.is_meta else tensor.detach().cpu()


def load_trained_state(module: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """`state` into `module`: every trained key must be there; frozen keys may be (a checkpoint of
    the whole model, written before this rule) or not; any other key is an error."""
    own = module.state_dict(keep_vars=True)
    missing = sorted(trained_state_keys(module) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise TrainingError(f"the saved state does not match the model: {len(missing)} trained tensor(s) missing "
                            f"({', '.join(missing[:4])}), {len(unexpected)} unknown ({', '.join(unexpected[:4])})",
                            hint="resume with the same model (the same trainable and frozen parameters)")
    module.load_state_dict(dict(state), strict=False)


def trained_bytes(module: nn.Module) -> int:
    """Bytes of the trained state (what a checkpoint or a returned part holds of this module)."""
    keys, seen, total = trained_state_keys(module), set(), 0
    for name, value in module.state_dict().items():
        if name in keys and id(value) not in seen:
            seen.add(id(value))
            total += value.numel() * value.element_size()
    return total


def frozen_digest(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> str:
    """A fingerprint of frozen tensors: names, shapes, dtypes and up to DIGEST_SAMPLES evenly strided
    elements of each ("" when there are none). Cheap (a 7B base: milliseconds), and a base built
    differently (another seed, a factory without one) differs in every sample."""
    items = sorted(tensors.items() if isinstance(tensors, Mapping) else tensors, key=lambda item: item[0])
    if not items:
        return ""
    digest = hashlib.sha256()
    for name, tensor in items:
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        if tensor.is_meta or tensor.numel() == 0:
            continue
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // DIGEST_SAMPLES)
        sample = flat[::step][:DIGEST_SAMPLES].cpu().contiguous()
        digest.update(sample.view(torch.uint8).numpy().tobytes() if sample.dtype != torch.bool
                      else sample.numpy().tobytes())
    return digest.hexdigest()[:32]


def module_frozen_digest(module: nn.Module) -> str:
    return frozen_digest({name: value for name, value in module.state_dict().items() if name in frozen_keys(module)})


def check_same_frozen(digests: list[str], where: str = "the ranks") -> None:
    """Every rank built the same frozen parameters (their fingerprints agree), else a ModelError:
    their values would otherwise never meet and the driver's copy would not be the trained one's base."""
    if len(set(digests)) > 1:
        raise ModelError(f"{where} built different frozen (requires_grad=False) parameters: fingerprints "
                         f"{sorted(set(digests))}",
                         hint="build the model deterministically: pass the instance itself, a factory that seeds "
                              "nothing of its own (sparkdl seeds it with train.seed), or pretrained weights")
