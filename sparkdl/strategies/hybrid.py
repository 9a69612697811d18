"""Hybrid: K pipeline stages x D data-parallel replicas (HyPar-Flow; GPipe / 1F1B schedules).

Rank grid: replica d's stage k runs on rank `grid[d][k]`. Rank 0 is the last stage of replica 0, so
the rank that reports metrics is one that computes the loss.

Data placement (no extra shuffle): Spark feeds every rank its own 1/W of the rows, exactly as for
data parallel, and every rank draws one batch of `batch_size` rows per step. A replica's K ranks send
their batch's features to the replica's first stage and its labels to the last stage, both
concatenated in stage order, so the pipeline sees the K batches' rows exactly once, features and
labels still paired. One step therefore consumes the same W x batch_size rows as data parallel, and
the update equals data parallel's on the same rows (up to float rounding): the last stage weights
each micro-batch's mean loss by its share of the replica's rows, and each stage's gradients are
averaged over its D replicas. BatchNorm statistics are per micro-batch, as in GPipe.

Cut: an nn.Sequential between its top-level layers, or a Hugging Face transformer between its blocks
(embeddings first, head last, tied gradients summed between their stages: strategies/pipeline_stages.py).
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
from torch import nn

from sparkdl.comm.base import ALLREDUCE, BROADCAST, SEND_RECV, SUBGROUP, Communicator
from sparkdl.model.layouts import HybridLayout
from sparkdl.model.calling import scored_labels
from sparkdl.strategies.base import LossFn, OptimizerFactory, Strategy, as_triple, evaluation_sums
from sparkdl.strategies.inputs import (InputSpec, call_model, flat_inputs, input_spec, rebuilt_inputs, to_device,
                                       weight_total, weighted_terms)
from sparkdl.strategies.grad_overlap import average_gradients
from sparkdl.strategies.micro_batches import (ActivationMeter, concatenated_inputs, micro_inputs, microbatch_sizes,
                                              torch_dtype)
from sparkdl.strategies.pipeline_stages import TiedGradients, stage_module, stage_step
from sparkdl.strategies.schedules import SCHEDULES
from sparkdl.strategies.stepping import SINGLE, Accumulation, float_output

_TAG_FEATURES, _TAG_LABELS, _TAG_ACTIVATION, _TAG_GRADIENT, _TAG_WEIGHTS, _TAG_SCALE = 1, 2, 3, 4, 5, 6
_EVAL_ROWS = 1024


def _tag(kind: int, index: int = 0) -> int:
    return kind * (1 << 24) + index


class _Receives:
    """Receives of a stage's schedule, posted LOOKAHEAD ops ahead of use: the peer's send then goes
    out as soon as it is issued, instead of waiting for this rank to reach the op (with gloo a send
    completes only once the receive is posted, and a busy CPU delays the hand-over by milliseconds
    per message). A small window keeps 1F1B's memory bound: at most LOOKAHEAD extra buffers."""

    LOOKAHEAD = 2

    def __init__(self, strategy: "Hybrid", ops: list[tuple[str, int]], sizes: list[int]) -> None:
        self._strategy = strategy
        self._ops = ops
        self._sizes = sizes
        self._posted: dict[int, tuple[torch.Tensor, Any]] = {}
        self._next_to_post = 0

    def take(self, position: int) -> torch.Tensor | None:
        while self._next_to_post < min(len(self._ops), position + 1 + self.LOOKAHEAD):
            self._post(self._next_to_post)
            self._next_to_post += 1
        posted = self._posted.pop(position, None)
        if posted is None:
            return None
        buffer, work = posted
        work.wait()
        return buffer

    def _post(self, position: int) -> None:
        kind, index = self._ops[position]
        buffer = self._strategy.incoming_buffer(kind, self._sizes[index])
        if buffer is None:
            return
        strategy = self._strategy
        src = strategy._prev if kind == "F" else strategy._next  # noqa: SLF001 - helper of Hybrid
        tag = _tag(_TAG_ACTIVATION if kind == "F" else _TAG_GRADIENT, index)
        self._posted[position] = (buffer, strategy.comm.irecv(buffer, src, tag))


