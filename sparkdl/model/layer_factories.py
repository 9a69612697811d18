"""`model=[callable, callable, ...]`: one zero-argument callable per top-level layer (a layer group:
any module, e.g. a transformer block), so that each rank builds only the layers it trains and nobody
holds the whole model before it is returned.

Layer i is built under its own seed (from the run seed and i), so a rank that builds layers 4-7
gets the same weights as one that builds them all. A callable may build on the meta device
(`with torch.device("meta"): ...`): the layer is then materialised with `to_empty` and its
modules' own `reset_parameters` under the same seed, which equals the eager build for modules that
initialise themselves through reset_parameters (torch's own layers do; a buffer computed in
__init__, such as a fixed positional table, must be built eagerly). The driver keeps a meta copy
(shapes only) and materialises one layer at a time to probe and profile it.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from sparkdl.errors import ModelError


@dataclass(frozen=True)
class LayerFactories:
    factories: tuple[Callable[[], nn.Module], ...]

    @classmethod
    def of(cls, model: Any) -> "LayerFactories | None":
        """A list/tuple of callables that are not modules themselves; None for anything else."""
        if isinstance(model, LayerFactories):
            return model
        if isinstance(model, (list, tuple)) and model and all(callable(f) and not isinstance(f, nn.Module)
                                                              for f in model):
            return cls(tuple(model))
        return None

    def __len__(self) -> int:
        return len(self.factories)

    def layer(self, index: int, seed: int, device: Any = None) -> nn.Module:
        """Layer `index`, real (seeded, materialised from meta) or, with device="meta", shapes only.
        The caller's random generator is left where it was."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(layer_seed(seed, index))
            with torch.device("meta") if device == "meta" else nullcontext():
                try:
                    built = self.factories[index]()
                except Exception as exc:  # noqa: BLE001 - the user's factory can raise anything
                    raise ModelError(f"the factory of layer {index} ({_name(self.factories[index])}) raised "
                                     f"{type(exc).__name__}: {exc}", hint="call it yourself to debug it") from exc
            if not isinstance(built, nn.Module):
                raise ModelError(f"the factory of layer {index} returned {type(built).__name__}, not an nn.Module",
                                 hint="each entry of model=[...] is a zero-argument callable returning one layer")
            if device != "meta" and on_meta(built):
                built = materialise(built, layer_seed(seed, index))
        return built

    def build(self, seed: int, layers: Iterable[int] | None = None, device: Any = None,
              lazy: bool = False) -> nn.Sequential:
        """The nn.Sequential of every layer, or only of `layers` (the others nn.Identity: a rank
        never builds what it does not train). `lazy`: every layer on the meta device, made real one
        at a time by whoever trains them (LazyLayers.realise)."""
        if lazy:
            return LazyLayers(self, seed)
        wanted = set(range(len(self))) if layers is None else set(layers)
        return nn.Sequential(*(self.layer(i, seed, device) if i in wanted else nn.Identity()
                               for i in range(len(self))))


class LazyLayers(nn.Sequential):
    """Layers on the meta device until `realise(i)` builds layer i for real in its place: a strategy
    that keeps a slice of every layer (sharded data parallel) builds, slices and frees one layer at
    a time, so no rank ever holds the whole model."""

    def __init__(self, factories: LayerFactories, seed: int) -> None:
        super().__init__(*(factories.layer(i, seed, "meta") for i in range(len(factories))))
        self._factories, self._seed = factories, seed

    def realise(self, index: int) -> nn.Module:
        self[index] = self._factories.layer(index, self._seed)
        return self[index]


def layer_seed(seed: int, index: int) -> int:
    return (int(seed) * 0x9E3779B1 + int(index) * 0x85EBCA77 + 1) % (1 << 63)


def on_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))


def materialise(module: nn.Module, seed: int, device: Any = "cpu") -> nn.Module:
    """A meta module made real: storage from to_empty, values from the reset method of each module
    that owns tensors directly, children before their parent (as an eager build initialises them:
    nn.MultiheadAttention's own reset then overrides its out_proj's bias, as in its __init__),
    under `seed`."""
    module = module.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        _reset(module)
    return module


def _reset(module: nn.Module) -> None:
    for child in module.children():
        _reset(child)
    if not any(True for _ in module.parameters(recurse=False)) and not any(True for _ in module.buffers(recurse=False)):
        return
    reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
    if reset is not None:
        reset()
    elif hasattr(module, "reset_running_stats"):
        module.reset_running_stats()
    else:
        raise ModelError(f"{type(module).__name__} was built on the meta device but has no reset_parameters(): its "
                         "parameters and buffers would keep whatever memory to_empty gave them",
                         hint="give it a reset_parameters() that initialises its own tensors, or build that layer "
                              "eagerly (not under torch.device('meta'))")


def real_layers(model: nn.Sequential) -> Iterable[nn.Module]:
    """The layers of a (possibly meta) Sequential, each real only while the caller uses it: what
    the driver's probe and profile iterate, so that its peak is one layer."""
    for layer in model:
        yield materialise(_copy(layer), 0) if on_meta(layer) else layer


def _copy(layer: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(layer)


def _name(factory: Callable[..., Any]) -> str:
    return getattr(factory, "__name__", type(factory).__name__)


__all__: Sequence[str] = ("LayerFactories", "LazyLayers", "layer_seed", "materialise", "on_meta", "real_layers")
