"""Independent subnet training (IST; Yuan et al., PVLDB 2022) for nn.Sequential MLPs.

Every round of R local steps, the hidden neurons of each hidden layer are shuffled and dealt into W
disjoint groups, one per rank, from the run seed and the round number alone (no index traffic). Rank
w trains the subnet of its neurons: the first layer's rows, the diagonal hidden->hidden blocks, the
last layer's columns and the BatchNorm entries of its neurons, for R steps on its own rows without
communicating. At the round's end the disjoint blocks are written back into every rank's copy of the
full model (one allgather of the subnets: partitioned topology, no parameter server) and the tensors
every subnet shares (the output layer's bias) are averaged. Blocks off the diagonal are not trained
in that round and stay as they are.

Train narrow / test wide: a subnet's layer sums over 1/W of the previous layer's neurons, the full
model over all of them. `ist_scale="scale"` multiplies the hidden activations by W while training
(inverted-dropout scaling); `"batchnorm"` uses batch statistics in every BatchNorm1d, training and
test, as the paper does (every hidden layer then needs a BatchNorm1d).
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

from sparkdl.comm.base import ALLGATHER, ALLREDUCE, BROADCAST, Communicator
from sparkdl.errors import ModelError
from sparkdl.model.layouts import IstLayout
from sparkdl.model.trained_state import load_trained_state
from sparkdl.strategies.base import LossFn, OptimizerFactory, Strategy
from sparkdl.strategies.data_parallel import broadcast_module
from sparkdl.strategies.stepping import SINGLE, Accumulation, float_output

ELEMENTWISE = (nn.ReLU, nn.LeakyReLU, nn.Tanh, nn.Sigmoid, nn.GELU, nn.SiLU, nn.ELU, nn.Softplus, nn.Identity,
               nn.Mish, nn.Hardtanh, nn.ReLU6, nn.SELU, nn.CELU, nn.Dropout)
MIN_NEURONS_PER_RANK = 256


def ist_layout(model: nn.Module, world: int, sync_every: int, scale: str, seed: int) -> IstLayout:
    """Check the model is an MLP IST can partition; ModelError names the layer and why."""
    if not isinstance(model, nn.Sequential):
        raise ModelError(f"strategy='ist' partitions the hidden neurons of an nn.Sequential MLP, but the model is a "
                         f"{type(model).__name__}", hint="build it as nn.Sequential(nn.Linear, nn.ReLU, ..., nn.Linear)")
    linears: list[int] = []
    norms: list[tuple[int, int]] = []
    for index, layer in enumerate(model):
        if isinstance(layer, nn.Linear):
            linears.append(index)
        elif isinstance(layer, nn.BatchNorm1d):
            if not linears:
                raise ModelError(f"layer {index} (BatchNorm1d) comes before any Linear layer: IST partitions only "
                                 "hidden neurons", hint="normalise inputs before training instead")
            norms.append((index, len(linears) - 1))
        elif isinstance(layer, ELEMENTWISE) and not list(layer.parameters()):
            continue
        else:
            raise ModelError(f"layer {index} ({type(layer).__name__}) cannot be partitioned by IST, which takes MLPs "
                             "of Linear, element-wise activations, BatchNorm1d and Dropout",
                             hint="use strategy='data_parallel' or 'hybrid' for this model")
    if len(linears) < 2:
        raise ModelError("strategy='ist' needs at least one hidden layer (two Linear layers); the model has "
                         f"{len(linears)}", hint="use strategy='data_parallel' for a linear model")
    last = len(linears) - 1
    for index, hidden in norms:
        if hidden == last:
            raise ModelError(f"layer {index} (BatchNorm1d) normalises the output layer's values, which every subnet "
                             "shares: IST partitions hidden neurons only", hint="remove it or move it before the last Linear")
        if model[index].num_features != model[linears[hidden]].out_features:
            raise ModelError(f"layer {index} (BatchNorm1d) has {model[index].num_features} features but follows a "
                             f"Linear with {model[linears[hidden]].out_features} outputs")
    if scale == "batchnorm":
        missing = sorted(set(range(last)) - {h for _, h in norms})
        if missing:
            raise ModelError(f"ist_scale='batchnorm' needs a BatchNorm1d after every hidden Linear; hidden layer(s) "
                             f"{missing} (Sequential index {[linears[h] for h in missing]}) have none",
                             hint="add them, or use ist_scale='scale'")
    widths = tuple(model[i].out_features for i in linears[:-1])
    for h, width in enumerate(widths):
        if width < world:
            raise ModelError(f"hidden layer {h} (Sequential index {linears[h]}) has {width} neurons, fewer than the "
                             f"{world} workers to deal them to", hint="use fewer workers or a wider layer")
    return IstLayout(linears=tuple(linears), norms=tuple(norms), widths=widths, world=world,
                     sync_every=sync_every, scale=scale, seed=seed)


def narrow_layers(layout: IstLayout) -> list[str]:
    """Hidden layers narrower than MIN_NEURONS_PER_RANK x W (the IST/GIST papers lose accuracy there)."""
    return [f"hidden layer {h} ({w} neurons)" for h, w in enumerate(layout.widths)
            if w < MIN_NEURONS_PER_RANK * layout.world]


def use_batch_statistics(model: nn.Module) -> None:
    """BatchNorm1d normalises with the batch's own statistics in training and evaluation alike."""
    for layer in model.modules():
        if isinstance(layer, nn.BatchNorm1d):
            layer.track_running_stats = False
            layer.running_mean = layer.running_var = layer.num_batches_tracked = None


