"""Plan: every candidate layout with its predicted cost, the one chosen, and why. Standard library
only: candidates come in as numbers (planner/cost.py), the choice and its explanation go out.

The choice is by predicted time to data parallel's loss, not time per step (ALGORITHMS.md,
"Choosing by time to loss"): time_to_loss(c) = k(c) x steps x step(c), k = 1 for exact strategies
(data parallel, hybrid, sharded: the update equals synchronous training) and k >= 1 for approximate
ones (DiLoCo and its forms, islands, IST; planner/steps_to_loss.py states k). Data parallel when it
fits and its exposed allreduce is at most CHEAP_COMM of its compute; otherwise the best exact strategy
(data parallel when within CLOSE_CALL of the fastest exact step), unless an approximate one reaches
the loss at least 1 + CLOSE_CALL times sooner (and approximate_min_speedup times, when the user asks
for more) and saves MIN_SAVING_S over the run. `decide` requires that at both ends of the calibration
(as measured, and at its optimistic end), so a close call or one that flips across the calibration's
range goes to the exact strategy, and repeated plans of a run on the same hosts choose alike.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

EXACT = ("data_parallel", "hybrid", "sharded")
# train.approximate_min_speedup's default: no margin beyond CLOSE_CALL. It was 2.0 on the step time
# alone; k (planner/steps_to_loss.py) now prices what an approximate strategy costs in steps.
APPROXIMATE_MIN_SPEEDUP = 1.0
# A choice whose predicted times (to loss, or per step among exact ones) differ by less than this is
# a close call: it goes to the exact strategy, among exact ones to data parallel. The planner's step
# predictions are off by 25 % and more on loaded hosts (issue 53): a smaller edge is noise.
CLOSE_CALL = 0.15
LAYOUT_TIE = 0.05  # exact layouts this close in predicted step are a tie: the first listed runs
MIN_SAVING_S = 10.0  # an approximate strategy must save at least this much over the whole run
CHEAP_COMM = 0.20  # ALGORITHMS.md: data parallel when the exposed allreduce is <= 0.2 x compute
# Islands keep K DiLoCo replicas where flat DiLoCo keeps W (data parallel inside each island): closer
# to synchronous training at the same bytes across the slow links, so they are preferred among the
# approximate candidates while their time to loss is within this factor of the shortest one.
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
    steps_factor: float = 1.0  # k: steps to data parallel's loss / data parallel's (planner/steps_to_loss.py)
    steps_rule: str = ""  # how k was reached

    def __post_init__(self) -> None:
        if not self.steps_factor >= 1.0:  # NaN too: a strategy never reaches the loss in fewer steps than DP
            raise ValueError(f"{self.strategy}: steps_factor must be >= 1, got {self.steps_factor!r}")

    @property
    def to_loss_s(self) -> float:
        """Predicted time to data parallel's loss per data-parallel step: k x step."""
        return self.steps_factor * self.predicted_step_s

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
    steps: int | None = None  # the run's data-parallel steps, when its rows are known (time to loss in s)

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
        header = ("", "strategy", "step (ms)", "compute", "comm", "k", to_loss_header(self.steps), "sent/step",
                  "memory/rank", "feasible", "why")
        rows = [header]
        for index, c in enumerate(self.candidates):
            priced = math.isfinite(c.predicted_step_s)  # a candidate ruled out before pricing shows "-"
            rows.append(("*" if index == self.chosen else "", c.label,
                         f"{c.predicted_step_s * 1e3:.2f}" if priced else "-",
                         f"{c.compute_s * 1e3:.2f}" if priced else "-", f"{c.comm_s * 1e3:.2f}" if priced else "-",
                         f"{c.steps_factor:.2f}", to_loss_cell(c, self.steps) if priced else "-",
                         _size(c.bytes_per_step), _size(c.memory_bytes), "yes" if c.feasible else "no", c.reason))
        widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
        for row in rows:
            lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1])
        rules = sorted({f"k={c.steps_factor:.2f} for {c.label}: {c.steps_rule}" for c in self.candidates
                        if c.steps_rule and c.feasible})
        lines += [f"steps to data parallel's loss: {rule}" for rule in rules]
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
                "plan.steps_factor": f"{c.steps_factor:.3f}",
                "plan.predicted_to_loss": to_loss_cell(c, self.steps) + (" s" if self.steps else " ms/DP step"),
                "plan.candidates": str(len(self.candidates)), **({"plan.hinge": self.hinge} if self.hinge else {})}


