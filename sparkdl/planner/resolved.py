"""ResolvedPlan: everything about a run's parallel layout, decided once on the driver (as torchtitan's
ParallelDims): the strategy, the training options that select it, the typed layout a strategy places
itself with, the MLflow params describing it and, under strategy="auto", the planner's priced
candidates. `planning.resolve` builds it; a fit trains with exactly it; `sparkdl.plan` returns it.

It is also a value users keep: `to_json()` is the MLflow artifact plan.json, and
`TorchEstimator(..., plan=...)` or `plan_from_run=<MLflow run id>` trains with that layout without
planning again. Standard library only (and sparkdl's stdlib-only modules), so a plan reads back
without torch or Spark.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping

from sparkdl.config import TrainConfig
from sparkdl.errors import ConfigError
from sparkdl.model.layouts import EmbeddingLayout, HybridLayout, IstLayout, StrategyLayout
from sparkdl.planner.plan import Candidate, Plan

PLAN_FORMAT = 1
# The train options that select a layout; a kept plan sets exactly these on the run it is reused for.
LAYOUT_OPTIONS = ("strategy", "sync", "sync_every", "stages", "microbatches", "schedule", "batch_balance",
                  "rebalance_every",
                  "ist_sync_every", "ist_scale", "sync_dtype", "fragments", "fragment_sync_delay",
                  "fragment_update_alpha", "islands")


@dataclass(frozen=True)
class ResolvedPlan:
    strategy: str  # the algorithm: "data_parallel", "diloco", "islands", "hybrid" or "ist"
    settings: tuple[tuple[str, Any], ...]  # LAYOUT_OPTIONS of the train section, as the run uses them
    world: int  # num_workers the layout is for
    layout: StrategyLayout = None  # HybridLayout / IstLayout, None for data parallel
    params: tuple[tuple[str, str], ...] = ()  # MLflow params describing the layout and the planner's choice
    auto: Plan | None = None  # the planner's priced candidates (strategy="auto"), else None
    # The run's final train section (the user's, with `options` merged in; the plan changes no other
    # section); not part of the value a user keeps: a kept plan is applied to the run that reuses it.
    train: TrainConfig | None = field(default=None, compare=False, repr=False)

    @classmethod
    def build(cls, train: TrainConfig, world: int, layout: StrategyLayout, params: Mapping[str, str],
              auto: Plan | None = None) -> "ResolvedPlan":
        strategy = "diloco" if train.strategy == "data_parallel" and train.sync == "diloco" else train.strategy
        strategy = "islands" if strategy == "diloco" and train.islands else strategy
        settings = tuple((name, getattr(train, name)) for name in LAYOUT_OPTIONS)
        return cls(strategy=strategy, settings=settings, world=world, layout=layout,
                   params=tuple(sorted((str(k), str(v)) for k, v in params.items())), auto=auto, train=train)

    # -- what sparkdl.plan users read (the planner's Plan reads the same) ----------------------------
    @property
    def candidates(self) -> tuple[Candidate, ...]:
        return self.auto.candidates if self.auto is not None else ()

    @property
    def choice(self) -> Candidate | None:
        return self.auto.choice if self.auto is not None else None

    @property
    def options(self) -> dict[str, Any]:
        """The train options that name this choice, as the planner's candidates show them (e.g.
        {"strategy": "ist", "ist_sync_every": 30}); `settings` holds every layout option."""
        if self.auto is not None:
            return self.auto.options
        settings = dict(self.settings)
        named = {"strategy": settings["strategy"]}
        if self.strategy in ("data_parallel", "diloco", "islands"):
            named["sync"] = settings.get("sync", "allreduce")
        named.update({k: v for k, v in self.settings if _shown(self.strategy, k)
                      and not (k == "batch_balance" and v == "equal")
                      and not (k == "rebalance_every" and settings.get("batch_balance") != "dynamic")})
        return named

    def as_params(self) -> dict[str, str]:
        return dict(self.params)

    def explain(self) -> str:
        """The planner's table (under "auto"), then the layout this run trains with."""
        lines = [self.auto.explain(), ""] if self.auto is not None else \
            [f"sparkdl plan: {self.world} workers, strategy {self.strategy} (named, not planned)"]
        lines.append(f"layout: {self.strategy} " + ", ".join(f"{k}={v}" for k, v in self.settings
                                                             if _shown(self.strategy, k)))
        if isinstance(self.layout, HybridLayout):
            lines.append(f"hybrid: {self.layout.stages} stages x {self.layout.replicas} replicas, layer cuts "
                         f"{list(self.layout.cuts)}, {self.layout.microbatches} micro-batches ({self.layout.schedule}), "
                         f"grid {[list(r) for r in self.layout.grid]}"
                         + (" (placed on measured links at run time)" if self.layout.executor_links else ""))
        elif isinstance(self.layout, IstLayout):
            lines.append(f"ist: hidden widths {list(self.layout.widths)}, {self.layout.world} subnets, "
                         f"re-drawn every {self.layout.sync_every} steps")
        elif isinstance(self.layout, EmbeddingLayout):
            if self.layout.decision:
                lines += [self.layout.decision, ""]
            where = "replicated on every rank (whole gradients allreduced)" if self.layout.replicated else \
                f"sharded over {self.world} ranks (all-to-all lookups)"
            lines.append(f"embeddings: tables {where}, "
                         f"{self.layout.optimizer} (lr {self.layout.lr:g}) where the rows live, ".replace("(lr 0)", "(its default lr)")
                         + ("synchronous (exact)" if not self.layout.staleness else
                            f"updates up to {self.layout.staleness} steps late") + "; dense layers data parallel")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()

    # -- a value to keep ------------------------------------------------------------------------
    def to_json(self) -> str:
        layout: dict[str, Any] | None = None
        if self.layout is not None:
            layout = {"kind": _LAYOUT_KINDS[type(self.layout)], **asdict(self.layout)}
        return json.dumps(_finite({"format": PLAN_FORMAT, "strategy": self.strategy, "world": self.world,
                                   "options": dict(self.settings), "layout": layout, "params": dict(self.params),
                                   "auto": asdict(self.auto) if self.auto is not None else None}),
                          indent=1, allow_nan=False)

    @classmethod
    def from_json(cls, text: str | bytes) -> "ResolvedPlan":
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
                raise ValueError(f"format {data.get('format') if isinstance(data, dict) else '?'} is not "
                                 f"{PLAN_FORMAT}")
            return cls(strategy=str(data["strategy"]), world=int(data["world"]),
                       settings=tuple((k, v) for k, v in data["options"].items() if k in LAYOUT_OPTIONS),
                       layout=_layout_from(data.get("layout")),
                       params=tuple(sorted((str(k), str(v)) for k, v in data.get("params", {}).items())),
                       auto=_plan_from(data.get("auto")))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"this is not a sparkdl plan (plan.json): {type(exc).__name__}: {exc}",
                              hint="pass the ResolvedPlan sparkdl.plan() returned, its to_json() text, or "
                                   "plan_from_run=<the MLflow run id of a sparkdl fit>") from None


