"""Which rank holds which rows of every embedding table: a pure function of the specs and W.

Standard library only (the planner prices placements without torch). Every table is described the same
way, whatever its sharding: W+1 row boundaries, rank r owning rows [bounds[r], bounds[r+1]). A row-wise
table splits into W contiguous blocks (sizes differ by at most one row); a table-wise table gives one
rank all rows and the others empty ranges. Table-wise tables are spread greedily by bytes (largest
first onto the least loaded rank, counting row-wise tables' blocks), so many small tables balance.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from sparkdl.errors import ConfigError

POOLINGS = ("sum", "mean")
SHARDINGS = ("row", "table")
FLOAT_BYTES = 4  # tables are float32


@dataclass(frozen=True)
class TableSpec:
    """One embedding table: `num_rows` ids of `dim` floats, pooled per sample by `pooling`."""

    name: str
    num_rows: int
    dim: int
    pooling: str = "sum"
    sharding: str = "row"

    def __post_init__(self) -> None:
        where = f"embedding table {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"an embedding table has the name {self.name!r}",
                              hint="give every table a non-empty string name")
        for option in ("num_rows", "dim"):
            value = getattr(self, option)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{where}: {option}={value!r} is not a positive integer",
                                  hint=f"set {option} to an int >= 1")
        if self.pooling not in POOLINGS:
            raise ConfigError(f"{where}: pooling={self.pooling!r} is not supported",
                              hint=f"use one of {', '.join(POOLINGS)}")
        if self.sharding not in SHARDINGS:
            raise ConfigError(f"{where}: sharding={self.sharding!r} is not supported",
                              hint="use 'row' (large tables: rows split over every rank) or 'table' "
                                   "(many small tables: each whole on one rank)")

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.dim * FLOAT_BYTES


@dataclass(frozen=True)
class Placement:
    """Rows of every table per rank. `bounds[i]`: W+1 boundaries of tables[i] (rank r owns
    [bounds[i][r], bounds[i][r+1]))."""

    world_size: int
    tables: tuple[TableSpec, ...]
    bounds: tuple[tuple[int, ...], ...]

    def index(self, name: str) -> int:
        for i, spec in enumerate(self.tables):
            if spec.name == name:
                return i
        raise ConfigError(f"no embedding table is named {name!r}",
                          hint=f"use one of {', '.join(s.name for s in self.tables)}")

    def rows_of(self, name: str, rank: int) -> tuple[int, int]:
        """[start, stop) of the table's rows that `rank` holds (start == stop: none)."""
        b = self.bounds[self.index(name)]
        return b[rank], b[rank + 1]

    def owner_of_row(self, name: str, row: int) -> int:
        i = self.index(name)
        if not 0 <= row < self.tables[i].num_rows:
            raise ConfigError(f"row {row} is outside embedding table {name!r} ({self.tables[i].num_rows} rows)",
                              hint="ids must lie in [0, num_rows)")
        # The last rank whose range starts at or before the row; empty ranges before it are skipped.
        return bisect.bisect_right(self.bounds[i], row, 0, self.world_size) - 1

    def bytes_per_rank(self) -> tuple[int, ...]:
        """Table bytes each rank holds (weights only; optimizer state scales alike)."""
        return tuple(sum((b[r + 1] - b[r]) * s.dim * FLOAT_BYTES for s, b in zip(self.tables, self.bounds))
                     for r in range(self.world_size))


def row_blocks(num_rows: int, world_size: int) -> tuple[int, ...]:
    """W+1 boundaries of W contiguous blocks whose sizes differ by at most one row."""
    return tuple(r * num_rows // world_size for r in range(world_size + 1))


def whole_on(owner: int, num_rows: int, world_size: int) -> tuple[int, ...]:
    return tuple(0 if r <= owner else num_rows for r in range(world_size + 1))


def plan_placement(specs: "list[TableSpec] | tuple[TableSpec, ...]", world_size: int) -> Placement:
    """Row-wise tables in W blocks; table-wise tables largest first onto the least loaded rank
    (ties: the lower rank), so the result depends only on the specs and W."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size={world_size!r} is not a positive integer", hint="pass the number of ranks")
    specs = tuple(specs)
    if not specs:
        raise ConfigError("no embedding tables were given", hint="pass at least one TableSpec")
    if not all(isinstance(s, TableSpec) for s in specs):
        raise ConfigError("embedding tables must be TableSpec objects", hint="build each with TableSpec(...)")
    names = [s.name for s in specs]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise ConfigError(f"embedding table names repeat: {', '.join(duplicated)}",
                          hint="give every table its own name (share a table by using one name for both columns)")
    bounds: list[tuple[int, ...] | None] = [None] * len(specs)
    load = [0] * world_size
    for i, spec in enumerate(specs):
        if spec.sharding == "row":
            bounds[i] = row_blocks(spec.num_rows, world_size)
            for r in range(world_size):
                load[r] += (bounds[i][r + 1] - bounds[i][r]) * spec.dim * FLOAT_BYTES
    tablewise = sorted((i for i, s in enumerate(specs) if s.sharding == "table"),
                       key=lambda i: (-specs[i].nbytes, specs[i].name))
    for i in tablewise:
        owner = min(range(world_size), key=lambda r: (load[r], r))
        bounds[i] = whole_on(owner, specs[i].num_rows, world_size)
        load[owner] += specs[i].nbytes
    return Placement(world_size=world_size, tables=specs, bounds=tuple(b for b in bounds if b is not None))
