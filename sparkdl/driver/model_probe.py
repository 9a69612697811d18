"""The model on the driver before any job: its driver-side copy (meta for layer factories, a
pretrained path's skeleton), one zero batch or a few real sample rows through it and the loss, and
the options that need the built model (activation checkpointing). Each problem raises a ModelError
naming the columns and the fix.
"""
from __future__ import annotations

from typing import Any, Callable

from sparkdl.config import DataConfig, TrainConfig
from sparkdl.errors import ModelError


def driver_copy(model: Any, seed: int) -> tuple[Any, Callable[[Any], Any]]:
    """(the driver's copy of the model, a no-grad forward for probing it). A list of layer
    factories is kept on the meta device (shapes only: the driver never holds the whole model
    before it is returned) and probed one real layer at a time, each freed before the next."""
    import torch

    from sparkdl.model.objectives import build_model
    from sparkdl.model.layer_factories import LayerFactories
    from sparkdl.strategies.inputs import call_model

    factories = LayerFactories.of(model)
    if factories is None:
        from sparkdl.model.pretrained import driver_model

        module = build_model(driver_model(model), seed)
        module.eval()

        def whole(inputs: Any) -> Any:
            with torch.no_grad():
                return call_model(module, inputs)

        return module, whole

    def by_layer(inputs: Any) -> Any:
        x = inputs
        with torch.no_grad():
            for index in range(len(factories)):  # as nn.Sequential runs them: the first takes the inputs
                layer = factories.layer(index, seed).eval()
                x = call_model(layer, x) if index == 0 else layer(x)
                del layer
        return x

    return factories.build(seed, device="meta"), by_layer


def probe_model(model: Any, data: DataConfig, train: TrainConfig, num_features: int) -> tuple[Any, int]:
    """Build the model on the driver and run one zero batch through it, so a wrong model or input
    width fails here in seconds instead of on every executor."""
    import torch

    module, forward = driver_copy(model, train.seed)
    try:
        from sparkdl.model.calling import primary_output

        out = primary_output(forward(torch.zeros(2, num_features)))
    except ModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure here is a model/input mismatch
        raise ModelError(f"the model cannot take a batch of {num_features} features "
                         f"(from feature_cols {list(data.feature_cols)}): {type(exc).__name__}: {exc}",
                         hint="make the first layer's input width match the number of feature values") from None
    if not isinstance(out, torch.Tensor) or out.dim() < 1 or out.shape[0] != 2:
        raise ModelError("the model must return one tensor with the batch as its first dimension",
                         hint="return logits/values of shape (batch, outputs)")
    return module, int(out[0].numel())


def probe_tensor_model(model: Any, data: DataConfig, train: TrainConfig, layout: Any, sample: Any
                       ) -> tuple[Any, int, Any, tuple[int, ...]]:
    """input_cols runs: build the model and run a few real prepared rows through the executors' own
    conversion (and transform_fn) and the model, and the loss on its output: a wrong model, shape,
    dtype or transform fails here, naming the columns. Returns (module, classes or values per row
    the loss sees, the probe batch, the per-row shape of the model's output)."""
    import torch

    from sparkdl.data.assemble import sample_batch
    from sparkdl.model.objectives import loss_function


    batch = sample_batch(sample, layout, data.transform_fn, frozenset(data.input_dtypes or {}))
    inputs, label, weight = batch
    module, forward = driver_copy(model, train.seed)
    described = ", ".join(f"{c.source}: {_shape_text(inputs[c.key] if layout.keyword_inputs else inputs[i])}"
                          for i, c in enumerate(layout.inputs))
    try:
        out = forward(inputs)
    except ModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure here is a model/input mismatch
        how = "forward(**inputs)" if layout.keyword_inputs else "forward(*inputs)"
        raise ModelError(f"the model cannot take a batch of input_cols {list(data.input_cols)} ({described}; "
                         f"called as {how}): {type(exc).__name__}: {exc}",
                         hint="match the model's forward() to the input columns, their input_shapes and "
                              "input_dtypes") from None
    from sparkdl.model.calling import primary_output

    raw, out = out, primary_output(out)
    rows = int(label.shape[0]) if label is not None else None
    if not isinstance(out, torch.Tensor) or out.dim() < 1 or (rows is not None and out.shape[0] != rows):
        raise ModelError("the model must return a tensor with the batch as its first dimension (or a Hugging Face "
                         f"ModelOutput, dict or tuple holding one), got {_output_text(raw)}",
                         hint="return logits/values of shape (batch, outputs) or (batch, positions, classes)")
    per_position = label is not None and out.dim() == label.dim() + 1 and out.dim() > 2
    if per_position and train.loss in ("cross_entropy", "causal_lm") and tuple(out.shape[:-1]) != tuple(label.shape):
        raise ModelError(f"the model returns {_shape_text(out)} for per-position labels {_shape_text(label)}: "
                         "cross_entropy here takes the class dimension last", hint="return (batch, positions, "
                                                                                   "classes), e.g. logits.transpose(1, -1)")
    width = int(out.shape[-1]) if per_position else int(out[0].numel())
    beyond = train.loss in ("cross_entropy", "causal_lm") and label is not None and label.numel() and int(label.max()) >= width
    if label is not None and not beyond:  # classes beyond the outputs: check_output_width says so better
        check_loss_on_sample(data, train, raw, label, weight, loss_function(train))
    return module, width, batch, tuple(out.shape[1:])


def _output_text(output: Any) -> str:
    import torch

    if isinstance(output, torch.Tensor):
        return _shape_text(output)
    if isinstance(output, dict):
        return f"{type(output).__name__} with keys {sorted(output)}"
    return type(output).__name__


def _shape_text(tensor: Any) -> str:
    return f"{str(tensor.dtype).replace('torch.', '')} {list(tensor.shape)}"


def check_loss_on_sample(data: DataConfig, train: TrainConfig, out: Any, label: Any, weight: Any,
                          loss_fn: Any) -> None:
    from sparkdl.strategies.inputs import loss_and_weight_sum

    loss = train.loss
    try:
        loss_and_weight_sum(loss_fn, out, label, weight)
    except ModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - the loss cannot compare these shapes
        name = loss if isinstance(loss, str) else getattr(loss, "__name__", "the loss")
        raise ModelError(f"loss {name!r} cannot compare the model's output ({_output_text(out)}) with label column "
                         f"{data.label_col!r} ({_shape_text(label)}): {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''}",
                         hint="cross_entropy takes (B, C) logits with (B,) labels or (B, T, C) with (B, T); mse "
                              "takes outputs shaped like the labels") from None


def check_activation_checkpointing(train: TrainConfig, module: Any) -> None:
    """train.activation_checkpointing on a model that cannot recompute its activations fails here
    (enabling it on the driver's copy is the check)."""
    if train.activation_checkpointing and module is not None and not is_meta(module):
        from sparkdl.model.objectives import enable_activation_checkpointing

        enable_activation_checkpointing(module)


def is_meta(module: Any) -> bool:
    return any(p.is_meta for p in module.parameters())
