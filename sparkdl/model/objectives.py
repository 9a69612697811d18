"""Turn the model, loss and optimizer options into torch objects (on workers and the driver)."""
from __future__ import annotations

import copy
from typing import Any, Callable, Iterable

import torch
from torch import nn

from sparkdl.config import TrainConfig
from sparkdl.errors import ModelError
from sparkdl.model.calling import ModelLoss
from sparkdl.model.losses import BuiltinLoss

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def as_module(model: Any) -> Any:
    """A list or tuple of stage modules becomes the nn.Sequential of them (one layer per stage)."""
    if isinstance(model, (list, tuple)) and model and all(isinstance(m, nn.Module) for m in model):
        return nn.Sequential(*model)
    return model


def build_model(model: Any, seed: int, layers: Iterable[int] | None = None, lazy: bool = False) -> nn.Module:
    """A fresh module: a copy of the given instance (a list of stage modules becomes their
    nn.Sequential), the factory's result under the run seed, or (a list of layer factories,
    model/layer_factories.py) the Sequential of only the `layers` this rank trains (None: all), or with
    `lazy` of meta layers the strategy makes real one at a time."""
    from sparkdl.model.layer_factories import LayerFactories

    factories = LayerFactories.of(model)
    if factories is not None:
        return factories.build(seed, layers, lazy=lazy)
    model = as_module(model)
    if isinstance(model, nn.Module):
        return copy.deepcopy(model)
    if callable(model):
        torch.manual_seed(seed)
        try:
            built = model()
        except Exception as exc:  # noqa: BLE001 - the user's factory can raise anything
            raise ModelError(f"the model factory {getattr(model, '__name__', model)!r} raised "
                             f"{type(exc).__name__}: {exc}", hint="call it yourself to debug it") from exc
        built = as_module(built)
        if not isinstance(built, nn.Module):
            raise ModelError(f"model factory returned {type(built).__name__}, not a torch.nn.Module",
                             hint="pass an nn.Module, or a zero-argument callable returning one")
        return built
    raise ModelError(f"model must be a torch.nn.Module, a list of stage modules, a zero-argument callable or a list "
                     "of one zero-argument callable per layer, "
                     f"got {type(model).__name__}",
                     hint="for example model=nn.Sequential(nn.Linear(64, 10))")


def enable_activation_checkpointing(module: nn.Module) -> None:
    """train.activation_checkpointing: the model recomputes its blocks' activations in backward
    (Hugging Face models and PEFT wrappers of them: their own gradient checkpointing, non-reentrant,
    so frozen inputs (an adapter's base) still get gradients through)."""
    enable = getattr(module, "activation_checkpointing_enable", None)  # transformers >= 5.2's name
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return
    enable = getattr(module, "gradient_checkpointing_enable", None)
    if enable is None or not getattr(module, "supports_gradient_checkpointing", True):
        raise ModelError(f"train.activation_checkpointing needs a model that can recompute its activations; "
                         f"{type(module).__name__} has no gradient_checkpointing_enable()",
                         hint="use a Hugging Face transformers model (or a PEFT model of one), or wrap your blocks "
                              "in torch.utils.checkpoint.checkpoint yourself")
    enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def import_factory(path: str) -> Callable[[], nn.Module]:
    """The callable named by "package.module:function" (model.factory in TOML configs)."""
    return import_callable(path, "model.factory", ModelError,
                           "the module must be importable on the driver and the executors (installed, or shipped "
                           "with --py-files)")


def import_callable(path: str, option: str, error: type[Exception], hint: str) -> Callable[..., Any]:
    """The callable a "package.module:function" option names, or `error` naming the option."""
    import importlib

    module_name, _, attribute = str(path).partition(":")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise error(f"{option} {path!r} cannot be imported: {exc}", hint=hint) from None  # type: ignore[call-arg]
    if not callable(target):
        raise error(f"{option} {path!r} is not callable")
    return target


LOSSES: dict[str, LossFn] = {name: BuiltinLoss(name) for name in ("cross_entropy", "mse", "bce_with_logits",
                                                                   "causal_lm")}


def loss_function(train: TrainConfig) -> LossFn:
    if train.loss == "model":
        return ModelLoss()
    return train.loss if callable(train.loss) else LOSSES[train.loss]


def build_optimizer(train: TrainConfig, params: Any) -> torch.optim.Optimizer:
    params = list(params)
    if callable(train.optimizer):
        optimizer = train.optimizer(params)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ModelError(f"optimizer callable returned {type(optimizer).__name__}, not a torch.optim.Optimizer",
                             hint="pass e.g. optimizer=lambda p: torch.optim.SGD(p, lr=0.1)")
        return optimizer
    if train.optimizer == "sgd":
        return torch.optim.SGD(params, lr=train.lr, momentum=train.momentum, weight_decay=train.weight_decay)
    if train.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=train.lr, weight_decay=train.weight_decay)
    return torch.optim.Adam(params, lr=train.lr, weight_decay=train.weight_decay)
