"""Exact data parallel on ranks whose speeds differ and change (`train.batch_balance="dynamic"`;
issue 43 item 3, ALGORITHMS.md "Uneven workers": exact strategies re-split the global batch by
measured speed and weight gradients by samples).

Every step keeps the rows the even split gives it (`batch_balance="equal"`: the same epoch plan,
the same global batch per step, every row of an epoch once), so the update is exactly the even
split's; what follows the ranks' measured speeds is *who computes* those rows. Each rank measures
its own compute seconds per row (step time less its waits in collectives); every `rebalance_every`
steps (and after the run's 2nd and 4th: until the first agreement a slow rank holds every step back)
the ranks agree on their smoothed speeds in one small allreduce, and when the lock-step time
they predict would improve enough, at WINDOW successive agreements (each judged on its own steps'
speeds, the same rank setting the pace), the step's rows are re-split in proportion to speed (never below a floor, so a slow rank's speed stays measured). "Enough" is
executor/pace.py's rule, the one that names slow ranks: at least MIN_LOST_S a step and MIN_SHARE of
the step's predicted compute, so sub-millisecond noise never moves rows (nor says speeds drifted). A slower rank then sends the tail of
its batch to faster ones, point to point, one step ahead: the rows of step t+1 travel while step t
computes. The loss of a rank computing n of a step's N rows is weighted n x W / N (weighted batches
already average by the global weight total), so averaging gradients gives the mean over all N rows.

The shares a run last measured travel in its checkpoints keyed by executor (then host), so a resumed
or resized run starts from them. Standard library and torch; no Spark.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch

from sparkdl.executor.pace import Cost, Sustained, costs_the_run
from sparkdl.strategies.inputs import flat_inputs, input_spec, rebuilt_inputs

if TYPE_CHECKING:
    from sparkdl.comm.base import Communicator, Work
    from sparkdl.data.epochs import EpochPlan

EARLY_AGREEMENTS = (2, 4)  # global steps of extra agreements: a slow rank costs every step until a re-split
SMOOTHING = 0.5  # weight of the newest measurement in each rank's speed
FLOOR_DIVISOR = 8  # a rank keeps at least 1/8 of its even share (at least one row)
TAG_BASE = 1 << 20  # point-to-point tags of the exchange, clear of the pipeline's

Triple = tuple[Any, torch.Tensor, "torch.Tensor | None"]


def split_rows(total: int, speeds: Sequence[float], floor: int = 1) -> list[int]:
    """`total` rows split in proportion to `speeds` (largest remainders), each at least `floor`
    (capped so the floors fit)."""
    world = len(speeds)
    floor = max(0, min(floor, total // max(world, 1)))
    weight = sum(speeds)
    raw = [total * s / weight for s in speeds] if weight > 0 else [total / world] * world
    rows = [max(floor, int(r)) for r in raw]
    order = sorted(range(world), key=lambda r: (rows[r] - raw[r], r))  # largest remainder first
    index = 0
    while sum(rows) < total:
        rows[order[index % world]] += 1
        index += 1
    while sum(rows) > total:  # floors took rows: back from the rank furthest above its proportion
        rows[max((r for r in range(world) if rows[r] > floor), key=lambda r: (rows[r] - raw[r], -r))] -= 1
    return rows


def transfers(counts: Sequence[int], targets: Sequence[int]) -> list[tuple[int, int, int]]:
    """(source, destination, rows): surplus ranks give their tail rows to ranks short of their
    target, both in rank order; the same list on every rank."""
    surplus = [[r, c - t] for r, (c, t) in enumerate(zip(counts, targets)) if c > t]
    deficit = [[r, t - c] for r, (c, t) in enumerate(zip(counts, targets)) if t > c]
    moves: list[tuple[int, int, int]] = []
    while surplus and deficit:
        n = min(surplus[0][1], deficit[0][1])
        moves.append((surplus[0][0], deficit[0][0], n))
        for queue in (surplus, deficit):
            queue[0][1] -= n
            if queue[0][1] == 0:
                queue.pop(0)
    return moves


def step_time(rows: Sequence[int], speeds: Sequence[float]) -> float:
    """Lock-step time of a step split as `rows` over ranks of `speeds` rows/s: the slowest rank's."""
    return max(n / s for n, s in zip(rows, speeds) if s > 0) if any(s > 0 for s in speeds) else 0.0


