"""DiLoCo on replicas of uneven speed (ALGORITHMS.md, "Uneven workers"): Dynamic Local Updates (DyLU,
Liu et al. 2024), Delayed Nesterov, and DSSP-style bounded staleness (Zhao et al. 2019).

What sparkdl's data contract allows, and the decisions taken (docs/architecture.md says the same):

- Every rank takes the same loader steps per epoch, and an epoch's rows are split equally, so a slow
  replica needs its full time for its rows whatever the inner-step count: a round that merged its
  batches into fewer inner steps would cost it the same compute, and a round that skipped rows would
  lose data. A round is therefore `sync_every` (H) *loader steps* on every replica (the syncs line up,
  bytes per epoch are DiLoCo's, every row is trained on once), and DyLU gives the time a fast replica
  would spend waiting to extra inner steps on the round's batches (data echoing, Choi et al. 2019):
  replica w takes H_w inner steps per round, the paper's H_w = floor(v_w / v_max * H_top), v_w its
  measured inner steps per second of compute (its waits excluded), H_top = floor(H v_max / v_min)
  the fastest replica's count (at most ECHO_LIMIT x H), and never fewer than H: the slowest replica
  takes one inner step per batch. Loader batch i of a round gets floor((i+1) H_w / H) - floor(i H_w / H)
  inner steps, each on the whole batch (the lr schedule advances once per loader step).
- Pseudo-gradients are weighted by the rows (or the row-weight sum, with weight_col) each replica
  trained on in the round: outer gradient = sum_w n_w delta_w / sum_w n_w. Echoed steps are not new
  samples, so they add no weight: each row counts once, as in the paper's stream of fresh samples.
- Speeds, rows and round times ride a tiny sum-allreduce (5 values per rank) just before the
  pseudo-gradient's on the same thread and process group; the plan they give (H_w of every replica,
  the staleness bound s) is the same on every rank and applies from the round after the sync lands.
  The first round, before any measurement, is plain DiLoCo (H_w = H).
- Bounded staleness (max_staleness): sync k starts at the end of round k on a communication thread
  and the replica trains on; it lands at a later round end once its allreduce is done, and at the
  latest at the end of round k + s (the replica waits there), so a replica runs at most s rounds
  ahead of the slowest. A sync that lands late is applied without discarding the local progress made
  since: theta += (G_new - G_old) + own delta_k (the round-k progress now in G). With (s_L, s_U) bounds
  s = s_L + r*, r* = argmin_{0<=r<=s_U-s_L} min_{k>=0} |T_f + r d_f - (T_s + k d_s)| (DSSP) from the
  fastest and slowest replicas' last arrivals T (relative to the last sync's completion) and round
  compute times d. Every sync in flight lands at each epoch end, so validation sees one global model.
- Delayed Nesterov (outer_optimizer="delayed_nesterov"): the momentum-free part of each outer step
  now, the momentum updated and applied once every N pseudo-gradients (N = outer_momentum_every, or the
  number of replicas).
- Deterministic given the seed and the measured schedule: each epoch's record keeps, per replica and
  round, H_w, the bound s and every landing's staleness (strategy.epoch_record).
"""
from __future__ import annotations

import math
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from sparkdl.comm.base import Communicator

ECHO_LIMIT = 4  # the fastest replica takes at most this many inner steps per loader batch
INFO = 5  # per rank: rows, inner steps, compute seconds, round compute interval, lead of the last sync
Average = Callable[[torch.Tensor, Optional[torch.Tensor]], tuple[torch.Tensor, Optional[torch.Tensor]]]


def dynamic_local_steps(speeds: Sequence[float], every: int, limit: int = ECHO_LIMIT) -> list[int]:
    """DyLU's H_w = floor(v_w / v_max * H_top) for every replica, H_top = floor(H v_max / v_min) capped
    at limit x H, and at least H (one inner step per loader batch: no row is skipped)."""
    fastest, slowest = max(speeds), min(speeds)
    if not slowest > 0:
        return [every] * len(speeds)
    top = min(limit * every, math.floor(every * fastest / slowest + 1e-9))
    return [max(every, math.floor(v / fastest * top + 1e-9)) for v in speeds]


def echoes(position: int, every: int, steps: int) -> int:
    """Inner steps on loader batch `position` (0-based) of a round of `every` batches and `steps` inner steps."""
    return (position + 1) * steps // every - position * steps // every