class Hybrid(Strategy):
    name = "hybrid"
    requires = frozenset({ALLREDUCE, BROADCAST, SEND_RECV, SUBGROUP})
    def peer_groups(self) -> list[list[int]]:  # stages run different layers: a stage's replicas compared
        return [[self.layout.grid[d][k] for d in range(self.layout.replicas)] for k in range(self.layout.stages)]

    layout: HybridLayout

    def __init__(self, comm: Communicator, layout: HybridLayout | None = None, train: Any = None,
                 **options: Any) -> None:
        super().__init__(comm, layout, train, **options)
        if not isinstance(layout, HybridLayout):
            raise TypeError("the hybrid strategy needs the HybridLayout the driver planned")
        self._executors: tuple[str, ...] = ()  # each rank's executor, once place() is told them
        self._take_position(layout)

    def _take_position(self, layout: HybridLayout) -> None:
        self.layout = layout
        self.replica, self.stage = layout.position(self.comm.rank)
        self.last = layout.stages - 1
        ranks = layout.grid[self.replica]
        self._first_rank, self._last_rank = ranks[0], ranks[-1]
        self._prev = ranks[self.stage - 1] if self.stage > 0 else None
        self._next = ranks[self.stage + 1] if self.stage < self.last else None
        self._ops = SCHEDULES[layout.schedule]

    def place(self, executors: Sequence[str]) -> str | None:
        """The grid placed on measured links between these executors (DT-FM); every rank computes
        the same grid from the same inputs."""
        self._executors = tuple(executors)
        placed = self.layout.placed(self._executors)
        if placed is self.layout:
            return None
        self._take_position(placed)
        return (f"sparkdl: hybrid grid placed on measured links: {[list(r) for r in placed.grid]} "
                "(grid[replica][stage] = rank)")

    def epoch_record(self) -> dict[str, Any]:
        record: dict[str, Any] = {"hybrid_grid": [list(ranks) for ranks in self.layout.grid]}
        executors = self._executors
        if len(executors) == self.layout.stages * self.layout.replicas:  # where each stage of each replica ran
            record["hybrid_grid_executors"] = [[executors[r] for r in ranks] for ranks in self.layout.grid]
        return record

    def layers_to_build(self) -> Sequence[int] | None:
        return self.layout.stage_layers(self.stage)

    # -- setup ---------------------------------------------------------------------------------
    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory, loss_fn: LossFn) -> None:
        # A Sequential's layers, or a transformer's embeddings / blocks / head, under the model's own keys.
        self._module, tied = stage_module(model, self.layout, self.stage)
        self._module.to(self.comm.device)
        self._tied = TiedGradients(self.comm, self.layout, self.replica, self.stage, self._module, tied, self.steps)
        groups = [[self.layout.grid[d][k] for d in range(self.layout.replicas)] for k in range(self.layout.stages)]
        self._stage_group = self.comm.split(groups)
        self._params = [p for p in self._module.parameters() if p.requires_grad]
        # Frozen parameters (a LoRA adapter's base model) are built alike on every replica: not sent.
        self._broadcast_from_replica_zero(self._params + list(self._module.buffers()))
        self._optimizer = make_optimizer(self._module.parameters())
        self.steps.attach(self._optimizer)
        self._loss_fn = loss_fn
        self._meter = ActivationMeter(self._module.parameters())

    def _broadcast_from_replica_zero(self, tensors: list[torch.Tensor]) -> None:
        group = self._stage_group
        if group is None or group.size == 1:
            return
        src = group.ranks.index(self.layout.grid[0][self.stage])
        with torch.no_grad():
            for tensor in tensors:
                group.broadcast(tensor.data, src=src)

    # -- one step ------------------------------------------------------------------------------
    def train_step(self, inputs: Any, labels: torch.Tensor, weights: torch.Tensor | None = None,
                   micro: Accumulation = SINGLE) -> torch.Tensor:
        """One pipelined step (a micro-batch of an accumulation window: averaged and stepped on the
        window's last). With weights, each micro-batch's loss is its weighted sum over the weight
        total of all replicas, times D: data parallel's sum(w * l) / sum(w) over the same rows."""
        spec, features = input_spec(inputs), flat_inputs(inputs)
        self._module.train()
        if micro.index == 0:
            self._optimizer.zero_grad()
        gathered, targets, target_weights, keep_alive, pending = self._gather_batch(features, labels, weights)
        sizes = microbatch_sizes(features[0].shape[0] * self.layout.stages, self.layout.microbatches)
        total = sum(sizes)
        input_chunks = None if gathered is None else micro_inputs(gathered, spec, sizes)
        target_chunks = torch.split(targets, sizes) if targets is not None else None
        weight_chunks = torch.split(target_weights, sizes) if target_weights is not None else None
        # Weighted accumulation: sum(w * l) per micro-batch, normalised by the window's total at its end.
        windowed = micro.count > 1 and weights is not None and getattr(self._loss_fn, "counted", None) is not None
        replicas_weight = self._replicas_weight_total(targets, target_weights, reduce=not windowed)
        ops = self._ops(self.stage, self.layout.stages, len(sizes))
        receives = _Receives(self, ops, sizes)
        saved: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        loss = torch.zeros((), device=self.comm.device)
        local_weight = torch.zeros((), device=self.comm.device)
        for position, (kind, i) in enumerate(ops):
            incoming = receives.take(position)
            if kind == "F":
                x = input_chunks[i] if input_chunks is not None else incoming.requires_grad_(True)
                y, nbytes = self._forward(x)
                if self._next is not None:
                    sent = y.detach().to(torch_dtype(self.layout.boundary_dtypes[self.stage]))
                    keep_alive.append(sent)
                    pending.append(self.comm.send(sent, self._next, _tag(_TAG_ACTIVATION, i)))
                else:
                    scale = None if replicas_weight is None else \
                        self.layout.replicas / (1.0 if windowed else replicas_weight)
                    y, term, counted = self._micro_loss(y, target_chunks[i], None if weight_chunks is None
                                                        else weight_chunks[i], sizes[i] / total, scale)
                    loss += term
                    local_weight += counted
                saved[i] = (x, y, nbytes)
                self._meter.add(nbytes)
            else:
                x, y, nbytes = saved.pop(i)
                if self._next is None:
                    self.steps.backward(y, SINGLE if windowed else micro)
                else:
                    self.steps.backward(y, gradient=incoming)
                if self._prev is not None:
                    keep_alive.append(x.grad)
                    pending.append(self.comm.send(x.grad, self._prev, _tag(_TAG_GRADIENT, i)))
                self._meter.add(-nbytes)
        for work in pending:
            work.wait()
        if windowed:
            self._window_weight = local_weight.detach() + (self._window_weight if micro.index else 0.0)
        if micro.last:
            self._end_window(windowed)
        if replicas_weight is not None:
            loss = loss / local_weight.clamp_min(torch.finfo(torch.float32).tiny)
        return loss

    def _micro_loss(self, y: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, share: float,
                    scale: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(what the last stage differentiates, its reported part, counted weight) of one micro-batch:
        the mean loss times its share of the rows (unweighted, or a custom loss weighing by itself),
        or sum(w * l) times `scale` (D over the weight total)."""
        if scale is None:
            extra = {} if weight is None else {"weight": weight}
            objective = self._loss_fn(float_output(y), target, **extra) * share
            return objective, objective.detach(), torch.zeros((), device=y.device)
        numerator, counted = weighted_terms(self._loss_fn, float_output(y), target, weight)
        return numerator * scale, numerator.detach(), counted

    def _end_window(self, windowed: bool) -> None:
        """The optimizer step: with weighted accumulation, first every stage of the replica scales its
        gradients by D / (the window's weight total over all replicas), which only the last stages
        know (one scalar allreduce among them, then one message to each earlier stage)."""
        if windowed:
            factor = torch.zeros(1, dtype=torch.float32, device=self.comm.device)
            ranks = self.layout.grid[self.replica]
            if self.stage == self.last:
                total = self._window_weight.reshape(1).to(torch.float32).clone()
                if self._stage_group is not None and self._stage_group.size > 1:
                    self._stage_group.allreduce(total, op="sum")
                factor[0] = 1.0 / total[0].clamp_min(torch.finfo(torch.float32).tiny)
                for work in [self.comm.send(factor, ranks[k], _tag(_TAG_SCALE)) for k in range(self.last)]:
                    work.wait()
            else:
                self.comm.recv(factor, self._last_rank, _tag(_TAG_SCALE))
            for param in self._params:
                if param.grad is not None:
                    param.grad.mul_(factor[0])
        if self._stage_group is not None and self._stage_group.size > 1:
            average_gradients(self._stage_group, self._params)
        stage_step(self.steps, self._optimizer, self._params, self.comm, self._tied, self.layout.replicas)

    def _replicas_weight_total(self, targets: torch.Tensor | None, weights: torch.Tensor | None,
                               reduce: bool = True) -> torch.Tensor | None:
        """On the last stages: the weight total (over counted label positions) of every replica's
        rows, one scalar allreduce among them (this rank's alone unless `reduce`); None elsewhere,
        without weights, or for a custom loss."""
        if weights is None or targets is None:
            return None
        local = weight_total(self._loss_fn, targets, weights)
        if local is None:
            return None
        total = local.reshape(1).to(torch.float32)
        if reduce and self._stage_group is not None and self._stage_group.size > 1:
            self._stage_group.allreduce(total, op="sum")
        return total[0].clamp_min(torch.finfo(torch.float32).tiny)

    def _forward(self, x: Any) -> tuple[torch.Tensor, int]:
        self._meter.started()
        with torch.autograd.graph.saved_tensors_hooks(self._meter.pack, lambda t: t), self.steps.autocast():
            y = call_model(self._module, x)  # the first stage's first layer takes the model's inputs
        return y, self._meter.current

    def incoming_buffer(self, kind: str, rows: int) -> torch.Tensor | None:
        """Buffer for what op `kind` receives: the previous stage's activation for a forward, the
        next stage's gradient of this stage's output for a backward; None if it receives nothing."""
        if kind == "F" and self._prev is not None:
            boundary = self.stage - 1
        elif kind == "B" and self._next is not None:
            boundary = self.stage
        else:
            return None
        return torch.empty((rows, *self.layout.boundary_shapes[boundary]),
                           dtype=torch_dtype(self.layout.boundary_dtypes[boundary]), device=self.comm.device)

    def _gather_batch(self, features: list[torch.Tensor], labels: torch.Tensor, weights: torch.Tensor | None
                      ) -> tuple[list[torch.Tensor] | None, torch.Tensor | None, torch.Tensor | None,
                                 list[torch.Tensor], list[Any]]:
        """Each input tensor of the replica's K batches on its first stage, labels (and weights) on
        its last, in stage order."""
        keep_alive: list[torch.Tensor] = []
        pending: list[Any] = []
        outgoing = [(tensor, self._first_rank, _tag(_TAG_FEATURES, j), self.stage != 0)
                    for j, tensor in enumerate(features)]
        outgoing += [(labels, self._last_rank, _tag(_TAG_LABELS), self.stage != self.last)]
        if weights is not None:
            outgoing.append((weights, self._last_rank, _tag(_TAG_WEIGHTS), self.stage != self.last))
        for tensor, dst, tag, send in outgoing:
            if send:
                tensor = tensor.contiguous()
                keep_alive.append(tensor)
                pending.append(self.comm.send(tensor, dst, tag))
        ranks = self.layout.grid[self.replica]

        def collect(mine: torch.Tensor, own_stage: int, tag: int) -> torch.Tensor:
            return torch.cat([mine if k == own_stage else self.comm.recv(torch.empty_like(mine), ranks[k], tag)
                              for k in range(self.layout.stages)])

        inputs = [collect(t, 0, _tag(_TAG_FEATURES, j)) for j, t in enumerate(features)] if self.stage == 0 else None
        targets = collect(labels, self.last, _tag(_TAG_LABELS)) if self.stage == self.last else None
        target_weights = collect(weights, self.last, _tag(_TAG_WEIGHTS)) \
            if self.stage == self.last and weights is not None else None
        return inputs, targets, target_weights, keep_alive, pending

    # -- reporting, validation, results -------------------------------------------------------
    def loss_rows(self, rows: int) -> int:
        return rows * self.layout.stages if self.stage == self.last else 0

    def epoch_metrics(self) -> dict[str, float]:
        metrics = super().epoch_metrics()
        metrics["activation_bytes"] = float(self._meter.peak)
        return metrics

    def end_epoch(self) -> None:
        # BatchNorm running statistics: replica 0's copy is the one kept.
        self._broadcast_from_replica_zero(list(self._module.buffers()))

    def evaluate(self, batches: Iterable[tuple[Any, torch.Tensor, torch.Tensor | None]], loss_fn: LossFn,
                 classification: bool, metrics: Any = None) -> torch.Tensor:
        """Each rank's validation rows go through its replica's pipeline (forward only)."""
        device, spec = self.comm.device, self._input_spec()
        parts = [(flat_inputs(to_device(x, device)), y.to(device), None if w is None else w.to(device))
                 for x, y, w in map(as_triple, batches)]
        features = concatenated_inputs([f for f, _, _ in parts], spec, device)
        labels = torch.cat([l for _, l, _ in parts]) if parts else \
            torch.empty((0, *self.layout.label_shape), dtype=torch_dtype(self.layout.label_dtype), device=device)
        weighted = bool(parts) and parts[0][2] is not None
        facts = self.comm.allgather_object((int(features[0].shape[0]), weighted))
        weighted = any(w for _, w in facts)
        weights = torch.cat([w for _, _, w in parts]) if parts and weighted else \
            torch.empty((features[0].shape[0],), dtype=torch.float32, device=device) if weighted else None
        ranks = self.layout.grid[self.replica]
        rows = [int(facts[r][0]) for r in ranks]
        pending: list[Any] = []
        outgoing = [(f.contiguous(), self._first_rank, _tag(_TAG_FEATURES, j), self.stage != 0)
                    for j, f in enumerate(features)]
        outgoing += [(labels.contiguous(), self._last_rank, _tag(_TAG_LABELS), self.stage != self.last)]
        if weights is not None:
            outgoing.append((weights.contiguous(), self._last_rank, _tag(_TAG_WEIGHTS), self.stage != self.last))
        for tensor, dst, tag, send in outgoing:  # `outgoing` keeps the tensors alive until the sends complete
            if send and tensor.shape[0]:
                pending.append(self.comm.send(tensor, dst, tag))
        if self.stage == 0:
            features = [torch.cat([f if k == 0 else self._recv_rows(ranks[k], rows[k], f, _tag(_TAG_FEATURES, j))
                                   for k in range(self.layout.stages)]) for j, f in enumerate(features)]
        if self.stage == self.last:
            labels = torch.cat([labels if k == self.last else
                                self._recv_rows(ranks[k], rows[k], labels, _tag(_TAG_LABELS))
                                for k in range(self.layout.stages)])
            if weights is not None:
                weights = torch.cat([weights if k == self.last else
                                     self._recv_rows(ranks[k], rows[k], weights, _tag(_TAG_WEIGHTS))
                                     for k in range(self.layout.stages)])
        total = sum(rows)
        sums = torch.zeros(4, dtype=torch.float64)
        was_training = self._module.training
        self._module.eval()
        with torch.no_grad():
            for index, start in enumerate(range(0, total, _EVAL_ROWS)):
                count = min(_EVAL_ROWS, total - start)
                x = rebuilt_inputs(spec, [f[start: start + count] for f in features]) if self.stage == 0 else \
                    self.comm.recv(self.incoming_buffer("F", count), self._prev, _tag(_TAG_ACTIVATION, index))
                with self.steps.autocast():
                    y = call_model(self._module, x)
                if self._next is not None:
                    sent = y.to(torch_dtype(self.layout.boundary_dtypes[self.stage])).contiguous()
                    self.comm.send(sent, self._next, _tag(_TAG_ACTIVATION, index)).wait()
                    continue
                window = None if weights is None else weights[start: start + count]
                y, target = float_output(y), labels[start: start + count]
                sums += evaluation_sums(y, target, window, loss_fn, classification)
                if metrics is not None:
                    metrics.add(y, scored_labels(loss_fn, target))
        self._module.train(was_training)
        for work in pending:
            work.wait()
        return sums

    def _recv_rows(self, src: int, rows: int, like: torch.Tensor, tag: int) -> torch.Tensor:
        buffer = torch.empty((rows, *like.shape[1:]), dtype=like.dtype, device=like.device)
        if rows:
            self.comm.recv(buffer, src, tag)
        return buffer

    def _input_spec(self) -> InputSpec:
        return self.layout.input_specs or (("", self.layout.input_shape, self.layout.input_dtype),)

    def result_state(self) -> dict[str, torch.Tensor] | None:
        """Replica 0's ranks each return their stage; the driver merges them into the full model."""
        return self.state_dict() if self.replica == 0 else None

    def module(self) -> nn.Module:
        return self._module