def split_cost(shares: Sequence[float], speeds: Sequence[float], rows: int, floor: int) -> Cost | None:
    """What keeping the current split costs per step against splitting by `speeds`: the predicted
    seconds a re-split saves, of the current split's predicted step (None: fewer than two ranks
    measured). Ranks without a measurement count at the others' median."""
    measured = [s for s in speeds if s > 0]
    if len(measured) < 2:
        return None
    median = statistics.median(measured)
    speeds = [s if s > 0 else median for s in speeds]
    now = step_time(split_rows(rows, shares, floor), speeds)
    return Cost(now - step_time(split_rows(rows, speeds, floor), speeds), now)


def window_cost(shares: Sequence[float], speeds: Sequence[float], rows: int, floor: int) -> dict[int, Cost]:
    """One agreement's measurement for pace.Sustained: {the rank that sets the pace at these speeds:
    what the current split costs}, from the speeds of the steps since the last agreement alone (not
    the smoothed ones, which would carry one burst into the next agreement and count it twice); the
    key is the rank, so a burst that moves from rank to rank (a loaded machine) is no streak."""
    cost = split_cost(shares, speeds, rows, floor)
    if cost is None:
        return {}
    median = statistics.median(s for s in speeds if s > 0)
    counts = split_rows(rows, shares, floor)
    pace = max(range(len(speeds)), key=lambda r: counts[r] / (speeds[r] if speeds[r] > 0 else median))
    return {pace: cost}


def resplit(shares: Sequence[float], speeds: Sequence[float], rows: int, floor: int) -> list[float] | None:
    """The new shares when splitting by `speeds` pays by executor/pace.py's rule (one measurement's
    verdict; the Rebalancer also asks for WINDOW in a row). None: keep the current split."""
    cost = split_cost(shares, speeds, rows, floor)
    if cost is None or not costs_the_run(cost):
        return None
    measured = [s for s in speeds if s > 0]
    median = statistics.median(measured)
    speeds = [s if s > 0 else median for s in speeds]
    total = sum(speeds)
    return [s / total for s in speeds]


@dataclass
class _Exchange:
    """One step's rows on their way: what this rank keeps, what it receives (posted), its sends."""

    step: int
    kept: Triple
    receiving: list[tuple[int, torch.Tensor, Any]]  # (source, buffer, work)
    sends: list[Any]
    rows: int  # rows this rank computes
    global_rows: int


