"""Plan: every candidate layout with its predicted cost, the one chosen, and why. Standard library
only: candidates come in as numbers (planner/cost.py), the choice and its explanation go out.

The choice: data parallel when it fits and its exposed allreduce is at most CHEAP_COMM of its compute;
otherwise the fastest predicted exact strategy (data parallel, hybrid: the update equals synchronous
training), unless an approximate one (DiLoCo, IST) is predicted at least APPROXIMATE_MIN_SPEEDUP times
faster, since those change the optimisation. This is ALGORITHMS.md's rule list: fits and
communication is cheap -> data parallel; does not fit -> hybrid (the fastest K that fits);
communication-bound -> IST for wide MLPs, otherwise DiLoCo. `decide` requires an approximate
strategy to pass that rule at both ends of the calibration (as measured, and at its optimistic end),
so one noisy calibration cannot switch the algorithm, and says what the decision hinged on.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

EXACT = ("data_parallel", "hybrid", "sharded")
APPROXIMATE_MIN_SPEEDUP = 2.0  # train.approximate_min_speedup's default
MIN_SAVING_S = 10.0  # an approximate strategy must save at least this much over the whole run
CHEAP_COMM = 0.20  # ALGORITHMS.md: data parallel when the exposed allreduce is <= 0.2 x compute
# Islands keep K DiLoCo replicas where flat DiLoCo keeps W (data parallel inside each island): closer
# to synchronous training at the same bytes across the slow links, so they are preferred among the
# approximate candidates while their step is within this factor of the fastest one.
ISLANDS_WITHIN = 1.5


class NoFeasibleLayout(ValueError):
    """Every candidate is ruled out (memory budget, backend, model shape)."""


@dataclass(frozen=True)
class Candidate:
    strategy: str  # "data_parallel", "diloco", "islands", "hybrid", "sharded" or "ist"
    options: tuple[tuple[str, Any], ...]  # the RunConfig options that select it
    predicted_step_s: float
    bytes_per_step: float
    memory_bytes: float
    feasible: bool
    reason: str  # why infeasible, or what limits it
    compute_s: float = 0.0
    comm_s: float = 0.0

    @property
    def label(self) -> str:
        shown = {k: v for k, v in self.options if k not in ("strategy", "sync")}
        if isinstance(shown.get("islands"), (list, tuple)):  # host groups: their sizes say enough here
            shown["islands"] = "+".join(str(len(group)) for group in shown["islands"]) + " hosts"
        return self.strategy + ("(" + ", ".join(f"{k}={v}" for k, v in shown.items()) + ")" if shown else "")

    def config_options(self) -> dict[str, Any]:
        return dict(self.options)


@dataclass(frozen=True)
class Plan:
    candidates: tuple[Candidate, ...]
    chosen: int
    world: int
    latency_s: float
    bandwidth_Bps: float
    emulated: bool = False
    memory_budget: float | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    executor_links: tuple[tuple[str, str, float, float], ...] = ()  # measured, for placement (empty if emulated)
    hinge: str = ""  # what the exact/approximate decision hinged on when the calibration's ends disagreed

    def __post_init__(self) -> None:
        if not 0 <= self.chosen < len(self.candidates):
            raise ValueError(f"chosen index {self.chosen} is not a candidate")
        chosen = self.candidates[self.chosen]
        if not chosen.feasible:
            raise ValueError(f"the chosen candidate {chosen.label} is not feasible: {chosen.reason}")
        stages = dict(chosen.options).get("stages", 1)
        if self.world % stages:
            raise ValueError(f"{chosen.label}: {stages} stages do not divide {self.world} workers")

    @property
    def choice(self) -> Candidate:
        return self.candidates[self.chosen]

    @property
    def strategy(self) -> str:
        return self.choice.strategy

    @property
    def options(self) -> dict[str, Any]:
        return self.choice.config_options()

    def explain(self) -> str:
        """A table of every candidate, the chosen one marked, and the reasons."""
        network = (f"{self.bandwidth_Bps * 8 / 1e9:.3g} Gbit/s, {self.latency_s * 1e3:.3g} ms latency"
                   + (" (EMULATED network)" if self.emulated else " (measured)"))
        budget = f", memory budget {_size(self.memory_budget)} per rank" if self.memory_budget else ""
        lines = [f"sparkdl plan: {self.world} workers, {network}{budget}",
                 f"chosen: {self.choice.label} - {self.choice.reason}", ""]
        header = ("", "strategy", "step (ms)", "compute", "comm", "sent/step", "memory/rank", "feasible", "why")
        rows = [header]
        for index, c in enumerate(self.candidates):
            priced = math.isfinite(c.predicted_step_s)  # a candidate ruled out before pricing shows "-"
            rows.append(("*" if index == self.chosen else "", c.label,
                         f"{c.predicted_step_s * 1e3:.2f}" if priced else "-",
                         f"{c.compute_s * 1e3:.2f}" if priced else "-", f"{c.comm_s * 1e3:.2f}" if priced else "-",
                         _size(c.bytes_per_step), _size(c.memory_bytes), "yes" if c.feasible else "no", c.reason))
        widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
        for row in rows:
            lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1])
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)

    def as_params(self) -> dict[str, str]:
        """MLflow params: the choice and its predicted terms."""
        c = self.choice
        return {"plan.choice": c.label, "plan.predicted_step_ms": f"{c.predicted_step_s * 1e3:.3f}",
                "plan.predicted_compute_ms": f"{c.compute_s * 1e3:.3f}", "plan.predicted_comm_ms": f"{c.comm_s * 1e3:.3f}",
                "plan.predicted_bytes_per_step": f"{c.bytes_per_step:.0f}",
                "plan.predicted_memory_bytes": f"{c.memory_bytes:.0f}",
                "plan.network": f"{self.bandwidth_Bps * 8 / 1e9:.4g} Gbit/s, {self.latency_s * 1e3:.4g} ms"
                                + (" (emulated)" if self.emulated else ""),
                "plan.candidates": str(len(self.candidates)), **({"plan.hinge": self.hinge} if self.hinge else {})}


def choose(candidates: list[Candidate], approximate_min_speedup: float = APPROXIMATE_MIN_SPEEDUP,
           steps: int | None = None) -> tuple[int, str]:
    """Index of the chosen candidate and the reason, from one calibration; ValueError when none is
    feasible.

    An approximate strategy (DiLoCo, IST) must be predicted at least `approximate_min_speedup` times
    faster than the best feasible exact one: it changes the optimisation (typically a little accuracy
    per step for far fewer bytes), which only a large speed-up pays for. With 1.0, the fastest wins.
    When the run's `steps` are known and the approximate one would save less than MIN_SAVING_S over
    the whole run, the exact one is kept whatever the speed-up: a few seconds do not pay for a
    different optimisation (nor for the calibration job that priced it)."""
    feasible = [i for i, c in enumerate(candidates) if c.feasible]
    if not feasible:
        raise NoFeasibleLayout("no candidate layout is feasible")
    approximate = [i for i in feasible if candidates[i].strategy not in EXACT]
    best_approx = best_approximate(candidates, approximate)
    v = verdict(candidates, best_approx if best_approx is not None else feasible[0], approximate_min_speedup, steps)
    if v.cheap is not None:
        # IST may still predict a shorter step, but only by training a subnet: not worth it here.
        c = candidates[v.cheap]
        return v.cheap, (f"fits, and its exposed allreduce ({c.comm_s * 1e3:.2f} ms) is at most "
                         f"{CHEAP_COMM:.0%} of compute ({c.compute_s * 1e3:.2f} ms)")
    if v.exact is None:
        c = candidates[best_approx]  # type: ignore[index]
        return best_approx, (f"fastest predicted step ({c.predicted_step_s * 1e3:.2f} ms); "  # type: ignore[return-value]
                             "no exact strategy is feasible")
    e = candidates[v.exact]
    if best_approx is not None:
        a = candidates[best_approx]
        if v.passes and a.strategy == "islands":
            fastest = min(candidates[i].predicted_step_s for i in approximate)
            return best_approx, (f"data parallel inside islands, DiLoCo across: {a.predicted_step_s * 1e3:.2f} ms, "
                                 f"{v.speedup:.1f}x the best exact strategy ({e.label}), within {ISLANDS_WITHIN:g}x "
                                 f"of the fastest approximate step ({fastest * 1e3:.2f} ms) with fewer DiLoCo "
                                 "replicas (closer to synchronous training)")
        if v.passes:
            return best_approx, (f"fastest predicted step ({a.predicted_step_s * 1e3:.2f} ms), {v.speedup:.1f}x the "
                                 f"best exact strategy ({e.label}, {e.predicted_step_s * 1e3:.2f} ms), which is "
                                 "communication-bound")
        if v.speedup >= approximate_min_speedup:
            return v.exact, (f"exact updates; {a.label} is {v.speedup:.1f}x faster per step but would save only "
                             f"{v.saving_s:.1f} s over the run's {steps} steps: too short to pay off")
        if v.speedup > 1:
            return v.exact, (f"exact updates; {a.label} is predicted only {v.speedup:.2f}x faster "
                             f"(approximate strategies need >= {approximate_min_speedup:g}x)")
    return v.exact, f"fastest predicted step ({e.predicted_step_s * 1e3:.2f} ms), exact updates"


def best_approximate(candidates: list[Candidate], approximate: list[int]) -> int | None:
    """The fastest approximate candidate, or an islands one within ISLANDS_WITHIN of it."""
    if not approximate:
        return None
    fastest = min(approximate, key=lambda i: candidates[i].predicted_step_s)
    islands = [i for i in approximate if candidates[i].strategy == "islands"]
    if islands:
        best = min(islands, key=lambda i: candidates[i].predicted_step_s)
        if candidates[best].predicted_step_s <= ISLANDS_WITHIN * candidates[fastest].predicted_step_s:
            return best
    return fastest


@dataclass(frozen=True)
class Verdict:
    """Whether approximate candidate `index` pays off under one calibration, and against what."""

    index: int
    passes: bool
    speedup: float  # the best exact step over this one's
    saving_s: float  # over the run (inf: steps unknown)
    exact: int | None  # the best feasible exact candidate
    cheap: int | None  # a data-parallel candidate whose communication is cheap (exact wins outright)

    def why_not(self, candidates: list[Candidate], end: str, approximate_min_speedup: float) -> str:
        """Why it does not pay off at this end of the calibration (a clause for a reason)."""
        if self.cheap is not None:
            c = candidates[self.cheap]
            return (f"at the {end} end data parallel's allreduce is cheap ({c.comm_s * 1e3:.2f} ms, at most "
                    f"{CHEAP_COMM:.0%} of its {c.compute_s * 1e3:.2f} ms compute)")
        if self.speedup < approximate_min_speedup:
            return f"only {self.speedup:.1f}x at the {end} end"
        return f"at the {end} end it would save only {self.saving_s:.1f} s over the run"


def verdict(candidates: list[Candidate], index: int, approximate_min_speedup: float = APPROXIMATE_MIN_SPEEDUP,
            steps: int | None = None) -> Verdict:
    """choose's rule for one approximate candidate: no cheap data parallel, >= approximate_min_speedup
    times the best exact step, >= MIN_SAVING_S saved over the run (or no exact candidate at all)."""
    feasible = [i for i, c in enumerate(candidates) if c.feasible]
    cheap = [i for i in feasible if candidates[i].strategy == "data_parallel"
             and candidates[i].comm_s <= CHEAP_COMM * candidates[i].compute_s]
    exact = [i for i in feasible if candidates[i].strategy in EXACT]
    best_cheap = min(cheap, key=lambda i: candidates[i].predicted_step_s) if cheap else None
    if not exact:
        return Verdict(index, True, math.inf, math.inf, None, best_cheap)
    best = min(exact, key=lambda i: candidates[i].predicted_step_s)
    e, a = candidates[best], candidates[index]
    speedup = e.predicted_step_s / a.predicted_step_s if a.predicted_step_s > 0 else math.inf
    saving_s = (e.predicted_step_s - a.predicted_step_s) * steps if steps else math.inf
    passes = best_cheap is None and speedup >= approximate_min_speedup and saving_s >= MIN_SAVING_S
    return Verdict(index, passes, speedup, saving_s, best, best_cheap)


@dataclass(frozen=True)
class Decision:
    index: int
    reason: str
    hinge: str = ""  # when the calibration's two ends disagreed on exact vs approximate: why, and on what


def decide(measured: list[Candidate], optimistic: list[Candidate] | None = None,
           approximate_min_speedup: float = APPROXIMATE_MIN_SPEEDUP, steps: int | None = None) -> Decision:
    """choose, made robust to a noisy calibration: `optimistic` holds the same candidates (same
    order) priced at the calibration's optimistic end (best times, fastest ranks). An approximate
    strategy is taken only when it passes choose's rule at both ends; otherwise the measured end's
    best exact one is kept and the reason says what the decision hinged on (the network or the
    compute term: the one whose optimistic figure alone flips the verdict)."""
    index, reason = choose(measured, approximate_min_speedup, steps)
    if optimistic is None:
        return Decision(index, reason)
    if [c.label for c in optimistic] != [c.label for c in measured]:
        raise ValueError("the two ends of the calibration must price the same candidates")
    o_index, _ = choose(optimistic, approximate_min_speedup, steps)
    m_exact, o_exact = measured[index].strategy in EXACT, optimistic[o_index].strategy in EXACT
    if m_exact and (o_exact or not any(c.feasible and c.strategy in EXACT for c in optimistic)):
        return Decision(index, reason)
    if m_exact:  # only the optimistic end favours an approximate strategy: exact kept, as measured
        o = verdict(optimistic, o_index, approximate_min_speedup, steps)
        m = verdict(measured, o_index, approximate_min_speedup, steps)
        a = optimistic[o_index]
        hinge = (f"{a.label} is {o.speedup:.1f}x faster at the optimistic end but "
                 f"{m.why_not(measured, 'measured', approximate_min_speedup)}; "
                 f"{_term(measured, optimistic, o_index, approximate_min_speedup, steps)}")
        return Decision(index, f"{reason}; {hinge}: kept exact", hinge)
    m = verdict(measured, index, approximate_min_speedup, steps)
    if m.exact is None:
        return Decision(index, reason)  # nothing exact is feasible: no decision to hinge on
    exact = m.exact
    both = [i for i, c in sorted(enumerate(measured), key=lambda ic: ic[1].predicted_step_s)
            if c.feasible and c.strategy not in EXACT and verdict(measured, i, approximate_min_speedup, steps).passes
            and verdict(optimistic, i, approximate_min_speedup, steps).passes]
    if both:
        i = index if index in both else both[0]  # the measured end's choice stands when it passes at both
        o = verdict(optimistic, i, approximate_min_speedup, steps)
        if i == index:
            return Decision(i, f"{reason}; {o.speedup:.1f}x at the calibration's optimistic end too")
        m_i = verdict(measured, i, approximate_min_speedup, steps)
        return Decision(i, f"{m_i.speedup:.1f}x the best exact strategy at the measured end and {o.speedup:.1f}x at "
                           f"the optimistic end ({measured[index].label} is faster only at the measured end)")
    o = verdict(optimistic, index, approximate_min_speedup, steps)
    a, e = measured[index], measured[exact]
    hinge = (f"{a.label} is {m.speedup:.1f}x faster at the measured end but "
             f"{o.why_not(optimistic, 'optimistic', approximate_min_speedup)}; "
             f"{_term(measured, optimistic, index, approximate_min_speedup, steps)}")
    return Decision(exact, f"exact updates ({e.predicted_step_s * 1e3:.2f} ms); {hinge}: kept exact", hinge)


def _term(measured: list[Candidate], optimistic: list[Candidate], index: int, approximate_min_speedup: float,
          steps: int | None) -> str:
    """Which term of the step time the verdict on candidate `index` hinges on (a clause): price every
    candidate with one term from each end (step = compute + comm) and see which swap alone flips it."""
    def mixed(compute_from: list[Candidate], comm_from: list[Candidate]) -> bool:
        priced = [Candidate(**{**c.__dict__, "compute_s": k.compute_s, "comm_s": n.comm_s,
                               "predicted_step_s": k.compute_s + n.comm_s})
                  for c, k, n in zip(measured, compute_from, comm_from)]
        return verdict(priced, index, approximate_min_speedup, steps).passes

    at_optimistic = verdict(optimistic, index, approximate_min_speedup, steps).passes
    network = mixed(measured, optimistic) == at_optimistic  # measured compute, optimistic network
    compute = mixed(optimistic, measured) == at_optimistic
    if network and not compute:
        return "the network term decides"
    if compute and not network:
        return "the compute term decides"
    return "either term alone decides" if network else "the network and compute terms decide together"


def _size(nbytes: float | None) -> str:
    if nbytes is None or not math.isfinite(nbytes):
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"