def _shown(strategy: str, option: str) -> bool:
    """The options worth showing for a strategy (the others keep their defaults and do nothing)."""
    relevant = {"data_parallel": {"batch_balance", "rebalance_every"}, "sharded": {"batch_balance", "rebalance_every"},
                "diloco": {"sync_every", "sync_dtype", "fragments", "fragment_sync_delay", "fragment_update_alpha"},
                "islands": {"sync_every", "sync_dtype", "fragments", "fragment_sync_delay", "fragment_update_alpha",
                            "islands"},
                "hybrid": {"stages", "microbatches", "schedule"}, "ist": {"ist_sync_every", "ist_scale"}}
    return option in relevant.get(strategy, set())


_NON_FINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _finite(value: Any) -> Any:
    """Strict JSON (jq, MLflow's viewer): an infeasible candidate's infinite cost becomes "inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _number(value: Any) -> Any:
    return _NON_FINITE.get(value, value) if isinstance(value, str) else value


def _tuples(value: Any) -> Any:
    """JSON lists back into the nested tuples the frozen layouts hold."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


_LAYOUT_KINDS: dict[type, str] = {HybridLayout: "hybrid", IstLayout: "ist", EmbeddingLayout: "embeddings"}


def _layout_from(data: dict[str, Any] | None) -> StrategyLayout:
    if data is None:
        return None
    kind = data.pop("kind")
    target = {kind: cls for cls, kind in _LAYOUT_KINDS.items()}[kind]
    names = {f.name for f in fields(target)}
    return target(**{k: _tuples(v) for k, v in data.items() if k in names})


def _plan_from(data: dict[str, Any] | None) -> Plan | None:
    if data is None:
        return None
    candidates = tuple(Candidate(**{k: _tuples(v) if k == "options" else _number(v) for k, v in c.items()})
                       for c in data["candidates"])
    names = {f.name for f in fields(Plan)}
    rest = {k: _number(_tuples(v)) for k, v in data.items() if k in names and k != "candidates"}
    return Plan(candidates=candidates, **rest)