def to_loss_header(steps: int | None) -> str:
    return "to loss (s)" if steps else "to loss (ms/DP step)"


def to_loss_cell(c: Candidate, steps: int | None) -> str:
    """Predicted time to data parallel's loss: seconds over the run's steps, else ms per DP step."""
    return f"{c.to_loss_s * steps:.1f}" if steps else f"{c.to_loss_s * 1e3:.2f}"


def needed_speedup(approximate_min_speedup: float) -> float:
    """How many times sooner an approximate strategy must reach the loss: past the close-call band,
    and at least what the user asks for (train.approximate_min_speedup)."""
    return max(1.0 + CLOSE_CALL, approximate_min_speedup)


def choose(candidates: list[Candidate], approximate_min_speedup: float = APPROXIMATE_MIN_SPEEDUP,
           steps: int | None = None) -> tuple[int, str]:
    """Index of the chosen candidate and the reason, from one calibration; ValueError when none is
    feasible.

    An approximate strategy (DiLoCo, islands, IST) is taken when its predicted time to data
    parallel's loss (k x its step) is at least needed_speedup(...) times shorter than the best exact
    one's: its steps may be cheaper, but it needs k times as many. A closer call keeps exact updates.
    When the run's `steps` are known and it would save less than MIN_SAVING_S over the whole run, the
    exact one is kept too: a few seconds do not pay for a different optimisation."""
    feasible = [i for i, c in enumerate(candidates) if c.feasible]
    if not feasible:
        raise NoFeasibleLayout("no candidate layout is feasible")
    approximate = [i for i in feasible if candidates[i].strategy not in EXACT]
    best_approx = best_approximate(candidates, approximate)
    needed = needed_speedup(approximate_min_speedup)
    v = verdict(candidates, best_approx if best_approx is not None else feasible[0], approximate_min_speedup, steps)
    if v.cheap is not None:
        # IST may still predict a shorter step, but only by training a subnet: not worth it here.
        c = candidates[v.cheap]
        return v.cheap, (f"fits, and its exposed allreduce ({c.comm_s * 1e3:.2f} ms) is at most "
                         f"{CHEAP_COMM:.0%} of compute ({c.compute_s * 1e3:.2f} ms)")
    if v.exact is None:
        c = candidates[best_approx]  # type: ignore[index]
        return best_approx, (f"shortest predicted time to loss ({c.predicted_step_s * 1e3:.2f} ms steps, "  # type: ignore[return-value]
                             f"k={c.steps_factor:.2f}); no exact strategy is feasible")
    e = candidates[v.exact]
    if best_approx is not None:
        a = candidates[best_approx]
        terms = _terms(a, candidates[v.fastest_exact])
        if v.passes and a.strategy == "islands":
            fastest = min(candidates[i].to_loss_s for i in approximate)
            return best_approx, (f"data parallel inside islands, DiLoCo across: reaches the loss {v.speedup:.1f}x "
                                 f"sooner than the best exact strategy ({terms}), within {ISLANDS_WITHIN:g}x of the "
                                 f"shortest approximate time to loss ({fastest * 1e3:.2f} ms/DP step) with fewer "
                                 "DiLoCo replicas (closer to synchronous training)")
        if v.passes:
            return best_approx, (f"reaches data parallel's loss {v.speedup:.1f}x sooner than the best exact strategy "
                                 f"({terms}), which is communication-bound")
        if v.speedup >= needed:
            return v.exact, (f"exact updates; {a.label} would reach the loss {v.speedup:.1f}x sooner but save only "
                             f"{v.saving_s:.1f} s over the run's {steps} steps: too short to pay off")
        if a.predicted_step_s < candidates[v.fastest_exact].predicted_step_s:
            return v.exact, (f"exact updates; {a.label} would reach the loss only {v.speedup:.2f}x sooner ({terms}); "
                             f"an approximate strategy needs >= {needed:.2f}x (a closer call goes to exact)")
    return v.exact, _exact_reason(candidates, v.exact, v.fastest_exact)


def _terms(a: Candidate, e: Candidate) -> str:
    """'6.0x cheaper steps, k=2.30x the steps' against exact candidate `e`."""
    cheaper = e.predicted_step_s / a.predicted_step_s if a.predicted_step_s > 0 else math.inf
    return (f"{cheaper:.2f}x cheaper steps than {e.label}'s {e.predicted_step_s * 1e3:.2f} ms, "
            f"k={a.steps_factor:.2f}x the steps")