def extra_rounds(t_fast: float, d_fast: float, t_slow: float, d_slow: float, r_max: int) -> int:
    """DSSP's r* = argmin_{0 <= r <= r_max} min_{k >= 0} |T_f + r d_f - (T_s + k d_s)|: the extra rounds
    that bring the fast replica's predicted arrival closest to one of the slow replica's (ties: fewer)."""
    best, best_gap = 0, math.inf
    for r in range(r_max + 1):
        arrival = t_fast + r * d_fast
        if d_slow > 0:
            k = max(0, round((arrival - t_slow) / d_slow))
            gap = min(abs(arrival - (t_slow + j * d_slow)) for j in {max(0, k - 1), k, k + 1})
        else:
            gap = abs(arrival - t_slow)
        if gap < best_gap - 1e-12:
            best, best_gap = r, gap
    return best


@dataclass(frozen=True)
class Plan:
    """What every rank agreed at one sync: each replica's inner steps per round and the staleness bound."""
    steps: tuple[int, ...]
    staleness: int


def agreed_plan(info: torch.Tensor, every: int, dynamic: bool, bounds: tuple[int, int]) -> Plan:
    """The plan from a sync's gathered figures (W x INFO; the same on every rank)."""
    rows = info.view(-1, INFO)
    speeds = [float(n / s) if s > 0 else 0.0 for n, s in zip(rows[:, 1].tolist(), rows[:, 2].tolist())]
    measured = all(v > 0 for v in speeds)
    steps = dynamic_local_steps(speeds, every) if dynamic and measured else [every] * len(speeds)
    low, high = bounds
    staleness = low
    if high > low and measured:
        fast, slow = speeds.index(max(speeds)), speeds.index(min(speeds))
        arrivals, intervals = (-rows[:, 4]).tolist(), rows[:, 3].tolist()
        staleness = low + extra_rounds(arrivals[fast], intervals[fast], arrivals[slow], intervals[slow], high - low)
    return Plan(tuple(steps), staleness)


