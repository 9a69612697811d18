"""Replicated or sharded embedding tables: which costs less per step on the measured link, given how
often the ids repeat (issue 45, item 5). Imports only the standard library and stdlib-only sparkdl
modules (placement.py, cost.py, errors.py; importing placement.py still runs sparkdl/embeddings/__init__,
which loads torch today): measurements come in as numbers, a frozen EmbeddingDecision and its explain()
text come out. Not wired into fit yet.

Replicated: every rank holds every table, its gradient and optimizer state, and every step allreduces
every table's whole gradient (dense) with one "touched on some rank" flag per row in the same buffer
(embeddings/replicated.py): T = T_AR(sum_t 4 N_t (D_t + 1)), whatever rows the batch touched.
Sharded (embeddings/sharded.py): each rank holds its rows (placement.py: row-wise blocks or whole
tables) and a step runs four all-to-alls, counts (8 T bytes to every peer), the distinct touched ids
(int64) to their owners, their rows back (4 D bytes each) and the rows' gradients to the owners again:
T = sum over the four of max_r (m_r a + max(out_r, in_r) / b), with m_r the messages rank r sends
(W-1 for row-wise tables; a table-wise table's requests and gradients go to its owner alone, its
owner answers every peer): links are full duplex, and the messages a rank receives arrive while it
sends its own. Ids are assumed spread evenly over a table's rows (hashed ids are;
integer ids numbered by popularity would load the first block more).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from sparkdl.embeddings.placement import FLOAT_BYTES, Placement, TableSpec, plan_placement
from sparkdl.errors import ConfigError
from sparkdl.planner.cost import Network, allreduce_bytes, allreduce_s

INDEX_BYTES = 8  # int64 ids and counts, as embeddings/exchange.py sends them
OPTIMIZERS = ("rowwise_adagrad", "adam")
# Replicated and sharded train the same update, so only speed picks between them; one calibration of
# a loaded host put a link's latency at 1.96 ms and the next at 0.078 ms (issue 53) and the choice
# flipped. A choice within CLOSE_CALL, or one that flips across the calibration's range (median to
# best repeat), is a close call: it goes to DEFAULT_PLACEMENT, the layout a run without measurements
# takes (driver/embedding_plan.py), so repeated plans of a run on the same hosts agree.
CLOSE_CALL = 0.15
DEFAULT_PLACEMENT = "sharded"


def state_bytes_per_row(optimizer: str, dim: int) -> int:
    """Optimizer state per row where the row lives: row-wise Adagrad one float, Adam two per value."""
    if optimizer == "rowwise_adagrad":
        return FLOAT_BYTES
    if optimizer == "adam":
        return 2 * FLOAT_BYTES * dim
    raise ConfigError(f"embedding optimizer {optimizer!r} is not priced", hint=f"use one of {', '.join(OPTIMIZERS)}")


def expected_distinct(counts: Sequence[int], draws: float, tail_ids: int = 0, tail_total: int = 0) -> float:
    """Expected distinct ids among `draws` independent draws from the sampled frequencies:
    sum_i 1 - (1 - p_i)^n with p_i = c_i / (sum c + tail_total). `counts`: the sample's count of each
    id listed (e.g. the top K); the other `tail_ids` ids share `tail_total` draws evenly. Ids the
    sample never saw are not counted, so keep draws well below the sample's size."""
    if draws < 0 or tail_ids < 0 or tail_total < 0 or any(c < 0 for c in counts):
        raise ConfigError("id counts, tail and draws must be non-negative", hint="pass the sample's counts as they are")
    if tail_total and not tail_ids:
        raise ConfigError(f"tail_total={tail_total} draws belong to tail_ids=0 ids",
                          hint="pass how many distinct ids the tail holds")
    total = sum(counts) + tail_total
    if total == 0 or draws == 0:
        return 0.0

    def seen(p: float) -> float:  # 1 - (1-p)^n, exact for tiny p and large n
        return 1.0 if p >= 1.0 else -math.expm1(draws * math.log1p(-p))

    tail = tail_ids * seen(tail_total / tail_ids / total) if tail_ids else 0.0
    return sum(seen(c / total) for c in counts if c) + tail