def _exact_reason(candidates: list[Candidate], index: int, fastest: int) -> str:
    c = candidates[index]
    if index == fastest:
        return f"fastest predicted step ({c.predicted_step_s * 1e3:.2f} ms), exact updates"
    f = candidates[fastest]
    return (f"exact updates; {c.predicted_step_s * 1e3:.2f} ms, within {CLOSE_CALL:.0%} of {f.label}'s "
            f"{f.predicted_step_s * 1e3:.2f} ms: a close call goes to data parallel")


def best_approximate(candidates: list[Candidate], approximate: list[int]) -> int | None:
    """The approximate candidate of shortest time to loss, or an islands one within ISLANDS_WITHIN of it.
    Candidates within CLOSE_CALL of the shortest are a tie, which goes to the one needing the fewest
    extra steps (smallest k: its time rests least on its cheap step), then to the one listed first:
    DiLoCo and IST 6 % apart at 20 Mbit/s had flipped between two plans of one run on the bed."""
    if not approximate:
        return None
    fastest = min(approximate, key=lambda i: candidates[i].to_loss_s)
    islands = [i for i in approximate if candidates[i].strategy == "islands"]
    if islands:
        best = min(islands, key=lambda i: candidates[i].to_loss_s)
        if candidates[best].to_loss_s <= ISLANDS_WITHIN * candidates[fastest].to_loss_s:
            return best
    tied = [i for i in approximate if candidates[i].to_loss_s <= (1 + CLOSE_CALL) * candidates[fastest].to_loss_s]
    return min(tied, key=lambda i: (candidates[i].steps_factor, i))


def best_exact(candidates: list[Candidate], exact: list[int]) -> tuple[int, int]:
    """(the exact candidate to run, the fastest exact one): data parallel when its step is within
    CLOSE_CALL of the fastest (the simplest layout, and the same on every plan of a run)."""
    fastest = min(exact, key=lambda i: candidates[i].predicted_step_s)
    dp = [i for i in exact if candidates[i].strategy == "data_parallel"]
    if dp:
        best_dp = min(dp, key=lambda i: candidates[i].predicted_step_s)
        if candidates[best_dp].predicted_step_s <= (1 + CLOSE_CALL) * candidates[fastest].predicted_step_s:
            return best_dp, fastest
    # Near-ties between other exact layouts (a pipeline's microbatch counts 2.5 % apart) go to the one
    # listed first, not to whichever noise made faster: repeated plans of a run then agree.
    tied = [i for i in exact if candidates[i].predicted_step_s <= (1 + LAYOUT_TIE) * candidates[fastest].predicted_step_s]
    return min(tied), fastest


@dataclass(frozen=True)
class Verdict:
    """Whether approximate candidate `index` pays off under one calibration, and against what."""

    index: int
    passes: bool
    speedup: float  # the fastest exact candidate's time to loss over this one's
    saving_s: float  # over the run (inf: steps unknown)
    exact: int | None  # the exact candidate that would run (best_exact)
    cheap: int | None  # a data-parallel candidate whose communication is cheap (exact wins outright)
    fastest_exact: int = -1  # the exact candidate of shortest step, compared against

    def why_not(self, candidates: list[Candidate], end: str, approximate_min_speedup: float) -> str:
        """Why it does not pay off at this end of the calibration (a clause for a reason)."""
        if self.cheap is not None:
            c = candidates[self.cheap]
            return (f"at the {end} end data parallel's allreduce is cheap ({c.comm_s * 1e3:.2f} ms, at most "
                    f"{CHEAP_COMM:.0%} of its {c.compute_s * 1e3:.2f} ms compute)")
        if self.speedup < needed_speedup(approximate_min_speedup):
            return f"only {self.speedup:.1f}x sooner to the loss at the {end} end"
        return f"at the {end} end it would save only {self.saving_s:.1f} s over the run"