class DelayedNesterov:
    """Liu et al.'s outer optimizer: on each pseudo-gradient g, theta -= lr g / N; buf += g; every N-th,
    m = beta m + buf / N; theta -= lr beta m; buf = 0. N = 1 is Nesterov SGD."""

    def __init__(self, params: list[torch.Tensor], lr: float, momentum: float, every: int) -> None:
        self.params, self.lr, self.momentum, self.every = params, lr, momentum, max(1, every)
        self.buffer = [torch.zeros_like(p) for p in params]
        self.velocity = [torch.zeros_like(p) for p in params]
        self.count = 0

    @torch.no_grad()
    def step(self) -> None:
        for p, buf in zip(self.params, self.buffer):
            p.add_(p.grad, alpha=-self.lr / self.every)
            buf.add_(p.grad)
        self.count += 1
        if self.count % self.every == 0:
            for p, buf, m in zip(self.params, self.buffer, self.velocity):
                m.mul_(self.momentum).add_(buf, alpha=1.0 / self.every)
                p.add_(m, alpha=-self.lr * self.momentum)
                buf.zero_()

    def state_dict(self) -> dict[str, Any]:
        return {"buffer": [b.clone() for b in self.buffer], "velocity": [m.clone() for m in self.velocity],
                "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for mine, saved in zip(self.buffer + self.velocity, list(state["buffer"]) + list(state["velocity"])):
            mine.copy_(saved)
        self.count = int(state["count"])


class UnevenOuterSync:
    """DiLoCo's outer sync with DyLU, sample weights, Delayed Nesterov and bounded staleness (one fragment).
    The data-parallel strategy asks `inner_steps_now()` before a loader batch, reports each batch with
    `record_compute` and calls `after_inner_step()` once per loader batch."""

    def __init__(self, params: list[nn.Parameter], comm: Communicator, average: Average, train: Any,
                 bounds: tuple[int, int], background: bool) -> None:
        self.every, self.rank, self.size = int(train.sync_every), comm.rank, comm.size
        self._params, self._comm, self._average = params, comm, average
        self._dynamic = train.local_updates == "dynamic"
        self.bounds = bounds
        self.global_params = [p.detach().clone() for p in params]
        self._anchor = [p.detach().clone() for p in params] if bounds[1] > 0 else self.global_params
        if train.outer_optimizer == "delayed_nesterov":
            self._outer: Any = DelayedNesterov(self.global_params, train.outer_lr, train.outer_momentum,
                                               train.outer_momentum_every or comm.size)
        else:
            self._outer = torch.optim.SGD(self.global_params, lr=train.outer_lr, momentum=train.outer_momentum,
                                          nesterov=train.outer_momentum > 0)
        self.plan = Plan((self.every,) * comm.size, bounds[0])
        self.step = 0  # loader steps (round k ends after loader step k H)
        self.round_steps = self.every  # this replica's H_w in the current round
        self.speed_override: float | None = None  # tests: a measured speed (inner steps/s) to report instead
        self._rows = self._inner = 0.0
        self._compute_s = 0.0
        self._round_started = time.perf_counter()
        self._round_wait = 0.0
        self._last_lead = 0.0
        self._residual: torch.Tensor | None = None
        self._in_flight: deque[tuple[int, Future, torch.Tensor]] = deque()  # (round, sync, own delta)
        self.wait_s = 0.0
        # per round since the last take_schedule(): this replica's H_w and the bound s in force
        # and the agreed plan it came from (every replica's H_w): replicas land a sync at different
        # rounds when staleness lets one run ahead, so their k-th rounds may follow different plans
        self.schedule: list[dict[str, Any]] = [{"round": 1, "steps": self.every, "staleness_bound": bounds[0],
                                                "plan_steps": [self.every] * self.size}]
        self.landings: list[tuple[int, int]] = []  # (round, staleness) since the last take_schedule()
        self.inner_steps_total = 0
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparkdl-outer-sync") \
            if background else None

    # --- the training thread's hooks ---------------------------------------------------------------
    def inner_steps_now(self) -> int:
        return echoes(self.step % self.every, self.every, self.round_steps)

    def record_compute(self, seconds: float, inner_steps: int, rows: float) -> None:
        self._compute_s += seconds
        self._inner += inner_steps
        self._rows += rows
        self.inner_steps_total += inner_steps

    def after_inner_step(self) -> None:
        self.step += 1
        if self.step % self.every:
            return
        started = time.perf_counter()
        k = self.step // self.every
        self._start(k)
        self._land_due(k)
        self.round_steps = self.plan.steps[self.rank]
        self.schedule.append({"round": k + 1, "steps": self.round_steps, "staleness_bound": self.plan.staleness,
                              "plan_steps": list(self.plan.steps)})
        waited = time.perf_counter() - started
        self.wait_s += waited
        self._round_wait += waited

    # --- syncs ----------------------------------------------------------------------------------------
    def _delta(self) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([(a - p).reshape(-1).to(torch.float32) for a, p in zip(self._anchor, self._params)])

    def _figures(self) -> torch.Tensor:
        info = torch.zeros(self.size * INFO, dtype=torch.float64)
        compute = self._compute_s if self.speed_override is None else self._inner / self.speed_override
        interval = time.perf_counter() - self._round_started - self._round_wait
        if self.speed_override is not None:
            interval = compute
        info[self.rank * INFO: (self.rank + 1) * INFO] = torch.tensor(
            [self._rows, self._inner, compute, interval, self._last_lead], dtype=torch.float64)
        self._rows = self._inner = 0.0
        self._compute_s = self._round_wait = 0.0
        self._round_started = time.perf_counter()
        return info

    def _start(self, k: int) -> None:
        delta = self._delta()
        if self._anchor is not self.global_params:
            with torch.no_grad():
                for anchor, p in zip(self._anchor, self._params):
                    anchor.copy_(p)
        info = self._figures()
        future: Future = Future()
        if self._thread is None:
            future.set_result(self._sync(delta, info, time.perf_counter()))
        else:
            future = self._thread.submit(self._sync, delta, info, time.perf_counter())
        self._in_flight.append((k, future, delta))

    def _sync(self, delta: torch.Tensor, info: torch.Tensor, started: float) -> tuple[torch.Tensor, torch.Tensor]:
        """On the communication thread: the figures, then the row-weighted mean pseudo-gradient (the
        error-feedback residual, if any, is the thread's: syncs run one after another)."""
        if self.size > 1:
            self._comm.allreduce(info, op="sum")
        rows = info.view(-1, INFO)[:, 0]
        total = float(rows.sum())
        factor = float(rows[self.rank]) * self.size / total if total > 0 else 1.0
        mean, self._residual = self._average(delta * factor if factor != 1.0 else delta, self._residual)
        self._last_lead = time.perf_counter() - started
        return mean, info

    def _land_due(self, current: int) -> None:
        """Land, in order, every sync whose allreduce is done, and every one `plan.staleness` rounds old."""
        while self._in_flight:
            k, future, _ = self._in_flight[0]
            if not (future.done() or current - k >= self.plan.staleness):
                break
            self._land(current)

    def _land(self, current: int) -> None:
        k, future, own = self._in_flight.popleft()
        mean, info = future.result()
        fresh = k == current and self.step == k * self.every and not self._in_flight
        old = None if fresh else [g.clone() for g in self.global_params]
        with torch.no_grad():
            offset = 0
            for g in self.global_params:
                g.grad = mean[offset: offset + g.numel()].view_as(g).to(g.dtype)
                offset += g.numel()
        self._outer.step()
        with torch.no_grad():
            offset = 0
            for i, (g, p) in enumerate(zip(self.global_params, self._params)):
                g.grad = None
                if fresh:  # the round just ended: plain DiLoCo, the local weights become the global ones
                    p.copy_(g)
                    if self._anchor is not self.global_params:
                        self._anchor[i].copy_(g)
                else:  # keep the progress made since: shift by the update and the own round now in G
                    shift = g - old[i] + own[offset: offset + g.numel()].view_as(g).to(g.dtype)
                    p.add_(shift)
                    self._anchor[i].add_(shift)
                offset += g.numel()
        self.plan = agreed_plan(info, self.every, self._dynamic, self.bounds)
        self.landings.append((k, current - k))

    def drain(self) -> None:
        """Land every sync in flight (epoch ends, the end): every replica then holds the same global model."""
        started = time.perf_counter()
        current = self.step // self.every
        while self._in_flight:
            self._land(current)
        if self.step % self.every == 0 and self._anchor is not self.global_params:
            with torch.no_grad():  # no local progress since the round ended: exactly the global model
                for p, a, g in zip(self._params, self._anchor, self.global_params):
                    p.copy_(g)
                    a.copy_(g)
        self.wait_s += time.perf_counter() - started

    def finish(self) -> None:
        self.drain()
        if self.step % self.every:  # the last partial round, landed at once
            k = self.step // self.every + 1
            self._start(k)
            self.step = k * self.every  # land it as a fresh round: the result is the global model
            self._land(k)
        self.close()

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None

    def take_schedule(self) -> dict[str, Any]:
        """This replica's schedule since the last call: H_w and s per round, each landing's staleness."""
        out = {"rounds": list(self.schedule), "landings": list(self.landings), "inner_steps": self.inner_steps_total}
        self.schedule, self.landings, self.inner_steps_total = [], [], 0
        return out

    # --- checkpoints --------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        pending = [{"round": k, "own": own, "result": list(future.result())} for k, future, own in self._in_flight]
        outer = self._outer.state_dict()
        return {"global_params": [p.detach().cpu() for p in self.global_params],
                "anchor": [a.detach().cpu() for a in self._anchor], "outer": outer, "inner_steps": self.step,
                "plan_steps": list(self.plan.steps), "plan_staleness": self.plan.staleness,
                "round_steps": self.round_steps, "residual": self._residual, "in_flight": pending}

    def load(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for mine, saved in zip(self.global_params, state["global_params"]):
                mine.copy_(saved)
            if self._anchor is not self.global_params:
                for mine, saved in zip(self._anchor, state.get("anchor", state["global_params"])):
                    mine.copy_(saved)
        self._outer.load_state_dict(state["outer"])
        self.step = int(state["inner_steps"])
        self.plan = Plan(tuple(int(s) for s in state.get("plan_steps", self.plan.steps)),
                         int(state.get("plan_staleness", self.plan.staleness)))
        self.round_steps = int(state.get("round_steps", self.every))
        self._residual = state.get("residual")
        self._in_flight = deque()
        if state.get("restart_from_global"):
            with torch.no_grad():
                for local, shared, anchor in zip(self._params, self.global_params, self._anchor):
                    local.copy_(shared)
                    anchor.copy_(shared)
            return
        for pending in state.get("in_flight", []):
            future: Future = Future()
            future.set_result(tuple(pending["result"]))
            self._in_flight.append((int(pending["round"]), future, pending["own"]))