@dataclass(frozen=True)
class IdStats:
    """How often one table's ids repeat, measured from a sample of the data. `ids_per_row`: lookups
    per DataFrame row (1 one-hot; the mean list length of multi-hot; summed over the columns sharing
    the table); `distinct_per_rank`: expected distinct ids in one rank's batch of `batch_rows` rows;
    `distinct_per_step`: in the global batch of `world` x `batch_rows`."""

    table: str
    num_rows: int
    ids_per_row: float
    batch_rows: int
    world: int
    distinct_per_rank: float
    distinct_per_step: float
    sampled_distinct: int

    @property
    def touched_share(self) -> float:
        """The share of the table's rows one global step touches."""
        return self.distinct_per_step / self.num_rows


def measure_ids(table: str, num_rows: int, counts: Sequence[int], sample_rows: int, batch_rows: int,
                world: int, tail_ids: int = 0, tail_total: int = 0) -> IdStats:
    """IdStats from a sample of `sample_rows` DataFrame rows. The driver's query (one aggregate over a
    sample, on the row numbers data/sparse_inputs.py maps the ids to, exploded for multi-hot and
    unioned over the columns sharing the table): `groupBy(row).count()`, of which it collects the K
    largest counts (`counts`) and, for the rest, `count(*)` and `sum(count)` (`tail_ids`, `tail_total`)."""
    for name, value in (("num_rows", num_rows), ("sample_rows", sample_rows), ("batch_rows", batch_rows),
                        ("world", world)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"embedding table {table!r}: {name}={value!r} is not a positive integer",
                              hint=f"pass {name} as an int >= 1")
    ids_per_row = (sum(counts) + tail_total) / sample_rows
    per_rank = expected_distinct(counts, batch_rows * ids_per_row, tail_ids, tail_total)
    per_step = expected_distinct(counts, world * batch_rows * ids_per_row, tail_ids, tail_total)
    return IdStats(table, num_rows, ids_per_row, batch_rows, world, min(per_rank, num_rows),
                   min(per_step, num_rows), sum(1 for c in counts if c) + tail_ids)


@dataclass(frozen=True)
class OptionCost:
    """One way to hold the tables, priced per step: communication seconds, bytes the busiest rank
    sends, messages it exchanges, memory of the fullest rank (tables, optimizer state, step buffers)."""

    name: str  # "replicated" or "sharded(...)"
    step_s: float
    bytes_per_step: float
    messages: int
    memory_bytes: float
    feasible: bool
    reason: str = ""
    shardings: tuple[tuple[str, str], ...] = ()  # sharded: (table, "row" | "table")


def replicated(tables: Sequence[TableSpec], world: int, net: Network, optimizer: str) -> OptionCost:
    """Every table's whole gradient and its touched-row flags (one float per row, in the same buffer:
    embeddings/replicated.py apply_gradients) allreduced (ring, not overlapped with backward) every step."""
    grad_bytes = sum(t.nbytes + t.num_rows * FLOAT_BYTES for t in tables)
    memory = sum(2 * t.nbytes + t.num_rows * state_bytes_per_row(optimizer, t.dim) for t in tables)
    messages = 2 * (world - 1) if world > 1 else 0
    return OptionCost("replicated", allreduce_s(grad_bytes, world, net), allreduce_bytes(grad_bytes, world),
                      messages, memory, True)


def _shares(placement: Placement) -> list[list[float]]:
    """shares[t][r]: the share of table t's rows rank r holds (and so of the ids asked of it)."""
    return [[(b[r + 1] - b[r]) / s.num_rows for r in range(placement.world_size)]
            for s, b in zip(placement.tables, placement.bounds)]