def verdict(candidates: list[Candidate], index: int, approximate_min_speedup: float = APPROXIMATE_MIN_SPEEDUP,
            steps: int | None = None) -> Verdict:
    """choose's rule for one approximate candidate: no cheap data parallel, its time to loss at least
    needed_speedup(...) times shorter than the fastest exact one's, >= MIN_SAVING_S saved over the
    run (or no exact candidate at all)."""
    feasible = [i for i, c in enumerate(candidates) if c.feasible]
    cheap = [i for i in feasible if candidates[i].strategy == "data_parallel"
             and candidates[i].comm_s <= CHEAP_COMM * candidates[i].compute_s]
    exact = [i for i in feasible if candidates[i].strategy in EXACT]
    best_cheap = min(cheap, key=lambda i: candidates[i].predicted_step_s) if cheap else None
    if not exact:
        return Verdict(index, True, math.inf, math.inf, None, best_cheap)
    chosen, fastest = best_exact(candidates, exact)
    e, a = candidates[fastest], candidates[index]
    speedup = e.to_loss_s / a.to_loss_s if a.to_loss_s > 0 else math.inf
    saving_s = (e.to_loss_s - a.to_loss_s) * steps if steps else math.inf
    passes = best_cheap is None and speedup >= needed_speedup(approximate_min_speedup) and saving_s >= MIN_SAVING_S
    return Verdict(index, passes, speedup, saving_s, chosen, best_cheap, fastest)


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
    compute term: the one whose optimistic figure alone flips the verdict). Exact choices that
    differ between the ends go to data parallel when one of them is data parallel."""
    index, reason = choose(measured, approximate_min_speedup, steps)
    if optimistic is None:
        return Decision(index, reason)
    if [c.label for c in optimistic] != [c.label for c in measured]:
        raise ValueError("the two ends of the calibration must price the same candidates")
    o_index, _ = choose(optimistic, approximate_min_speedup, steps)
    m_exact, o_exact = measured[index].strategy in EXACT, optimistic[o_index].strategy in EXACT
    if m_exact and o_exact and o_index != index and measured[index].strategy != "data_parallel" \
            and optimistic[o_index].strategy == "data_parallel" and measured[o_index].feasible:
        o = optimistic[o_index]
        return Decision(o_index, f"exact updates; the calibration's ends disagree ({measured[index].label} as "
                                 f"measured, {o.label} at the optimistic end): a close call goes to data parallel")
    if m_exact and (o_exact or not any(c.feasible and c.strategy in EXACT for c in optimistic)):
        return Decision(index, reason)
    if m_exact:  # only the optimistic end favours an approximate strategy: exact kept, as measured
        return _kept_exact(measured, optimistic, index, o_index, reason, approximate_min_speedup, steps)
    m = verdict(measured, index, approximate_min_speedup, steps)
    if m.exact is None:
        return Decision(index, reason)  # nothing exact is feasible: no decision to hinge on
    exact = m.exact
    both = [i for i, c in sorted(enumerate(measured), key=lambda ic: ic[1].to_loss_s)
            if c.feasible and c.strategy not in EXACT and verdict(measured, i, approximate_min_speedup, steps).passes
            and verdict(optimistic, i, approximate_min_speedup, steps).passes]
    if both:
        i = index if index in both else both[0]  # the measured end's choice stands when it passes at both
        o = verdict(optimistic, i, approximate_min_speedup, steps)
        if i == index:
            return Decision(i, f"{reason}; {o.speedup:.1f}x sooner at the calibration's optimistic end too")
        m_i = verdict(measured, i, approximate_min_speedup, steps)
        return Decision(i, f"reaches the loss {m_i.speedup:.1f}x sooner than the best exact strategy at the measured "
                           f"end and {o.speedup:.1f}x at the optimistic end ({measured[index].label} is sooner only "
                           "at the measured end)")
    o = verdict(optimistic, index, approximate_min_speedup, steps)
    a, e = measured[index], measured[exact]
    hinge = (f"{a.label} reaches the loss {m.speedup:.1f}x sooner at the measured end but "
             f"{o.why_not(optimistic, 'optimistic', approximate_min_speedup)}; "
             f"{_term(measured, optimistic, index, approximate_min_speedup, steps)}")
    return Decision(exact, f"exact updates ({e.predicted_step_s * 1e3:.2f} ms); {hinge}: kept exact", hinge)


def _kept_exact(measured: list[Candidate], optimistic: list[Candidate], index: int, o_index: int, reason: str,
                approximate_min_speedup: float, steps: int | None) -> Decision:
    """Only the optimistic end favours approximate candidate `o_index`: the measured end's exact
    choice `index` stands, and the reason says on what that hinged."""
    o = verdict(optimistic, o_index, approximate_min_speedup, steps)
    m = verdict(measured, o_index, approximate_min_speedup, steps)
    a = optimistic[o_index]
    hinge = (f"{a.label} reaches the loss {o.speedup:.1f}x sooner at the optimistic end but "
             f"{m.why_not(measured, 'measured', approximate_min_speedup)}; "
             f"{_term(measured, optimistic, o_index, approximate_min_speedup, steps)}")
    return Decision(index, f"{reason}; {hinge}: kept exact", hinge)


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
