"""The strategies' layouts and where ranks work: frozen dataclasses and pure placement algorithms.

Standard library only, so the planner, the strategies and launch all import it downward, and the
layouts can travel in the TrainSpec and in a saved plan (plan.json) without torch or Spark.

- `HybridLayout`: K pipeline stages x D replicas, the stage cuts and the rank grid.
- `IstLayout`: where the Linear and BatchNorm1d layers of an IST MLP sit.
- Heterogeneity (ALGORITHMS.md, DT-FM, Yuan et al. 2022): data parallel on ranks of different
  speeds shares the global batch by speed (`batch_shares`); hybrid on links of different speeds
  groups each stage's D replicas on the fastest links and orders the groups into a pipeline whose
  slowest boundary is as fast as possible. Cost, as in DT-FM: DataPCost + 2 x PipelineCost with
  DataPCost the slowest group member's ring allreduce and PipelineCost the sum over boundaries of
  the bottleneck matching's link time. Exhaustive for small worlds, else greedy plus pairwise-swap
  local search (DT-FM uses a genetic algorithm + local search).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Sequence, Union

Matrix = Sequence[Sequence[float]]


def batch_shares(speeds: Sequence[float], global_batch: int) -> list[int]:
    """Rows per rank proportional to speed, summing to global_batch, at least one each."""
    if not speeds or min(speeds) <= 0 or global_batch < len(speeds):
        raise ValueError("speeds must be positive and the batch at least one row per rank")
    total = sum(speeds)
    raw = [global_batch * s / total for s in speeds]
    shares = [max(1, int(r)) for r in raw]
    # Largest remainders get the rows still missing (or give back the extra ones).
    order = sorted(range(len(speeds)), key=lambda i: raw[i] - int(raw[i]), reverse=True)
    index = 0
    while sum(shares) < global_batch:
        shares[order[index % len(order)]] += 1
        index += 1
    while sum(shares) > global_batch:
        i = max((i for i in range(len(shares)) if shares[i] > 1), key=lambda i: shares[i] - raw[i])
        shares[i] -= 1
    return shares


def link_time(latency: Matrix, bandwidth: Matrix, i: int, j: int, nbytes: float) -> float:
    return latency[i][j] + nbytes / bandwidth[i][j]


def placement_cost(groups: Sequence[Sequence[int]], latency: Matrix, bandwidth: Matrix,
                   stage_grad_bytes: Sequence[float], activation_bytes: float) -> float:
    """DataPCost + 2 x PipelineCost of stage k running on groups[k] (replica d = groups[k][d])."""
    data = 0.0
    for k, group in enumerate(groups):
        d = len(group)
        if d > 1:
            # ring allreduce: 2(D-1) steps of 1/D of the gradients over the group's slowest link
            slowest = max(link_time(latency, bandwidth, a, b, stage_grad_bytes[k] / d)
                          for a in group for b in group if a != b)
            data = max(data, 2 * (d - 1) * slowest)
    pipeline = 0.0
    for k in range(len(groups) - 1):
        pipeline += max(link_time(latency, bandwidth, a, b, activation_bytes) for a, b in zip(groups[k], groups[k + 1]))
    return data + 2 * pipeline


def place_hybrid(latency: Matrix, bandwidth: Matrix, stages: int, stage_grad_bytes: Sequence[float],
                 activation_bytes: float, last_stage: int | None = None) -> tuple[tuple[int, ...], ...]:
    """grid[d][k] (the rank of stage k in replica d) minimising placement_cost; with `last_stage`,
    among grids where that rank runs a last stage."""
    world = len(latency)
    if world % stages:
        raise ValueError(f"{stages} stages do not divide {world} ranks")
    replicas = world // stages
    if world <= 8:
        best, best_cost = None, float("inf")
        for order in itertools.permutations(range(world)):
            groups = [order[k * replicas:(k + 1) * replicas] for k in range(stages)]
            if any(list(g) != sorted(g) for g in groups[:1]):
                continue  # replica order inside the first group is arbitrary: skip its permutations
            if last_stage is not None and last_stage not in groups[-1]:
                continue
            c = placement_cost(groups, latency, bandwidth, stage_grad_bytes, activation_bytes)
            if c < best_cost - 1e-15:
                best, best_cost = groups, c
        groups = best
    else:
        groups = _local_search(latency, bandwidth, stages, replicas, stage_grad_bytes, activation_bytes, last_stage)
    return tuple(tuple(groups[k][d] for k in range(stages)) for d in range(replicas))


def _local_search(latency: Matrix, bandwidth: Matrix, stages: int, replicas: int,
                  stage_grad_bytes: Sequence[float], activation_bytes: float,
                  last_stage: int | None = None) -> list[list[int]]:
    """Greedy groups (each grows by the rank with the fastest link to it), then pairwise swaps while
    they lower (placement_cost, total intra-group link time): the second term breaks the plateaus of
    a max-based cost, where no single swap lowers the slowest group yet."""
    world = stages * replicas
    unassigned = set(range(world))
    groups: list[list[int]] = []
    for _ in range(stages):
        seed = min(unassigned)
        group = [seed]
        unassigned.discard(seed)
        while len(group) < replicas:
            nearest = max(unassigned, key=lambda r: min(bandwidth[r][g] for g in group))
            group.append(nearest)
            unassigned.discard(nearest)
        groups.append(group)
    if last_stage is not None:
        keeper = next(k for k, g in enumerate(groups) if last_stage in g)
        groups[keeper], groups[-1] = groups[-1], groups[keeper]

    def score(trial: list[list[int]]) -> tuple[float, float]:
        spread = sum(1.0 / bandwidth[a][b] for g in trial for a in g for b in g if a != b)
        return placement_cost(trial, latency, bandwidth, stage_grad_bytes, activation_bytes), spread

    best = score(groups)
    improved = True
    while improved:
        improved = False
        for a, b in itertools.combinations(range(world), 2):
            ka, da = divmod(a, replicas)
            kb, db = divmod(b, replicas)
            if ka == kb:
                continue
            trial = [list(g) for g in groups]
            trial[ka][da], trial[kb][db] = trial[kb][db], trial[ka][da]
            if last_stage is not None and last_stage not in trial[-1]:
                continue
            candidate = score(trial)
            if candidate < best:
                groups, best, improved = trial, candidate, True
    return groups


def place_on_executors(links: Sequence[tuple[str, str, float, float]], executors: Sequence[str], stages: int,
                       stage_grad_bytes: Sequence[float], boundary_bytes: float
                       ) -> tuple[tuple[int, ...], ...] | None:
    """The hybrid grid for ranks on these executors (rank r on executors[r]), from links measured
    between executors; None when a pair was not measured. Two
    ranks on one executor whose link was not measured get the best measured link (same process
    host, shared memory). grid[0][-1] is rank 0: it computes the loss that is reported."""
    table = {(a, b): (lat, bw) for a, b, lat, bw in links}
    table.update({(b, a): v for (a, b), v in list(table.items())})
    if not table:
        return None
    best = (min(v[0] for v in table.values()), max(v[1] for v in table.values()))
    world = len(executors)
    latency = [[0.0] * world for _ in range(world)]
    bandwidth = [[float("inf")] * world for _ in range(world)]
    for i in range(world):
        for j in range(world):
            if i == j:
                continue
            pair = table.get((executors[i], executors[j]))
            if pair is None and executors[i] == executors[j]:
                pair = best
            if pair is None:
                return None
            latency[i][j], bandwidth[i][j] = pair
    grid = place_hybrid(latency, bandwidth, stages, list(stage_grad_bytes), boundary_bytes, last_stage=0)
    replica = next(d for d, ranks in enumerate(grid) if ranks[-1] == 0)
    return (tuple(grid[replica]),) + tuple(tuple(r) for d, r in enumerate(grid) if d != replica)


def default_grid(stages: int, replicas: int) -> tuple[tuple[int, ...], ...]:
    """grid[d][k]: replicas take consecutive blocks of K ranks; inside a block the stages run
    backwards so that rank 0 holds the last stage (the loss) of replica 0."""
    return tuple(tuple(d * stages + (stages - 1 - k) for k in range(stages)) for d in range(replicas))


@dataclass(frozen=True)
class HybridLayout:
    """Everything a rank needs to run its stage; built and validated on the driver."""

    stages: int
    replicas: int
    cuts: tuple[int, ...]  # K+1 boundaries over the Sequential's top-level layers
    boundary_shapes: tuple[tuple[int, ...], ...]  # per-row shape of stage k's output, k < K-1
    boundary_dtypes: tuple[str, ...]
    input_shape: tuple[int, ...]  # per-row shape of the first stage's input
    label_dtype: str
    microbatches: int
    schedule: str
    grid: tuple[tuple[int, ...], ...]
    # Measured links between executors (a, b, latency s, bandwidth B/s) and what crosses them, for
    # placing the grid once the ranks' executors are known (`placed`); empty: the default grid.
    executor_links: tuple[tuple[str, str, float, float], ...] = ()
    stage_grad_bytes: tuple[float, ...] = ()
    boundary_bytes: float = 0.0
    input_dtype: str = "float32"  # of the first stage's input (int64 for token ids)
    label_shape: tuple[int, ...] = ()  # per row: () for one label, (T,) for per-position labels
    # Several inputs (or keyword inputs) of the first stage's first layer: (keyword or "", per-row
    # shape, dtype) each, in forward() order; empty for one input (input_shape/input_dtype).
    input_specs: tuple[tuple[str, tuple[int, ...], str], ...] = ()

    def placed(self, executors: tuple[str, ...]) -> "HybridLayout":
        """This layout with its grid placed on the ranks' executors (DT-FM, place_on_executors above):
        each stage's data-parallel group on fast links, stage boundaries on slow ones. Every rank
        computes the same grid from the same inputs. Unchanged without measured links, or when an
        executor was not part of the measurement."""
        if not self.executor_links or len(executors) != self.stages * self.replicas:
            return self
        grid = place_on_executors(self.executor_links, executors, self.stages, self.stage_grad_bytes,
                                  self.boundary_bytes)
        return replace(self, grid=grid) if grid else self

    def position(self, rank: int) -> tuple[int, int]:
        """(replica, stage) of a global rank."""
        for replica, ranks in enumerate(self.grid):
            if rank in ranks:
                return replica, ranks.index(rank)
        raise ValueError(f"rank {rank} is not in the hybrid grid {self.grid}")

    def stage_layers(self, stage: int) -> range:
        return range(self.cuts[stage], self.cuts[stage + 1])


@dataclass(frozen=True)
class IstLayout:
    """Where the Linear and BatchNorm1d layers sit in the Sequential; built on the driver."""

    linears: tuple[int, ...]  # Sequential indices of the Linear layers, in order
    norms: tuple[tuple[int, int], ...]  # (Sequential index of a BatchNorm1d, hidden layer it normalises)
    widths: tuple[int, ...]  # hidden widths (outputs of every Linear but the last)
    world: int
    sync_every: int
    scale: str  # "scale" or "batchnorm"
    seed: int


@dataclass(frozen=True)
class EmbeddingLayout:
    """strategy "embeddings": the sparse optimizer of the tables (the embeddings section, defaults
    filled in) and the bound on late embedding updates; built on the driver."""

    optimizer: str  # "rowwise_adagrad" or "adam"
    lr: float
    eps: float
    staleness: int = 0  # 0: synchronous and exact
    features: tuple[tuple[str, str], ...] = ()  # (categorical column, its table), from data.sparse_cols
    replicated: bool = False  # every rank holds every table (whole gradients allreduced), not sharded
    shardings: tuple[tuple[str, str], ...] = ()  # sharded: (table, "row" | "table"); unlisted: the model's
    decision: str = ""  # the planner's explain() of replicated against sharded (embedding_placement="auto")


StrategyLayout = Union[HybridLayout, IstLayout, EmbeddingLayout, None]