def sharded(tables: Sequence[TableSpec], stats: Mapping[str, IdStats], world: int, net: Network,
            optimizer: str, all_peers: bool = False) -> OptionCost:
    """The four all-to-alls of a step over plan_placement(tables, world), at the busiest rank of each.
    `all_peers`: every all-to-all messages every peer (a collective all_to_all_single); otherwise only
    peers holding touched rows (the point-to-point all_to_all skips empty pieces)."""
    placement = plan_placement(list(tables), world)
    shares = _shares(placement)
    touched = [stats[t.name].distinct_per_rank for t in tables]
    peers = world - 1
    slowest = [0.0, 0.0, 0.0]  # ids, rows, gradients: the slowest rank's seconds in each all-to-all
    counts_s = peers * net.latency_s + INDEX_BYTES * len(tables) * peers / net.bandwidth_Bps if peers else 0.0
    most_sent, most_messages, fullest = 0.0, 0, 0.0
    held = placement.bytes_per_rank()
    for r in range(world):
        ids_out = sum(d * (1 - s[r]) for d, s in zip(touched, shares))
        ids_in = peers * sum(d * s[r] for d, s in zip(touched, shares))
        floats_out = peers * sum(d * s[r] * t.dim for d, s, t in zip(touched, shares, tables))
        floats_in = sum(d * (1 - s[r]) * t.dim for d, s, t in zip(touched, shares, tables))
        # A rank pays a latency per message it sends; the ones it receives arrive meanwhile.
        asks = peers if all_peers else sum(
            1 for q in range(world) if q != r and any(d * s[q] > 0 for d, s in zip(touched, shares)))
        answers = peers if all_peers or ids_in > 0 else 0
        directions = ((asks, INDEX_BYTES * ids_out, INDEX_BYTES * ids_in),
                      (answers, FLOAT_BYTES * floats_out, FLOAT_BYTES * floats_in),  # rows served, received
                      (asks, FLOAT_BYTES * floats_in, FLOAT_BYTES * floats_out))  # gradients to the owners
        for k, (messages, out, into) in enumerate(directions):
            slowest[k] = max(slowest[k], messages * net.latency_s + max(out, into) / net.bandwidth_Bps)
        most_sent = max(most_sent, sum(out for _, out, _ in directions))
        most_messages = max(most_messages, peers + sum(m for m, _, _ in directions))
        states = sum((b[r + 1] - b[r]) * state_bytes_per_row(optimizer, t.dim)
                     for t, b in zip(tables, placement.bounds))
        local_floats = sum(d * t.dim for d, t in zip(touched, tables))  # looked-up rows and their gradients
        fullest = max(fullest, held[r] + states + 2 * FLOAT_BYTES * (local_floats + floats_out))
    step = counts_s + sum(slowest)
    sent = most_sent + (INDEX_BYTES * len(tables) * peers)
    layout = tuple((t.name, t.sharding) for t in placement.tables)
    return OptionCost(_sharded_name(layout), step, sent, most_messages, fullest, True, shardings=layout)


def _sharded_name(layout: tuple[tuple[str, str], ...]) -> str:
    kinds = {kind for _, kind in layout}
    if kinds == {"row"}:
        return "sharded(row-wise)"
    if kinds == {"table"}:
        return "sharded(table-wise)"
    return f"sharded({sum(k == 'table' for _, k in layout)} small tables table-wise, the rest row-wise)"


@dataclass(frozen=True)
class EmbeddingDecision:
    """The priced options (replicated first), the chosen one and why."""

    options: tuple[OptionCost, ...]
    chosen: int
    reason: str
    world: int
    latency_s: float
    bandwidth_Bps: float
    table_bytes: int
    memory_budget: float | None = None

    @property
    def choice(self) -> OptionCost:
        return self.options[self.chosen]

    @property
    def sharded(self) -> bool:
        return self.choice.name != "replicated"

    def explain(self) -> str:
        """One line per option, the chosen one marked, and the reason (the planner's table style)."""
        budget = f", memory budget {size(self.memory_budget)} per rank" if self.memory_budget else ""
        lines = [f"embeddings: {size(self.table_bytes)} of tables, {self.world} workers, "
                 f"{link(self.bandwidth_Bps, self.latency_s)}{budget}",
                 f"chosen: {self.choice.name} - {self.reason}", ""]
        rows = [("", "embeddings", "comm (ms)", "sent/step", "messages", "memory/rank", "feasible", "why")]
        for index, o in enumerate(self.options):
            rows.append(("*" if index == self.chosen else "", o.name, f"{o.step_s * 1e3:.2f}", size(o.bytes_per_step),
                         str(o.messages), size(o.memory_bytes), "yes" if o.feasible else "no", o.reason))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in rows]
        if self.sharded:
            kinds = dict(self.choice.shardings)
            lines.append("sharding: " + "; ".join(
                f"{kind}-wise: {', '.join(n for n, k in kinds.items() if k == kind)}"
                for kind in ("row", "table") if kind in kinds.values()))
        return "\n".join(lines)