@dataclass
class Rebalancer:
    """One rank's side of the re-split: measures, agrees, plans and moves rows (see the module)."""

    comm: "Communicator"
    every: int
    shares: list[float]  # fraction of each step's rows per rank, the same on every rank
    speeds: list[float] = field(default_factory=list)  # agreed smoothed rows/s per rank (0: unmeasured)
    rebalances: int = 0  # re-splits so far this epoch
    drifted: str = ""  # how the measured speeds left those the run started from, said at a re-split (once)
    rows_moved: int = 0  # rows sent between ranks so far this epoch (all ranks)
    _own_speed: float = 0.0
    _rows: float = 0.0
    _seconds: float = 0.0
    _current: tuple[int, int] = (0, 0)
    _started_from: list[float] = field(default_factory=list)  # the shares the run started with
    _sustained: Sustained = field(default_factory=Sustained)  # agreements in a row the same rank cost the run

    def __post_init__(self) -> None:
        self._started_from = list(self.shares)

    @classmethod
    def start(cls, comm: "Communicator", every: int, remembered: dict[str, float] | None,
              executors: Sequence[str], hosts: Sequence[str], declared: Sequence[float] | None = None
              ) -> "Rebalancer":
        """Shares from the speeds a checkpoint remembers (by executor, else host; the others at their
        median), else from the declared relative speeds (launch.emulate_speed; measuring starts
        afresh), else equal."""
        world = comm.size
        speeds = remembered_speeds(remembered or {}, executors, hosts)
        if speeds is None:
            start = list(declared) if declared and len(declared) == world else [1.0] * world
            return cls(comm, every, [s / sum(start) for s in start], [0.0] * world)
        total = sum(speeds)
        return cls(comm, every, [s / total for s in speeds], list(speeds), _own_speed=speeds[comm.rank])

    def record(self, rows: int, compute_s: float) -> None:
        """This rank's rows and compute seconds of one step (waits excluded)."""
        self._rows += rows
        self._seconds += max(compute_s, 0.0)

    @property
    def loss_weight(self) -> float:
        """Factor on this rank's mean loss of the step just yielded: rows x W / the step's rows."""
        rows, global_rows = self._current
        return rows * self.comm.size / global_rows if global_rows else 1.0

    def full_step_rows(self, plan: "EpochPlan") -> list[int]:
        return split_rows(plan.rows_per_step, self.shares, self._floor(plan))

    def remembered(self, executors: Sequence[str], hosts: Sequence[str]) -> dict[str, float]:
        """What a checkpoint keeps: each rank's speed under its executor and its host."""
        kept: dict[str, float] = {}
        for rank, speed in enumerate(self.speeds):
            if speed > 0:
                kept[f"host:{hosts[rank]}"] = speed
                kept[f"executor:{executors[rank]}"] = speed
        return kept

    def take_epoch_counts(self) -> dict[str, Any]:
        counts: dict[str, Any] = {"rebalances": self.rebalances, "rows_moved": self.rows_moved}
        if self.drifted:
            counts["speed_drift"] = self.drifted  # in every later record: the driver says it once
        self.rebalances = self.rows_moved = 0
        return counts

    # -- the exchange ---------------------------------------------------------------------------
    def exchanged(self, batches: Iterator[Triple], plan: "EpochPlan", first_step: int, global_first: int
                  ) -> Iterator[Triple]:
        """This rank's batches of the epoch from `first_step` on, re-split: each yielded batch holds
        the rows this rank computes of that step. Every rank must iterate it to the end alike."""
        pending: _Exchange | None = None
        step = first_step
        for batch in batches:
            if pending is not None:
                ready = self._complete(pending)
            self._maybe_agree(global_first + step - first_step, plan)
            started = self._start(step, batch, plan)
            if pending is not None:
                yield ready
            pending, step = started, step + 1
        if pending is not None:
            yield self._complete(pending)

    def _floor(self, plan: "EpochPlan") -> int:
        return max(1, plan.rows_per_step // max(self.comm.size, 1) // FLOOR_DIVISOR)

    def _counts(self, step: int, plan: "EpochPlan") -> list[int]:
        last = step == plan.steps - 1
        return [plan.last_batch_size(r) if last else plan.batch_size(r) for r in range(self.comm.size)]

    def _maybe_agree(self, global_step: int, plan: "EpochPlan") -> None:
        """Every `every` steps: the ranks' speeds agreed in one allreduce, and perhaps a new split."""
        if global_step == 0 or (global_step % self.every and global_step not in EARLY_AGREEMENTS):
            return
        window = self._rows / self._seconds if self._seconds > 0 and self._rows > 0 else 0.0
        if window > 0:
            self._own_speed = window if self._own_speed <= 0 else \
                SMOOTHING * window + (1.0 - SMOOTHING) * self._own_speed
        self._rows = self._seconds = 0.0
        size = self.comm.size
        vector = torch.zeros(2 * size, dtype=torch.float64)  # smoothed speeds, then this window's alone
        vector[self.comm.rank], vector[size + self.comm.rank] = self._own_speed, window
        self.comm.allreduce(vector, op="sum")
        self.speeds = [float(v) for v in vector[:size]]
        # The same verdict on every rank (the agreed figures are), by executor/pace.py's rule.
        if not self._sustained.update(window_cost(self.shares, [float(v) for v in vector[size:]],
                                                  plan.rows_per_step, self._floor(plan))):
            return
        new = resplit(self.shares, self.speeds, plan.rows_per_step, self._floor(plan))
        if new is None:
            return
        if not self.drifted and self._started_from:  # said only where it changes what the run does
            from sparkdl.planner.uneven import drift

            self.drifted = drift(self._started_from, self.speeds) or ""
        self.shares = new
        self.rebalances += 1

    def _start(self, step: int, batch: Triple, plan: "EpochPlan") -> _Exchange:
        counts = self._counts(step, plan)
        targets = split_rows(sum(counts), self.shares, min(self._floor(plan), min(counts)))
        moves = transfers(counts, targets)
        self.rows_moved += sum(n for _, _, n in moves)
        me = self.comm.rank
        tensors = _tensors(batch)
        given = sum(n for source, _, n in moves if source == me)
        keep = counts[me] - given
        sends, offset = [], keep
        tag = TAG_BASE + step % TAG_BASE
        for source, destination, n in moves:
            if source == me:
                sends.append(self.comm.send(_pack(tensors, offset, n).to(self.comm.device), destination, tag))
                offset += n
        receiving = []
        for source, destination, n in moves:
            if destination == me:
                buffer = torch.empty(n * _row_bytes(tensors), dtype=torch.uint8, device=self.comm.device)
                receiving.append((source, buffer, self.comm.irecv(buffer, source, tag)))
        kept = batch if keep == counts[me] else _rows_of(batch, 0, keep)  # steady shares: nothing to cut
        return _Exchange(step, kept, receiving, sends, targets[me], sum(counts))

    def _complete(self, exchange: _Exchange) -> Triple:
        for _, _, work in exchange.receiving:
            work.wait()
        for work in exchange.sends:
            work.wait()
        self._current = (exchange.rows, exchange.global_rows)
        if not exchange.receiving:
            return exchange.kept
        template = _tensors(exchange.kept)
        parts = [template] + [_unpack(buffer.cpu(), template) for _, buffer, _ in exchange.receiving]
        joined = [torch.cat(column) for column in zip(*parts)]
        return _rebuilt(exchange.kept, joined)


def remembered_speeds(kept: dict[str, float], executors: Sequence[str], hosts: Sequence[str]
                      ) -> list[float] | None:
    """Each rank's remembered speed (its executor's, else its host's, else the median of those
    found); None when none is remembered."""
    found = [kept.get(f"executor:{e}", kept.get(f"host:{h}")) for e, h in zip(executors, hosts)]
    known = [float(s) for s in found if s]
    if not known:
        return None
    median = statistics.median(known)
    return [float(s) if s else median for s in found]


# -- a batch's rows as one byte buffer ------------------------------------------------------------
def _tensors(batch: Triple) -> list[torch.Tensor]:
    inputs, labels, weights = batch  # the rows of all three travel together
    return flat_inputs(inputs) + [labels] + ([] if weights is None else [weights])


def _rebuilt(like: Triple, tensors: list[torch.Tensor]) -> Triple:
    inputs, _, weights = like
    count = len(flat_inputs(inputs))
    rebuilt = rebuilt_inputs(input_spec(inputs), tensors[:count])
    return rebuilt, tensors[count], (tensors[count + 1] if weights is not None else None)


def _rows_of(batch: Triple, start: int, n: int) -> Triple:
    return _rebuilt(batch, [t[start: start + n] for t in _tensors(batch)])


def _row_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of one row over all the batch's tensors: the same on every rank (one layout), which is
    what lets a receiver post its buffer before anything arrives."""
    return sum((t[0].numel() if t.dim() else 1) * t.element_size() for t in tensors)


def _pack(tensors: Sequence[torch.Tensor], start: int, n: int) -> torch.Tensor:
    return torch.cat([t[start: start + n].contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def _unpack(buffer: torch.Tensor, template: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    rows = buffer.numel() // _row_bytes(template)
    out, offset = [], 0
    for t in template:
        size = rows * (t[0].numel() if t.dim() else 1) * t.element_size()
        out.append(buffer[offset: offset + size].clone().view(t.dtype).reshape((rows,) + tuple(t.shape[1:])))
        offset += size
    return out