def partition(layout: IstLayout, round_number: int) -> list[list[torch.Tensor]]:
    """groups[h][w]: the (sorted) neurons of hidden layer h that rank w owns this round; the same on
    every rank, from the seed and round number alone."""
    groups = []
    for h, width in enumerate(layout.widths):
        digest = hashlib.sha256(f"{layout.seed}:{round_number}:{h}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
        order = torch.randperm(width, generator=generator)
        groups.append([chunk.sort().values for chunk in order.tensor_split(layout.world)])
    return groups


class _Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def _rows_cols(layout: IstLayout, groups: list[list[torch.Tensor]], rank: int, t: int
               ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    last = len(layout.linears) - 1
    rows = groups[t][rank] if t < last else None
    cols = groups[t - 1][rank] if t > 0 else None
    return rows, cols


def extract_subnet(model: nn.Sequential, layout: IstLayout, groups: list[list[torch.Tensor]], rank: int) -> nn.Sequential:
    """A new Sequential holding copies of rank's blocks (the full model is not touched)."""
    linear_position = {index: t for t, index in enumerate(layout.linears)}
    norm_hidden = dict(layout.norms)
    layers: list[nn.Module] = []
    with torch.no_grad():
        for index, layer in enumerate(model):
            if index in linear_position:
                t = linear_position[index]
                rows, cols = _rows_cols(layout, groups, rank, t)
                weight = layer.weight
                weight = weight[rows] if rows is not None else weight
                weight = weight[:, cols] if cols is not None else weight
                sub = nn.Linear(weight.shape[1], weight.shape[0], bias=layer.bias is not None,
                                device=weight.device, dtype=weight.dtype)
                sub.weight.copy_(weight)
                if layer.bias is not None:
                    sub.bias.copy_(layer.bias[rows] if rows is not None else layer.bias)
                if t > 0 and layout.scale == "scale":
                    layers.append(_Scale(float(layout.world)))
                layers.append(sub)
            elif index in norm_hidden:
                idx = groups[norm_hidden[index]][rank]
                sub_norm = nn.BatchNorm1d(len(idx), eps=layer.eps, momentum=layer.momentum, affine=layer.affine,
                                          track_running_stats=layer.track_running_stats,
                                          device=idx.device if layer.weight is None else layer.weight.device)
                if layer.affine:
                    sub_norm.weight.copy_(layer.weight[idx])
                    sub_norm.bias.copy_(layer.bias[idx])
                if layer.track_running_stats:
                    sub_norm.running_mean.copy_(layer.running_mean[idx])
                    sub_norm.running_var.copy_(layer.running_var[idx])
                layers.append(sub_norm)
            else:
                layers.append(layer)  # stateless: shared with the full model
    return nn.Sequential(*layers)


def subnet_tensors(subnet: nn.Sequential) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(partitioned tensors in a fixed order, shared tensors: the output layer's bias)."""
    linears = [m for m in subnet if isinstance(m, nn.Linear)]
    own: list[torch.Tensor] = []
    for position, layer in enumerate(linears):
        own.append(layer.weight)
        if layer.bias is not None and position < len(linears) - 1:
            own.append(layer.bias)
    for layer in subnet:
        if isinstance(layer, nn.BatchNorm1d):
            own += [t for t in (layer.weight, layer.bias, layer.running_mean, layer.running_var) if t is not None]
    shared = [linears[-1].bias] if linears[-1].bias is not None else []
    return own, shared


def subnet_shapes(model: nn.Sequential, layout: IstLayout, groups: list[list[torch.Tensor]], rank: int
                  ) -> list[tuple[int, ...]]:
    """Shapes of rank's partitioned tensors, in subnet_tensors order, without building the subnet."""
    last = len(layout.linears) - 1
    shapes: list[tuple[int, ...]] = []
    for t, index in enumerate(layout.linears):
        layer = model[index]
        rows, cols = _rows_cols(layout, groups, rank, t)
        out_rows = len(rows) if rows is not None else layer.out_features
        shapes.append((out_rows, len(cols) if cols is not None else layer.in_features))
        if layer.bias is not None and t < last:
            shapes.append((out_rows,))
    for index, hidden in layout.norms:
        layer = model[index]
        count = len(groups[hidden][rank])
        present = (layer.weight, layer.bias, layer.running_mean, layer.running_var)
        shapes += [(count,) for tensor in present if tensor is not None]
    return shapes


def write_back(model: nn.Sequential, layout: IstLayout, groups: list[list[torch.Tensor]], rank: int,
               tensors: list[torch.Tensor]) -> None:
    """Copy rank's trained blocks (in subnet_tensors order) into the full model."""
    linear_position = {index: t for t, index in enumerate(layout.linears)}
    last = len(layout.linears) - 1
    queue = list(tensors)
    with torch.no_grad():
        for index in layout.linears:
            layer = model[index]
            t = linear_position[index]
            rows, cols = _rows_cols(layout, groups, rank, t)
            block = queue.pop(0)
            row_index = rows if rows is not None else torch.arange(layer.weight.shape[0], device=block.device)
            col_index = cols if cols is not None else torch.arange(layer.weight.shape[1], device=block.device)
            layer.weight[row_index.unsqueeze(1), col_index.unsqueeze(0)] = block
            if layer.bias is not None and t < last:
                layer.bias[rows] = queue.pop(0)
        for index, hidden in layout.norms:
            layer = model[index]
            idx = groups[hidden][rank]
            for tensor in (layer.weight, layer.bias, layer.running_mean, layer.running_var):
                if tensor is not None:
                    tensor[idx] = queue.pop(0)


class Ist(Strategy):
    name = "ist"
    requires = frozenset({ALLGATHER, ALLREDUCE, BROADCAST})

    layout: IstLayout

    def __init__(self, comm: Communicator, layout: IstLayout | None = None, train: Any = None, **options: Any) -> None:
        super().__init__(comm, layout, train, **options)
        if not isinstance(layout, IstLayout):
            raise TypeError("the ist strategy needs the IstLayout the driver planned")

    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory, loss_fn: LossFn) -> None:
        if self.layout.scale == "batchnorm":
            use_batch_statistics(model)
        self._model = model.to(self.comm.device)
        broadcast_module(self.comm, self._model)
        self._make_optimizer = make_optimizer
        self._loss_fn = loss_fn
        self._round = 0
        self._begin_round()

    def _begin_round(self) -> None:
        self._groups = partition(self.layout, self._round)
        self._subnet = extract_subnet(self._model, self.layout, self._groups, self.comm.rank)
        self._optimizer = self._make_optimizer(self._subnet.parameters())  # fresh state per subnet
        self.steps.attach(self._optimizer)  # the lr schedule runs on across rounds
        self._steps_in_round = 0

    def train_step(self, features: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None,
                   micro: Accumulation = SINGLE) -> torch.Tensor:
        if weights is not None or not isinstance(features, torch.Tensor) or micro.count != 1:
            raise TypeError("IST trains MLPs on one float feature tensor without weights or accumulation")
        self._subnet.train()
        self._optimizer.zero_grad()
        with self.steps.autocast():
            output = self._subnet(features)
        loss = self._loss_fn(float_output(output), labels)
        self.steps.backward(loss)
        self.steps.step(self._optimizer, self._subnet.parameters())
        self._steps_in_round += 1
        if self._steps_in_round == self.layout.sync_every:
            self._synchronise()
            self._round += 1
            self._begin_round()
        return loss.detach()

    def _synchronise(self) -> None:
        """Every rank's blocks into every rank's full model (one allgather), shared tensors averaged."""
        own, shared = subnet_tensors(self._subnet)
        flat = torch.cat([t.detach().reshape(-1) for t in own])
        shapes = [subnet_shapes(self._model, self.layout, self._groups, r) for r in range(self.comm.size)]
        # Ranks may own different neuron counts (widths not divisible by W): pad to the largest subnet.
        longest = max(sum(_numel(shape) for shape in rank_shapes) for rank_shapes in shapes)
        padded = torch.zeros(longest, dtype=flat.dtype, device=flat.device)
        padded[: flat.numel()] = flat
        gathered = self.comm.allgather(padded) if self.comm.size > 1 else [padded]
        for rank, values in enumerate(gathered):
            pieces, offset = [], 0
            for shape in shapes[rank]:
                pieces.append(values[offset: offset + _numel(shape)].view(shape))
                offset += _numel(shape)
            write_back(self._model, self.layout, self._groups, rank, pieces)
        if shared:  # the output layer's bias, trained by every subnet: averaged
            bias = shared[0].detach().clone()
            if self.comm.size > 1:
                self.comm.allreduce(bias, op="avg")
            with torch.no_grad():
                self._model[self.layout.linears[-1]].bias.copy_(bias)

    def checkpoint_state(self) -> dict[str, Any]:
        """The full model as of the round's start, the subnet and its optimizer as of now."""
        return {"module": self.state_dict(), "round": self._round, "steps_in_round": self._steps_in_round,
                "subnet": {k: v.detach().cpu() for k, v in self._subnet.state_dict().items()},
                "optimizer": self._optimizer.state_dict(), "steps": self.steps.state_dict()}

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        load_trained_state(self._model, state["module"])
        self._round = int(state["round"])
        self._begin_round()  # the round's partition and a subnet of the right shapes
        self._subnet.load_state_dict(state["subnet"])
        self._optimizer.load_state_dict(state["optimizer"])
        self.steps.load_state_dict(state.get("steps", {}))
        self._steps_in_round = int(state["steps_in_round"])

    def finish(self) -> None:
        """Write the last, partial round back so the full model holds every step."""
        if self._steps_in_round:
            self._synchronise()
            self._round += 1
            self._begin_round()

    def module(self) -> nn.Module:
        return self._model


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