def decide_embeddings(tables: Sequence[TableSpec], stats: Mapping[str, IdStats], world: int, net: Network,
                      memory_budget: float | None = None, optimizer: str = "rowwise_adagrad",
                      all_peers: bool = False, optimistic: Network | None = None) -> EmbeddingDecision:
    """Replicated against sharded (every row/table-wise split that puts the k smallest tables whole on
    one rank, k = 0..T), each refused when its fullest rank exceeds `memory_budget` (the planner's
    rank_memory_budget: launch.max_memory_per_rank or the executor's Python memory per rank). The
    cheaper feasible one per step on `net` (the calibration as measured) wins, unless the call is
    close: within CLOSE_CALL of the best of the other kind, or another kind wins on `optimistic`
    (the calibration's best repeats); a close call goes to DEFAULT_PLACEMENT."""
    tables = list(tables)
    if not tables:
        raise ConfigError("no embedding tables were given", hint="pass at least one TableSpec")
    missing = [t.name for t in tables if t.name not in stats]
    if missing:
        raise ConfigError(f"no id statistics for embedding tables {', '.join(missing)}",
                          hint="measure every table's ids with measure_ids(...) first")
    options = _priced(tables, stats, world, net, optimizer, all_peers, memory_budget)
    feasible = [i for i, o in enumerate(options) if o.feasible]
    if not feasible:
        least = min(o.memory_bytes for o in options)
        raise ConfigError(f"the embedding tables ({size(sum(t.nbytes for t in tables))}) fit no layout: even "
                          f"sharded over {world} workers a rank needs {size(least)}, over the budget of "
                          f"{size(memory_budget)} per rank",
                          hint="add workers (launch.num_workers) or raise launch.max_memory_per_rank")
    chosen = _cheapest(options)
    other_end = _priced(tables, stats, world, optimistic, optimizer, all_peers, memory_budget) \
        if optimistic is not None and world > 1 else None
    # One rank exchanges nothing either way: no call to make.
    chosen, close = _settled(options, chosen, other_end) if world > 1 else (chosen, "")
    reasons = _reasons(options, chosen, net, memory_budget)
    if close:
        reasons[chosen] = f"{close}: {DEFAULT_PLACEMENT}, the default, so repeated plans agree; {reasons[chosen]}"
    options = [_with_reason(o, reasons[i]) for i, o in enumerate(options)]
    return EmbeddingDecision(tuple(options), chosen, reasons[chosen], world, net.latency_s, net.bandwidth_Bps,
                             sum(t.nbytes for t in tables), memory_budget)


def _priced(tables: list[TableSpec], stats: Mapping[str, IdStats], world: int, net: Network, optimizer: str,
            all_peers: bool, budget: float | None) -> list[OptionCost]:
    """Replicated first, then the sharded splits worth listing, on one view of the link."""
    options = [_checked(replicated(tables, world, net, optimizer), budget)]
    return options + _best_shardings(tables, stats, world, net, optimizer, all_peers, budget)


def _cheapest(options: Sequence[OptionCost]) -> int:
    feasible = [i for i, o in enumerate(options) if o.feasible]
    return min(feasible, key=lambda i: (options[i].step_s, options[i].bytes_per_step, i))


def _kind(option: OptionCost) -> str:
    return "replicated" if option.name == "replicated" else "sharded"


