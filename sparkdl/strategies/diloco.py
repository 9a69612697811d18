"""DiLoCo's outer synchronisation (Douillard et al. 2023), streamed (Streaming DiLoCo, Douillard et
al. 2025; ALGORITHMS.md): the model is cut into P fragments of strided top-level layers; fragment p
starts its sync every H inner steps at its own offset, its pseudo-gradient travels quantized
(strategies/low_precision.py) on a communication thread while training goes on for tau steps, and
then the outer Nesterov step lands and is mixed into the local weights with alpha. P=1, tau=0,
alpha=0 is plain DiLoCo.

Step t counts inner optimizer steps from 1. Fragment p starts at every t with t = (p+1) H/P mod H
and lands tau steps later; so the last fragment syncs at H, 2H, ... as plain DiLoCo does.

On replicas of uneven speed (train.local_updates / outer_optimizer / max_staleness), plain DiLoCo's
sync is strategies/diloco_uneven.py's (Dynamic Local Updates, Delayed Nesterov, bounded staleness).
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from sparkdl.comm.base import SUBGROUP, Communicator
from sparkdl.config.uneven import staleness_bounds, uses_uneven_sync
from sparkdl.strategies import low_precision
from sparkdl.strategies.diloco_uneven import UnevenOuterSync
from sparkdl.strategies.islands import average_across_islands, island_comms, island_ranks

# (pseudo-gradient, this rank's residual) -> (the mean over replicas, the residual to keep)
Average = Callable[[torch.Tensor, Optional[torch.Tensor]], tuple[torch.Tensor, Optional[torch.Tensor]]]


@dataclass(frozen=True)
class OuterSchedule:
    every: int  # H: inner steps between two syncs of one fragment
    fragments: int = 1  # P
    delay: int = 0  # tau: inner steps a sync overlaps before it lands

    def offset(self, fragment: int) -> int:
        return (fragment + 1) * self.every // self.fragments % self.every

    def starting(self, step: int) -> list[int]:
        """Fragments whose sync starts after inner step `step`."""
        return [p for p in range(self.fragments) if step >= 1 and (step - self.offset(p)) % self.every == 0]

    def landing(self, step: int) -> list[int]:
        """Fragments whose sync (started `delay` steps earlier) lands after inner step `step`."""
        return [p for p in range(self.fragments) if step - self.delay >= 1 and
                (step - self.delay - self.offset(p)) % self.every == 0]


def layer_groups(model: nn.Module) -> list[list[nn.Parameter]]:
    """The model's top-level layers with trainable parameters, in order: children of the root, with
    containers (ModuleList, Sequential) opened one level so that a stack of blocks is many layers.
    Parameters held by the root itself come first, as one layer. A Hugging Face transformer (a PEFT
    wrapper of one too) is its cut: embeddings, each block, final norm + head (model/transformer_layers.py),
    a tied tensor in the first layer that holds it."""
    cut = _transformer_cut(model)
    if cut is not None:
        return cut
    layers: list[list[nn.Parameter]] = []
    own = [p for p in model.parameters(recurse=False) if p.requires_grad]
    if own:
        layers.append(own)
    for child in model.children():
        members = list(child.children()) if isinstance(child, (nn.ModuleList, nn.Sequential)) else [child]
        if isinstance(child, (nn.ModuleList, nn.Sequential)):
            extra = [p for p in child.parameters(recurse=False) if p.requires_grad]
            if extra:
                layers.append(extra)
        for member in members:
            params = [p for p in member.parameters() if p.requires_grad]
            if params:
                layers.append(params)
    return layers


def _transformer_cut(model: nn.Module) -> list[list[nn.Parameter]] | None:
    from sparkdl.model.transformer_layers import cut_if_known

    cut = cut_if_known(model)  # a model the cut refuses keeps the structural rule
    if cut is None:
        return None
    seen: set[int] = set()
    layers = []
    for layer in cut.layers:
        params = [p for p in layer.parameters() if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in params)
        if params:
            layers.append(params)
    covered = {id(p) for p in model.parameters() if p.requires_grad}
    return layers if seen == covered else None


def fragment_indices(model: nn.Module, params: Sequence[nn.Parameter], fragments: int) -> list[list[int]]:
    """Indices into `params` of each fragment: layers dealt out in turn (strided: layers p, p+P,
    p+2P, ... form fragment p, which the paper found slightly better than contiguous runs)."""
    layers = layer_groups(model)
    if fragments > len(layers):
        raise ValueError(f"train.fragments={fragments}, but the model has {len(layers)} top-level layer(s) "
                         "with parameters: each fragment needs one")
    position = {id(p): i for i, p in enumerate(params)}
    groups: list[list[int]] = [[] for _ in range(fragments)]
    for number, layer in enumerate(layers):
        groups[number % fragments].extend(position[id(p)] for p in layer if id(p) in position)
    return groups


class OuterSync:
    """The global weights, the outer optimizer, and the syncs in flight of one DiLoCo replica."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter], schedule: OuterSchedule, average: Average, *,
                 outer_lr: float, outer_momentum: float, alpha: float, background: bool) -> None:
        self.schedule = schedule
        self._params = params
        self._average = average
        self._alpha = alpha
        self._groups = fragment_indices(model, params, schedule.fragments)
        self.global_params = [p.detach().clone() for p in params]  # theta_old per fragment, the same on every rank
        self._outer = torch.optim.SGD(self.global_params, lr=outer_lr, momentum=outer_momentum,
                                      nesterov=outer_momentum > 0)
        self.step = 0
        self._last_start = [0] * schedule.fragments
        self._residuals: list[torch.Tensor | None] = [None] * schedule.fragments
        self._in_flight: dict[int, Future] = {}
        self.wait_s = 0.0  # the training thread's time blocked on syncs (a compute-utilisation figure)
        # One thread, so every rank runs its syncs in the same order on their process group.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparkdl-outer-sync") \
            if background else None

    @property
    def fragments(self) -> list[list[int]]:
        return self._groups

    def after_inner_step(self) -> None:
        self.step += 1
        started = time.perf_counter()
        for fragment in self.schedule.starting(self.step):
            self._start(fragment)
        for fragment in self.schedule.landing(self.step):
            self._land(fragment, self._alpha)
        self.wait_s += time.perf_counter() - started

    def _delta(self, fragment: int) -> torch.Tensor:
        """The pseudo-gradient theta_old - theta_local of one fragment, flat in fp32."""
        with torch.no_grad():
            return torch.cat([(self.global_params[i] - self._params[i]).reshape(-1).to(torch.float32)
                              for i in self._groups[fragment]])

    def _start(self, fragment: int) -> None:
        delta, residual = self._delta(fragment), self._residuals[fragment]
        self._last_start[fragment] = self.step
        future: Future = Future()
        if self._thread is None:
            future.set_result(self._average(delta, residual))
        else:
            future = self._thread.submit(self._average, delta, residual)
        self._in_flight[fragment] = future

    def _land(self, fragment: int, alpha: float) -> None:
        """The outer step on the fragment's global weights, mixed into the local ones:
        theta = alpha theta_local + (1 - alpha) OuterOpt(theta_old, mean delta)."""
        mean, self._residuals[fragment] = self._in_flight.pop(fragment).result()
        indices = self._groups[fragment]
        with torch.no_grad():
            offset = 0
            for i in indices:
                target = self.global_params[i]
                target.grad = mean[offset: offset + target.numel()].view_as(target).to(target.dtype)
                offset += target.numel()
        self._outer.step()
        with torch.no_grad():
            for i in indices:
                self.global_params[i].grad = None
                local = self._params[i]
                if alpha:
                    local.mul_(alpha).add_(self.global_params[i], alpha=1 - alpha)
                else:
                    local.copy_(self.global_params[i])

    def finish(self) -> None:
        """Land what is in flight, then one last sync of every fragment with local progress, landing
        in full, so that every rank ends with the same global model."""
        for fragment in sorted(self._in_flight):
            self._land(fragment, self._alpha)
        for fragment in range(self.schedule.fragments):
            synced_last = self._last_start[fragment] == self.step and self.schedule.delay == 0 and not self._alpha
            if self.step and not synced_last:
                self._start(fragment)
                self._land(fragment, 0.0)
        self.close()

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None

    def state(self) -> dict[str, Any]:
        """Everything to continue exactly, mid-period included: a sync in flight is finished first
        (every rank checkpoints at the same step) and its mean kept to land at the same step."""
        landed = {str(fragment): future.result() for fragment, future in self._in_flight.items()}
        return {"global_params": [p.detach().cpu() for p in self.global_params], "outer": self._outer.state_dict(),
                "inner_steps": self.step, "last_start": list(self._last_start),
                "residuals": [r for r in self._residuals],
                "in_flight": {key: {"mean": mean, "residual": residual} for key, (mean, residual) in landed.items()}}

    def load(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for mine, saved in zip(self.global_params, state["global_params"]):
                mine.copy_(saved)
        self._outer.load_state_dict(state["outer"])
        self.step = int(state["inner_steps"])
        self._last_start = [int(s) for s in state.get("last_start", [0] * self.schedule.fragments)]
        self._residuals = list(state.get("residuals", [None] * self.schedule.fragments))
        self._in_flight = {}
        if state.get("restart_from_global"):
            self._restart_from_global()
            return
        for key, pending in state.get("in_flight", {}).items():
            future: Future = Future()
            future.set_result((pending["mean"], pending["residual"]))
            self._in_flight[int(key)] = future

    def _restart_from_global(self) -> None:
        """Another world size (executor/reshape.py): every replica starts again from the global model
        with the outer optimizer's state; local progress since each fragment's last sync, the sync in
        flight and the error-feedback residuals (one per old rank) are dropped."""
        self._residuals = [None] * self.schedule.fragments
        with torch.no_grad():
            for local, shared in zip(self._params, self.global_params):
                local.copy_(shared)


class SyncClock:
    """Seconds this rank spent inside its outer syncs' exchanges (on whichever thread ran them) and
    how many fragment syncs ran: the link's time per sync, hidden or not, which executor/replan.py
    prices data parallel with. Read and reset at epoch ends."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.syncs = 0

    def timed(self, average: Average) -> Average:
        def run(delta: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
            started = time.perf_counter()
            try:
                return average(delta, residual)
            finally:
                self.seconds += time.perf_counter() - started
                self.syncs += 1
        return run

    def take(self) -> tuple[float, int]:
        taken = (self.seconds, self.syncs)
        self.seconds, self.syncs = 0.0, 0
        return taken


def build_outer_sync(comm: Communicator, model: nn.Module, params: list[nn.Parameter], train: Any,
                     clock: SyncClock | None = None) -> tuple[OuterSync | UnevenOuterSync, Communicator | None]:
    """DiLoCo's outer sync for this rank, and the communicator its gradients are averaged over every
    step (its island's; None for flat DiLoCo, whose ranks step alone). `clock`: times every exchange."""
    if uses_uneven_sync(train):
        return _uneven_outer_sync(comm, params, train, clock), None
    schedule = OuterSchedule(train.sync_every, train.fragments, train.fragment_sync_delay)
    background = schedule.delay > 0 and comm.size > 1
    if background and SUBGROUP not in comm.ops:
        raise ValueError("train.fragment_sync_delay > 0 overlaps syncs on a second process group, which this "
                         "backend cannot make: use backend='torch', or fragment_sync_delay=0")
    islands = island_ranks(train.islands, comm.world.hosts, comm.world.executors) if train.islands else None
    if islands is not None and SUBGROUP not in comm.ops:
        raise ValueError("train.islands needs process groups per island, which this backend cannot make: use "
                         "backend='torch'")
    stepping = island_comms(comm, islands) if islands else None
    # The communication thread gets process groups of its own: the training thread's collectives
    # never interleave with its syncs.
    wire = train.sync_dtype
    if islands:
        syncing = island_comms(comm, islands) if background else stepping

        def average(delta: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
            return average_across_islands(syncing, delta, wire, residual)
    else:
        wire_comm = comm.split([list(range(comm.size))]) if background else comm

        def average(delta: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
            return low_precision.average_with_feedback(wire_comm, delta, wire, residual)
    outer = OuterSync(model, params, schedule, clock.timed(average) if clock else average, outer_lr=train.outer_lr,
                      outer_momentum=train.outer_momentum,
                      alpha=train.fragment_update_alpha, background=background)
    return outer, stepping.island if stepping is not None else None


def _uneven_outer_sync(comm: Communicator, params: list[nn.Parameter], train: Any,
                       clock: SyncClock | None = None) -> UnevenOuterSync:
    """Plain DiLoCo's sync with local_updates / outer_optimizer / max_staleness (strategies/diloco_uneven.py);
    a staleness bound overlaps whole rounds on a communication thread with a process group of its own."""
    if train.fragments > 1 or train.fragment_sync_delay or train.fragment_update_alpha or train.islands:
        raise ValueError("train.local_updates/outer_optimizer/max_staleness work on plain DiLoCo: leave fragments, "
                         "fragment_sync_delay, fragment_update_alpha and islands at their defaults")
    bounds = staleness_bounds(train.max_staleness)
    background = bounds[1] > 0 and comm.size > 1
    if background and SUBGROUP not in comm.ops:
        raise ValueError("train.max_staleness > 0 overlaps syncs on a second process group, which this backend "
                         "cannot make: use backend='torch', or max_staleness=0")
    wire_comm = comm.split([list(range(comm.size))]) if background else comm
    wire = train.sync_dtype

    def average(delta: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return low_precision.average_with_feedback(wire_comm, delta, wire, residual)

    return UnevenOuterSync(params, wire_comm, clock.timed(average) if clock else average, train, bounds, background)
