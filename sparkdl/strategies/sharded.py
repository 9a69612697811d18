"""Sharded data parallel (ZeRO stage 3, Rajbhandari et al. 2020): every rank keeps 1/W of each
top-level layer's parameters, of their gradients and of the optimizer state; a layer's full
parameters exist only while it computes.

One step, on each rank's own batch (as data parallel):
- forward, layer by layer, without autograd: all-gather the layer's parameters, run it, free them,
  keep the layer's input (and the RNG state it ran under);
- the last layer runs with autograd: gather, loss, backward, reduce-scatter its gradients into this
  rank's shard (the average over ranks, as data parallel's allreduce), free;
- back through the earlier layers: gather, run again from the kept input under the same RNG state
  (dropout draws the same mask; BatchNorm's running statistics are put back, so they move once),
  backward with the gradient the next layer sent, reduce-scatter, free;
- the optimizer steps on the shards (element-wise optimizers give data parallel's update exactly;
  gradient clipping uses the whole model's norm).
Each layer's parameters cross the network three times per step (two all-gathers and the
reduction) and every layer but the last runs its forward twice. torch's FSDP2 (`fully_shard`) is
not used: it talks to torch.distributed directly, so it would bypass the Communicator (Horovod,
byte counts, the emulated network). NCCL's reduce-scatter and all-gather are used as they are; on
gloo, whose two collectives keep copies of the buffer resident, TorchDistCommunicator reduces with
an in-place allreduce and gathers with one broadcast per rank (2x data parallel's bytes in all).

The model is cut into layers by `model_layers`: an nn.Sequential's children; a Hugging Face
transformer of a known family (GPT-2, Llama-style, BERT-style: model/transformer_layers.py) at its
blocks, embeddings first and final norm + head last, so a rank holds one block whole at a time;
any other module is one layer (its state is still sharded, its parameters are gathered whole for
the step), as is a transformer whose loss it computes itself (loss="model": its forward must run
whole; loss="causal_lm" is the same loss, taken on the cut's logits). Layers may
share parameters (tied weights: the output layer reusing the token embedding): such a parameter
has one shard, which every layer using it gathers, and its gradient is the sum of every use's
(layer_shards.py). The trained model is returned in pieces: each rank returns the whole parameters
it owns (about 1/W of them) under the model's first name for each, the driver merges them by name
and ties the other names back (model/trained.py).
"""
from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from sparkdl.comm.base import ALLGATHER, ALLREDUCE, BROADCAST
from sparkdl.errors import ModelError
from sparkdl.model.calling import ModelLoss
from sparkdl.model.layer_factories import LazyLayers
from sparkdl.strategies.base import LossFn, OptimizerFactory
from sparkdl.strategies.data_parallel import DataParallel, broadcast_module
from sparkdl.strategies.inputs import call_model, loss_and_weight_sum
from sparkdl.strategies.layer_shards import Layer, LayerShard, Scratch, build_layers, own_layer
from sparkdl.strategies.stepping import SINGLE, Accumulation, float_output


class _Gathering(nn.Module):
    """The sharded model as one module for validation and inference: each layer's parameters are
    gathered for its forward only."""

    def __init__(self, layers: list[Layer]) -> None:
        super().__init__()
        self.layers = layers
        self.children_ = nn.ModuleList([layer.module for layer in layers])  # train()/eval() reach them

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        x: Any = kwargs if kwargs else (args[0] if len(args) == 1 else args)
        for index, layer in enumerate(self.layers):
            layer.gather()
            try:
                x = _apply(layer.module, x, index, len(self.layers))
            finally:
                layer.release()
        return x