def _settled(options: list[OptionCost], chosen: int, other_end: list[OptionCost] | None) -> tuple[int, str]:
    """(the option to run, why the call was close, '' when it was not). A close call: the best of the
    other kind within CLOSE_CALL of the chosen one's step, or the calibration's other end choosing the
    other kind (the same options, in the same order). Then the best feasible DEFAULT_PLACEMENT option."""
    rivals = [i for i, o in enumerate(options) if o.feasible and _kind(o) != _kind(options[chosen])]
    if not rivals:
        return chosen, ""  # nothing of the other kind fits: no call to make
    rival = min(rivals, key=lambda i: options[i].step_s)
    c, r = options[chosen], options[rival]
    close = ""
    if other_end is not None and _kind(other_end[_cheapest(other_end)]) != _kind(c):
        flipped = other_end[_cheapest(other_end)]
        close = (f"the choice flips across the calibration's range ({c.name} {_ms(c.step_s)} as measured, "
                 f"{flipped.name} at its best repeats)")
    elif r.step_s <= (1 + CLOSE_CALL) * c.step_s:
        close = f"a close call ({c.name} {_ms(c.step_s)} against {r.name} {_ms(r.step_s)}, within {CLOSE_CALL:.0%})"
    if not close:
        return chosen, ""
    default = [i for i, o in enumerate(options) if o.feasible and _kind(o) == DEFAULT_PLACEMENT]
    return min(default, key=lambda i: (options[i].step_s, i)), close


def _checked(option: OptionCost, budget: float | None) -> OptionCost:
    if budget is None or option.memory_bytes <= budget:
        return option
    if option.name == "replicated":
        why = (f"the tables with gradients and optimizer state ({size(option.memory_bytes)}) exceed one "
               f"rank's {size(budget)}")
    else:
        why = f"its fullest rank needs {size(option.memory_bytes)}, over one rank's {size(budget)}"
    return _with_reason(option, why, feasible=False)


def _with_reason(option: OptionCost, reason: str, feasible: bool | None = None) -> OptionCost:
    return OptionCost(option.name, option.step_s, option.bytes_per_step, option.messages, option.memory_bytes,
                      option.feasible if feasible is None else feasible, reason, option.shardings)


def _best_shardings(tables: list[TableSpec], stats: Mapping[str, IdStats], world: int, net: Network,
                    optimizer: str, all_peers: bool, budget: float | None) -> list[OptionCost]:
    """Row-wise, table-wise, and the fastest feasible split in between when it beats both: the k
    smallest tables whole on one rank (fewer peers to message, but their owners serve every rank)."""
    by_size = sorted(tables, key=lambda t: (t.nbytes, t.name))
    priced = []
    for k in range(len(tables) + 1):
        whole = {t.name for t in by_size[:k]}
        specs = [TableSpec(t.name, t.num_rows, t.dim, t.pooling, "table" if t.name in whole else "row")
                 for t in tables]
        priced.append(_checked(sharded(specs, stats, world, net, optimizer, all_peers), budget))
    ends = [priced[0], priced[-1]]
    middle = [o for o in priced[1:-1] if o.feasible]
    if middle:
        best = min(middle, key=lambda o: (o.step_s, o.bytes_per_step))
        if all(not e.feasible or best.step_s < e.step_s for e in ends):
            ends.append(best)
    return ends


def _reasons(options: list[OptionCost], chosen: int, net: Network, budget: float | None) -> list[str]:
    """The chosen option's reason (against the best of the other kind) and how far behind the rest are."""
    c = options[chosen]
    at = link(net.bandwidth_Bps, net.latency_s)
    if chosen == 0:
        rivals = [o for o in options[1:] if o.feasible] or options[1:]
        rival = min(rivals, key=lambda o: o.step_s)
    else:
        rival = options[0]
    text = (f"{size(c.bytes_per_step)}/step vs {rival.name} {size(rival.bytes_per_step)}/step at {at}; "
            + (rival.reason if not rival.feasible else
               f"{_ms(c.step_s)} against {_ms(rival.step_s)} of communication per step"))
    reasons = []
    for i, o in enumerate(options):
        if i == chosen:
            reasons.append(text)
        elif not o.feasible:
            reasons.append(o.reason)
        elif c.step_s > 0:
            reasons.append(f"{o.step_s / c.step_s:.1f}x the chosen one's communication time")
        else:
            reasons.append("no faster than the chosen one")
    return reasons


def _ms(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


def link(bandwidth_Bps: float, latency_s: float) -> str:
    bits = bandwidth_Bps * 8
    rate = f"{bits / 1e9:.3g} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:.3g} Mbit/s"
    return f"{rate}, {latency_s * 1e3:.3g} ms latency"


def size(nbytes: float | None) -> str:
    if nbytes is None or not math.isfinite(nbytes):
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"
