"""Data parallel: every rank holds the whole model; gradients are averaged exactly each step.

Averaging goes through the Communicator (not DistributedDataParallel) so the same strategy runs
on every backend and the bytes it sends are counted at one place. Gradients are flattened into a
few large buckets because per-tensor collectives are latency bound on small layers. Where the
backend's allreduce runs in the background (torch: gloo/NCCL), the buckets are reduced while backward
runs (train.overlap_grads, strategies/grad_overlap.py); otherwise all of them after backward.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Iterator

import torch
from torch import nn

from sparkdl.comm.base import ALLREDUCE, BROADCAST, Communicator, blocking
from sparkdl.config import TrainConfig
from sparkdl.strategies.base import LossFn, OptimizerFactory, Strategy
from sparkdl.strategies.diloco import SyncClock, build_outer_sync
from sparkdl.strategies.diloco_uneven import UnevenOuterSync
from sparkdl.strategies.grad_overlap import BUCKET_BYTES, FIRST_BUCKET_BYTES, OverlappedAveraging, average_gradients
from sparkdl.strategies.inputs import call_model, global_share, loss_and_weight_sum
from sparkdl.strategies.stepping import SINGLE, Accumulation, float_output
from sparkdl.strategies.sync_switch import average_optimizer_state

def broadcast_module(comm: Communicator, module: nn.Module, src: int = 0) -> None:
    """Every rank ends with src's trainable parameters and buffers. Frozen ones (a PEFT adapter's
    base) are not sent: every rank built them alike (model/trained_state.py), which one small
    allgather of their fingerprints checks."""
    from sparkdl.model.trained_state import check_same_frozen, module_frozen_digest

    with torch.no_grad():
        for tensor in [p for p in module.parameters() if p.requires_grad] + list(module.buffers()):
            comm.broadcast(tensor.data, src=src)
    if comm.size > 1 and any(not p.requires_grad for p in module.parameters()):
        check_same_frozen(comm.allgather_object(module_frozen_digest(module)))


class DataParallel(Strategy):
    """sync="allreduce": gradients averaged every step. sync="diloco" (Douillard et al. 2023): each
    rank takes `sync_every` inner steps alone (its own optimizer state, never reset), then the mean
    pseudo-gradient theta_global - theta_local is applied by an outer Nesterov SGD to the global copy,
    which every rank then continues from: one allreduce of the model every H steps. With
    `fragments` > 1 or `fragment_sync_delay` > 0 it streams (strategies/diloco.py)."""

    name = "data_parallel"
    requires = frozenset({ALLREDUCE, BROADCAST})
    bucket_bytes = BUCKET_BYTES
    first_bucket_bytes = FIRST_BUCKET_BYTES
    # the last re-plan's sync options, kept in checkpoints; a class default for subclasses whose setup
    # is their own (Sharded), which never switch
    _switched: dict[str, Any] | None = None

    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory, loss_fn: LossFn) -> None:
        self._model = model.to(self.comm.device)
        broadcast_module(self.comm, self._model)
        self._params = [p for p in self._model.parameters() if p.requires_grad]
        optimizer = make_optimizer(self._model.parameters())
        self._diloco = self.train.sync == "diloco"
        # Horovod's DistributedOptimizer allreduces in every backward: accumulating over several
        # backward passes goes through our own averaging instead (the same bytes per optimizer step).
        own_averaging = self._diloco or self.train.accumulate_steps > 1
        wrapped = self.comm.wrap_optimizer(optimizer, self._model) if self.comm.size > 1 and not own_averaging \
            else None
        # A backend's own distributed optimizer averages inside step(); otherwise we average here.
        self._backend_averages = wrapped is not None
        self._optimizer = wrapped or optimizer
        self.steps.attach(self._optimizer)
        self._grad_bytes = sum(p.numel() * p.element_size() for p in self._params)
        self._loss_fn = loss_fn
        self._comm_wait_s = 0.0
        self._step_weight: torch.Tensor | None = None  # this step's weight sum, reduced with the gradients
        self._sync_clock = SyncClock()  # the outer syncs' exchanges, timed (executor/replan.py reads them)
        self._overlap_hooks: OverlappedAveraging | None = None
        self._switched = None
        self._use_sync(self.train)

    def _use_sync(self, train: TrainConfig) -> None:
        """The parts of `train.sync`: DiLoCo's outer sync (from the current weights), the group gradients
        are averaged over every step, and the buckets overlapped with backward."""
        self._diloco = train.sync == "diloco"
        # Whom gradients are averaged with every step: everyone; nobody (DiLoCo's ranks step alone);
        # or the rank's island (islands: data parallel inside, DiLoCo across).
        self._step_comm: Communicator | None = self.comm
        self._uneven = False
        if self._diloco:
            self._outer_sync, self._step_comm = build_outer_sync(self.comm, self._model, self._params, train,
                                                                 self._sync_clock)
            self._uneven = isinstance(self._outer_sync, UnevenOuterSync)  # DyLU, Delayed Nesterov, staleness
        # Buckets reduced during backward: where this strategy averages over several ranks itself and the
        # backend's allreduce runs in the background (a synchronous one gains nothing inside backward).
        group = self._step_comm
        overlap = bool(train.overlap_grads) and self._weight_rides_along() and group is not None \
            and group.overlaps_allreduce
        if overlap and self._overlap_hooks is None:  # hooked once: a switch back reuses them
            self._overlap_hooks = OverlappedAveraging(self._params, self.first_bucket_bytes, self.bucket_bytes)
        self._overlap = self._overlap_hooks if overlap else None

    @property
    def sync_mode(self) -> str:
        return "diloco" if self._diloco else "allreduce"

    @property
    def can_switch_sync(self) -> bool:
        """Only this strategy's own averaging switches (a backend's distributed optimizer averages inside
        step(); islands keep their groups)."""
        return not self._backend_averages and not self.train.islands

    def switch_sync(self, options: dict[str, Any]) -> None:
        """A re-plan at an epoch boundary (executor/replan.py), on every rank after the same step:
        `options` = sync ("allreduce" or "diloco") and DiLoCo's. Weights stay continuous: leaving DiLoCo
        first finishes its outer sync (what is in flight lands, then one last sync of local progress),
        so every replica holds the global model, which rank 0 then broadcasts (bitwise the same on
        all), and the inner optimizers' moments are averaged; entering DiLoCo starts its global copy
        from the current weights. The optimizer and its state are kept (DiLoCo's inner optimizer,
        never reset); the lr schedule goes on."""
        if self._diloco:
            self._outer_sync.finish()
            self._sync_clock.take()
            average_optimizer_state(self.comm, self._optimizer)
        broadcast_module(self.comm, self._model)
        self.train = replace(self.train, **options)
        self._switched = dict(options)
        self._use_sync(self.train)

    def train_step(self, inputs: Any, labels: torch.Tensor, weights: torch.Tensor | None = None,
                   micro: Accumulation = SINGLE) -> torch.Tensor:
        started = time.perf_counter()
        self._model.train()
        if micro.index == 0:
            self._optimizer.zero_grad()  # torch 2 defaults to set_to_none; Horovod's wrapper takes no argument
        with self.steps.autocast():
            output = call_model(self._model, inputs)
        loss, numerator, denominator = loss_and_weight_sum(self._loss_fn, float_output(output), labels, weights)
        overlapped = self._overlap is not None and micro.last
        if numerator is not None and micro.count > 1:
            # The window's weighted mean: sum(w * l) now, divided by the window's weight total at its end
            # (overlapped: the total rides with the gradients, as for one batch).
            self._window_weight = denominator.detach() + (self._window_weight if micro.index else 0.0)
            self._backward(numerator, SINGLE, self._window_weight if overlapped else None, overlapped)
        elif numerator is not None and self._weight_rides_along():
            self._step_weight = denominator.detach()  # divided by the global weight total while averaged
            self._backward(numerator, micro, self._step_weight, overlapped)
        else:
            self._backward(self._objective(loss, numerator, denominator), micro, None, overlapped)
        self.slow_down(started)
        rows = (float(denominator) if numerator is not None else float(labels.shape[0])) if self._uneven else 0.0
        if not micro.last:
            if self._uneven:
                self._outer_sync.record_compute(time.perf_counter() - started, 0, rows)
            return loss.detach()
        if numerator is not None and micro.count > 1 and not overlapped:
            self._normalise_window()
        if self._diloco:
            if self._step_comm is not None and self._step_comm.size > 1:
                self._averaged(self._step_comm)
            self.steps.step(self._optimizer, self._params)
            if self._uneven:
                extra = self._outer_sync.inner_steps_now() - 1
                for _ in range(extra):
                    self._echo_step(inputs, labels, weights)
                self._outer_sync.record_compute(time.perf_counter() - started, 1 + extra, rows)
            self._outer_sync.after_inner_step()
            return loss.detach()
        if self._backend_averages:
            self.comm.record_allreduce(self._grad_bytes)
            # Horovod: average first, then unscale and clip, then step; its wait counts as this rank's wait
            blocking(self._optimizer.synchronize)
            with self._optimizer.skip_synchronize():
                self.steps.step(self._optimizer, self._params)
            return loss.detach()
        if self.comm.size > 1:
            self._averaged(self.comm)
        self.steps.step(self._optimizer, self._params)
        return loss.detach()

    def _echo_step(self, inputs: Any, labels: torch.Tensor, weights: torch.Tensor | None) -> None:
        """Dynamic local updates: one more inner step on the same batch (a fast replica's otherwise idle
        time, strategies/diloco_uneven.py); the lr schedule still counts loader steps."""
        started = time.perf_counter()
        self._optimizer.zero_grad()
        with self.steps.autocast():
            output = call_model(self._model, inputs)
        loss, numerator, denominator = loss_and_weight_sum(self._loss_fn, float_output(output), labels, weights)
        self.steps.backward(self._objective(loss, numerator, denominator))
        self.slow_down(started)
        scheduler, self.steps.scheduler = self.steps.scheduler, None
        try:
            self.steps.step(self._optimizer, self._params)
        finally:
            self.steps.scheduler = scheduler

    def epoch_record(self) -> dict[str, Any]:
        """DiLoCo: every rank's seconds inside outer-sync exchanges this epoch and the fragment syncs
        that ran (the link's time per sync, executor/replan.py), and on uneven workers every replica's
        schedule; gathered so that the record is the same on all ranks."""
        record = self._uneven_record() if self._uneven else super().epoch_record()
        if self._diloco and self.comm.size > 1:
            seconds, syncs = self._sync_clock.take()
            every = self.comm.allgather_object((seconds, syncs))
            schedule = getattr(self._outer_sync, "schedule", None)
            record.update(outer_sync_seconds_by_rank=[float(s) for s, _ in every],
                          outer_syncs=min(int(n) for _, n in every),
                          outer_fragments=int(getattr(schedule, "fragments", 1)))
        return record

    def _uneven_record(self) -> dict[str, Any]:
        """DiLoCo on uneven workers: every replica's schedule this epoch (H_w and the bound s per round,
        the staleness of each landed sync, inner steps)."""
        mine = self._outer_sync.take_schedule()
        every = self.comm.allgather_object(mine) if self.comm.size > 1 else [mine]
        landed = [[staleness for _, staleness in r["landings"]] for r in every]
        return {**super().epoch_record(),
                "diloco_inner_steps_by_rank": [int(r["inner_steps"]) for r in every],
                "diloco_round_steps_by_rank": [[int(x["steps"]) for x in r["rounds"]] for r in every],
                "diloco_staleness_bound_by_rank": [[int(x["staleness_bound"]) for x in r["rounds"]] for r in every],
                "diloco_round_plans_by_rank": [[[int(h) for h in x["plan_steps"]] for x in r["rounds"]] for r in every],
                "diloco_landing_staleness_by_rank": landed,
                "diloco_max_staleness": max((max(s, default=0) for s in landed), default=0)}

    def _weight_rides_along(self) -> bool:
        """The global weight total can travel with the gradients: this strategy averages them itself
        over a group of several ranks (not a backend's optimizer, not DiLoCo's ranks stepping alone)."""
        group = self._step_comm
        return group is not None and group.size > 1 and not self._backend_averages

    def _backward(self, objective: torch.Tensor, micro: Accumulation, weight: torch.Tensor | None,
                  overlapped: bool) -> None:
        """steps.backward; `overlapped`: with the buckets' allreduces started as their gradients are
        done (`weight`: this rank's weight total, riding along), finished by _averaged."""
        if not overlapped:
            self.steps.backward(objective, micro)
            return
        assert self._overlap is not None and self._step_comm is not None
        self._overlap.arm(self._step_comm, weight)
        try:
            self.steps.backward(objective, micro)
        except BaseException:
            self._overlap.disarm()
            raise

    def _averaged(self, group: Communicator) -> None:
        started = time.perf_counter()
        weight, self._step_weight = self._step_weight, None
        if self._overlap is not None and self._overlap.armed:
            self._overlap.finish()  # the weight rode along already
        else:
            average_gradients(group, self._params, bucket_bytes=self.bucket_bytes, weight=weight)
        self._comm_wait_s += time.perf_counter() - started

    def epoch_metrics(self) -> dict[str, float]:
        """Besides the base figures, this epoch's seconds blocked on communication (gradient averaging,
        DiLoCo syncs not hidden behind training): compute utilisation is 1 - that / the epoch's time."""
        waited = self._comm_wait_s + (self._outer_sync.wait_s if self._diloco else 0.0)
        self._comm_wait_s = 0.0
        if self._diloco:
            self._outer_sync.wait_s = 0.0
        return {**super().epoch_metrics(), "comm_wait_s": waited}

    def _objective(self, loss: torch.Tensor, numerator: torch.Tensor | None, denominator: torch.Tensor | None
                   ) -> torch.Tensor:
        """What this rank differentiates so that averaging over ranks gives the global mean."""
        if numerator is not None:
            return self._weighted_objective(numerator, denominator)
        if self.loss_weight != 1.0 and not self._diloco:
            return loss * self.loss_weight  # unequal shares: the average over ranks is the mean over all rows
        return loss

    def _normalise_window(self) -> None:
        """Gradients of sum(w * l) over an accumulation window -> of sum(w * l) / sum(w) over the
        window's global batch (DiLoCo: this rank's), so k micro-batches weigh exactly like one batch."""
        total = self._window_weight.reshape(1).to(torch.float32).clone()
        ranks = 1
        if self._step_comm is not None and self._step_comm.size > 1:
            self._step_comm.allreduce(total, op="sum")
            ranks = self._step_comm.size  # gradients are averaged over the ranks next
        factor = ranks / total[0].clamp_min(torch.finfo(torch.float32).tiny)
        for param in self._params:
            if param.grad is not None:
                param.grad.mul_(factor)

    def _weighted_objective(self, numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
        """sum(w * l) / sum(w) over the global batch (DiLoCo's ranks step alone: over their own;
        islands: over the island's)."""
        group = self._step_comm
        if group is None or group.size == 1:
            return numerator / denominator.clamp_min(torch.finfo(torch.float32).tiny)
        total = denominator.detach().reshape(1).clone()
        group.allreduce(total, op="sum")
        return global_share(numerator, denominator, total[0], group.size)

    @property
    def replicated_state(self) -> bool:  # type: ignore[override]
        return not self._diloco  # DiLoCo's ranks drift apart between synchronisations

    def checkpoint_state(self) -> dict[str, Any]:
        state = super().checkpoint_state()
        if self._switched is not None:  # a re-planned run resumes in the sync mode it had switched to
            state["replanned_sync"] = dict(self._switched)
        if self._diloco:
            state.update(self._outer_sync.state())
        return state

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        switched = state.get("replanned_sync")
        if switched is not None and switched.get("sync") != self.sync_mode:
            self.switch_sync(switched)  # every rank loads the same checkpoint at the same point
        super().load_checkpoint_state(state)
        if self._diloco:
            self._outer_sync.load(state)

    def finish(self) -> None:
        if self._diloco:
            self._outer_sync.finish()  # the last partial round, so the result is the global model

    def evaluate(self, batches: Any, loss_fn: LossFn, classification: bool, metrics: Any = None) -> torch.Tensor:
        # Between synchronisations the ranks' models differ; validate the global one they share.
        with self._global_weights():
            return super().evaluate(batches, loss_fn, classification, metrics)

    def snapshot(self) -> dict[str, torch.Tensor]:
        with self._global_weights():  # the weights validation measured
            return super().snapshot()

    @contextmanager
    def _global_weights(self) -> Iterator[None]:
        """DiLoCo: the shared global weights in the module for the duration (allreduce: as is)."""
        if not self._diloco:
            yield
            return
        with torch.no_grad():
            local = [p.detach().clone() for p in self._params]
            for param, start in zip(self._params, self._outer_sync.global_params):
                param.copy_(start)
        try:
            yield
        finally:
            with torch.no_grad():
                for param, mine in zip(self._params, local):
                    param.copy_(mine)

    def end_epoch(self) -> None:
        if self._uneven:
            self._outer_sync.drain()  # every sync in flight lands: one global model for validation
        # Buffers (BatchNorm running stats) drift apart per rank; rank 0's copy is the one kept.
        if self.comm.size > 1:
            with torch.no_grad():
                for buffer in self._model.buffers():
                    self.comm.broadcast(buffer.data, src=0)

    def module(self) -> nn.Module:
        return self._model