class Sharded(DataParallel):
    name = "sharded"
    requires = frozenset({ALLREDUCE, ALLGATHER, BROADCAST})
    builds_layer_by_layer = True

    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory, loss_fn: LossFn) -> None:
        _return_big_blocks_at_once()
        lazy = isinstance(model, LazyLayers)
        if not lazy:
            model = model.to(self.comm.device)
            broadcast_module(self.comm, model)
        self._model = model
        if lazy:  # built one layer at a time; layers from separate factories share nothing
            self._layers, shared = [self._realised(model, i) for i in range(len(model))], []
        else:
            self._layers, shared = build_layers(model_layers(model, loss_fn), self.comm)
        self._units = [layer.own for layer in self._layers] + shared  # every shard, in the optimizer's order
        self._names = {id(p): name for name, p in model.named_parameters()}  # a tied one: its first name
        scratch = Scratch(max((layer.own.full_size for layer in self._layers), default=0), self.comm.device)
        for layer in self._layers:
            layer.own.scratch = scratch
        self._owners = _owners([p for unit in self._units for p in unit.params], self.comm.size)
        self._params = [unit.shard for unit in self._units]
        self._optimizer = make_optimizer(self._params)
        for group in self._optimizer.param_groups:
            if group.get("foreach") is None and "foreach" in group:
                # torch's multi-tensor step holds temporaries the size of every shard at once (Adam:
                # ~3x); one shard at a time holds a layer's worth, and there are only a few shards.
                group["foreach"] = False
        self.steps.attach(self._optimizer)
        self._loss_fn = loss_fn
        self._diloco, self._backend_averages, self._uneven = False, False, False
        # Weighted objectives and accumulation windows reduce their weight totals over every rank
        # (the gradients' reduce-scatter carries no extra value).
        self._step_comm, self._step_weight, self._comm_wait_s = self.comm, None, 0.0
        self._grad_bytes = sum(unit.numel * 4 for unit in self._units)
        self._gathering = _Gathering(self._layers)

    def _realised(self, model: LazyLayers, index: int) -> Layer:
        """Layer `index` built from its factory and sharded at once, its full parameters freed, so
        the rank's peak is one layer on top of its shards."""
        module = model.realise(index).to(self.comm.device)
        broadcast_module(self.comm, module)  # factories are seeded alike; a non-deterministic one is not
        return own_layer(module, self.comm)

    def train_step(self, inputs: Any, labels: torch.Tensor, weights: torch.Tensor | None = None,
                   micro: Accumulation = SINGLE) -> torch.Tensor:
        started = time.perf_counter()
        self._model.train()
        if micro.index == 0:
            self._optimizer.zero_grad()
        *earlier, last = self._layers
        kept: list[tuple[Any, Any]] = []
        x = inputs
        with torch.no_grad():
            for index, layer in enumerate(earlier):
                kept.append((x, _rng_state(self.comm.device)))
                layer.gather()
                with self.steps.autocast():  # an in-place layer runs on a copy: the kept input stays as it was
                    x = _apply(layer.module, _copy_if(layer.in_place, x), index, len(self._layers))
                layer.release()
        x = _requiring_grad(x) if earlier else x
        last.gather(with_gradients=True)
        with self.steps.autocast():
            output = _apply(last.module, _copy_if(last.in_place, x), len(earlier), len(self._layers))
        loss, numerator, denominator = loss_and_weight_sum(self._loss_fn, float_output(output), labels, weights)
        if numerator is not None and micro.count > 1:
            self.steps.backward(numerator)  # the window's weight total divides at its end (_normalise_window)
            self._window_weight = denominator.detach() + (self._window_weight if micro.index else 0.0)
        else:
            self.steps.backward(self._objective(loss, numerator, denominator), micro)
        last.scatter_gradients()
        last.release()
        self._backward_earlier(earlier, kept, _grads_of(x) if earlier else [])
        self.slow_down(started)
        if micro.last:
            if numerator is not None and micro.count > 1:
                self._normalise_window()
            self.steps.step(self._optimizer, self._params, sum_over_ranks=self._sum_over_ranks)
        return loss.detach()

    def _backward_earlier(self, earlier: list[Layer], kept: list[tuple[Any, Any]],
                          gradients: list[torch.Tensor | None]) -> None:
        for index in range(len(earlier) - 1, -1, -1):
            layer, (x, rng) = earlier[index], kept[index]
            layer.gather(with_gradients=True)
            x = _requiring_grad(x) if index else x  # the model's own inputs need no gradient
            buffers = [b.detach().clone() for b in layer.module.buffers()]
            with torch.random.fork_rng(devices=_cuda_devices(self.comm.device)):
                _set_rng_state(rng, self.comm.device)
                with self.steps.autocast():
                    y = _apply(layer.module, _copy_if(layer.in_place, x), index, len(self._layers))
            with torch.no_grad():
                for buffer, value in zip(layer.module.buffers(), buffers):
                    buffer.copy_(value)  # the first forward already moved the running statistics
            pairs = [(out, grad.to(out.dtype)) for out, grad in zip(_tensors(y), gradients)
                     if grad is not None and out.requires_grad]
            if pairs:
                torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
            gradients = _grads_of(x) if index else []
            layer.scatter_gradients()
            layer.release()

    def evaluate(self, batches: Any, loss_fn: LossFn, classification: bool, metrics: Any = None) -> torch.Tensor:
        """Every layer's gather is a collective, so every rank runs as many validation batches as
        the rank with the most: one with fewer (or none) joins the others' gathers without rows."""
        mine = list(batches)  # validation rows are few by design
        rounds = max(int(n) for n in self.comm.allgather_object(len(mine)))
        sums = super().evaluate(iter(mine), loss_fn, classification, metrics)
        for _ in range(rounds - len(mine)):
            for layer in self._layers:
                layer.gather()
                layer.release()
        return sums

    def _sum_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        return self.comm.allreduce(value, op="sum") if self.comm.size > 1 else value

    # -- what is saved, validated and returned ---------------------------------------------------
    @property
    def replicated_state(self) -> bool:  # type: ignore[override]
        return False  # every rank saves its own shard

    def module(self) -> nn.Module:
        return self._gathering

    def epoch_metrics(self) -> dict[str, float]:
        shards = sum(unit.shard.numel() * unit.shard.element_size() for unit in self._units)
        frozen = sum(p.numel() * p.element_size() for p in self._model.parameters() if not p.requires_grad)
        return {"param_bytes": float(shards + frozen)}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's shards and the (replicated) buffers: what a checkpoint or a snapshot keeps."""
        state = {f"shard.{i}": unit.shard.detach().cpu().clone() for i, unit in enumerate(self._units)}
        state.update({f"buffer.{name}": b.detach().cpu().clone() for name, b in self._model.named_buffers()})
        return state

    def restore(self, snapshot: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for i, unit in enumerate(self._units):
                unit.shard.copy_(snapshot[f"shard.{i}"])
            for name, buffer in self._model.named_buffers():
                buffer.copy_(snapshot[f"buffer.{name}"])

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        if state.get("gathered_from"):  # written by another world size (executor/reshape.py)
            state = self._my_slices(state)
        self.restore(state["module"])
        if "optimizer" in state:
            self._optimizer.load_state_dict(state["optimizer"])
        self.steps.load_state_dict(state.get("steps", {}))

    def _my_slices(self, state: dict[str, Any]) -> dict[str, Any]:
        """This rank's shards out of every old rank's shards laid end to end (each layer's flat
        parameters, then the old world's zero padding): the same cut as LayerShard's for this world.
        Per-shard optimizer tensors (Adam's moments) are cut alike; scalars (its step) kept."""
        def mine(full: torch.Tensor, layer: LayerShard) -> torch.Tensor:
            flat = torch.zeros(layer.full_size, dtype=full.dtype)
            kept = min(layer.numel, full.numel())
            flat[:kept] = full.reshape(-1)[:kept]
            start = self.comm.rank * layer.shard_size
            return flat[start: start + layer.shard_size].clone()

        module = dict(state["module"])
        for i, unit in enumerate(self._units):
            module[f"shard.{i}"] = mine(module[f"shard.{i}"], unit)
        out = {**state, "module": module}
        if "optimizer" in state:
            optimizer = {**state["optimizer"], "state": {}}
            for index, values in state["optimizer"]["state"].items():
                unit = self._units[int(index)]
                optimizer["state"][index] = {name: mine(value, unit) if torch.is_tensor(value) and value.dim() >= 1
                                             else value for name, value in values.items()}
            out["optimizer"] = optimizer
        return out

    def result_state(self) -> dict[str, torch.Tensor] | None:
        """The whole parameters this rank owns (and, on rank 0, the buffers): every rank gathers
        one layer at a time and keeps its own; the driver merges the pieces by name."""
        mine: dict[str, torch.Tensor] = {}
        for unit in self._units:
            unit.gather()
            for param in unit.params:
                if self._owners[id(param)] == self.comm.rank:
                    mine[self._names[id(param)]] = param.detach().cpu().clone()
            unit.release()
        if self.comm.rank == 0:  # frozen parameters stay: the driver's copy has them (model/trained_state.py)
            kept = set(self._model.state_dict())  # persistent buffers only: what the model loads back
            mine.update({name: b.detach().cpu() for name, b in self._model.named_buffers() if name in kept})
        return mine


def _return_big_blocks_at_once() -> None:
    """Blocks of 1 MiB and more straight from mmap and back to the kernel when freed. glibc raises
    its mmap threshold to the largest block freed so far (up to 32 MiB), after which every layer's
    gradients and temporaries come from the heap and stay resident once freed: a 29M-parameter
    model on 4 ranks then held 260-300 MB per rank instead of the 160 MB its shards, Adam moments
    and buffers take (measured). Process-wide, and kept for the Python worker's later tasks."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD; setting it fixes it
    except (OSError, AttributeError):
        pass  # not glibc


def model_layers(model: nn.Module, loss_fn: Any = None) -> list[nn.Module]:
    """The layers sharded data parallel cuts `model` into, in the order its forward runs them, each
    holding the model's own parameters (a parameter two layers hold is tied): the module
    docstring's rule."""
    if isinstance(model, nn.Sequential):
        return list(model) if len(model) else [model]
    if isinstance(loss_fn, ModelLoss):
        return [model]
    from sparkdl.model.transformer_layers import check_cut, transformer_layers

    cut = transformer_layers(model)
    if cut is None:
        return [model]
    # A family variant the cut does not reproduce (an embedding scale, a logit cap) is refused
    # rather than trained as another model: one forward of a few tokens, while the model is whole.
    vocabulary = int(getattr(getattr(model, "config", None), "vocab_size", 2) or 2)
    tokens = (torch.arange(1, 9) * 7919 % vocabulary).unsqueeze(0).to(next(model.parameters()).device)
    check_cut(model, cut, tokens)
    return list(cut.layers)


def _apply(module: nn.Module, x: Any, index: int, count: int) -> Any:
    """Layer `index` of `count` on its input, as nn.Sequential runs them: the first takes the
    model's inputs (several, or by keyword: call_model's rule), the others what the layer before
    returned, as one argument; what a layer before the last returns must be a tensor, or a tuple or
    dict of tensors (gradients flow back through the float ones)."""
    y = call_model(module, x) if index == 0 else module(x)
    if index < count - 1 and not _passable(y):
        raise ModelError(f"strategy='sharded' runs the model one layer at a time, but layer {index} "
                         f"({type(module).__name__}) returns {type(y).__name__}, not a tensor or a tuple or dict of "
                         "tensors", hint="make every layer but the last return tensors, or wrap the layers that "
                                         "pass other values into one module")
    return y


def _passable(y: Any) -> bool:
    if isinstance(y, torch.Tensor):
        return True
    values = y.values() if isinstance(y, dict) else y if isinstance(y, (tuple, list)) else None
    return values is not None and all(v is None or isinstance(v, torch.Tensor) for v in values)


def _map(fn: Any, x: Any) -> Any:
    """`fn` on every tensor of a layer's input or output (a tensor, tuple or dict of them)."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, dict):
        return type(x)(**{k: _map(fn, v) for k, v in x.items()})
    if isinstance(x, (tuple, list)):
        return tuple(_map(fn, v) for v in x)
    return x


def _tensors(x: Any) -> list[torch.Tensor]:
    """The tensors of a layer's input or output, in order (the same order on both sides of a cut)."""
    if isinstance(x, torch.Tensor):
        return [x]
    values = x.values() if isinstance(x, dict) else x if isinstance(x, (tuple, list)) else ()
    return [t for v in values for t in _tensors(v)]


def _copy_if(needed: bool, x: Any) -> Any:
    """`x` copied for a layer that writes into its input (inplace=True), so that what it was handed
    stays as it was (the kept input, the leaf whose gradient the layer before continues from)."""
    return _map(torch.clone, x) if needed else x


def _requiring_grad(x: Any) -> Any:
    """A layer's input cut from the graph, floats requiring grad (the gradient the layer before
    it continues from)."""
    return _map(lambda t: t.detach().requires_grad_(t.is_floating_point()), x)


def _grads_of(x: Any) -> list[torch.Tensor | None]:
    """The gradients a layer's input received, tensor by tensor (None where none flowed)."""
    return [t.grad for t in _tensors(x)]


def _cuda_devices(device: torch.device) -> list[int]:
    return [device.index or 0] if device.type == "cuda" else []


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What dropout draws from: the CPU generator and, training on a GPU, that GPU's."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _owners(params: list[nn.Parameter], ranks: int) -> dict[int, int]:
    """Which rank returns each parameter whole: the largest first, each to the least loaded rank."""
    load = [0] * ranks
    owners: dict[int, int] = {}
    for param in sorted(params, key=lambda p: -p.numel()):
        rank = min(range(ranks), key=lambda r: load[r])
        owners[id(param)] = rank
        load[rank] += param.numel()
    return owners


__all__ = ["Sharded"]
