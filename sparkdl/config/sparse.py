"""data.sparse_cols: categorical inputs (ids looked up in embedding tables), declared once beside
the dense feature columns, and the tables they use.

Two ways to write it, the same meaning:
- Python: `sparse_cols=[SparseInput("user", num_rows=10**6, dim=16), SparseInput("tags",
  table="tags", num_rows=5000, weights_col="tag_weights")]`;
- TOML (or a Python dict): `[data.sparse_cols.user]` with `num_rows = 1000000`, `dim = 16`, or
  `sparse_cols = {item = {table = "items", num_rows = 100000}, clicked_item = "items"}` (a string
  names the table only).

A table is named once and may be shared by several columns: its num_rows and dim are given by any
one of them (or by several that agree; declarations that differ are refused, naming both columns).
Imports nothing from sparkdl but errors and config values (layering rule).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

from sparkdl.config.values import suggest
from sparkdl.errors import ConfigError

# An integer id outside [0, num_rows): "hash" maps it to a row as strings are (data/sparse_hash.py);
# "refuse": one query counts such ids before any job and a SparseIdError names the column.
OUT_OF_RANGE_MODES = ("hash", "refuse")
_EXAMPLE = 'for example sparse_cols={"user_id": {"num_rows": 1000000, "dim": 16}}'


@dataclass(frozen=True)
class SparseInput:
    """One categorical column: its ids are rows of `table` (default: a table named after the column).
    The column holds integer ids, strings, or arrays of either (multi-hot); `weights_col` an array of
    numbers per row, one weight per id (multi-hot only)."""

    column: str
    table: str | None = None
    num_rows: int | None = None  # rows of the table; given once per table
    dim: int | None = None  # embedding width; None: left to the model
    weights_col: str | None = None
    out_of_range: str = "hash"

    @property
    def table_name(self) -> str:
        return self.table if self.table is not None else self.column


@dataclass(frozen=True)
class SparseTable:
    """One embedding table as the declarations of its columns resolve it."""

    name: str
    num_rows: int
    dim: int | None
    columns: tuple[str, ...]


@dataclass(frozen=True)
class SparseInputs:
    """Every declared categorical input, each with its table's num_rows filled in, and the tables."""

    inputs: tuple[SparseInput, ...]
    tables: tuple[SparseTable, ...]

    def table(self, name: str) -> SparseTable:
        for table in self.tables:
            if table.name == name:
                return table
        raise KeyError(name)

    @property
    def columns(self) -> tuple[str, ...]:
        """Every DataFrame column the declarations read: id columns and weight columns."""
        return tuple(c for i in self.inputs for c in (i.column, i.weights_col) if c is not None)


def sparse_inputs(value: Any) -> SparseInputs | None:
    """data.sparse_cols in either form, checked and resolved (None when unset)."""
    if value is None:
        return None
    declared = _declarations(value)
    if not declared:
        raise ConfigError("data.sparse_cols is empty", hint="leave it unset, or " + _EXAMPLE)
    seen: set[str] = set()
    for item in declared:
        _check_one(item)
        if item.column in seen:
            raise ConfigError(f"data.sparse_cols declares column {item.column!r} twice",
                              hint="declare each column once; columns share a table by naming the same table")
        seen.add(item.column)
    _check_weights(declared)
    tables = _tables(declared)
    by_name = {t.name: t for t in tables}
    resolved = tuple(replace(i, table=i.table_name, num_rows=by_name[i.table_name].num_rows,
                             dim=by_name[i.table_name].dim) for i in declared)
    return SparseInputs(inputs=resolved, tables=tables)


def check_sparse_cols(data: Any) -> None:
    """DataConfig.validate's part: sparse_cols on its own, and against the other columns it names."""
    resolved = sparse_inputs(data.sparse_cols)
    if resolved is None:
        return
    others = {"label_col": data.label_col, "weight_col": data.weight_col}
    feature = data.feature_cols if isinstance(data.feature_cols, (list, tuple)) else ()
    inputs = data.input_cols.values() if isinstance(data.input_cols, dict) else (data.input_cols or ())
    for name in resolved.columns:
        for key, other in others.items():
            if name == other:
                raise ConfigError(f"data.sparse_cols reads column {name!r}, which is also data.{key}",
                                  hint=f"use another column for {key}, or drop {name!r} from sparse_cols")
        if name in feature or name in inputs:
            which = "feature_cols" if name in feature else "input_cols"
            raise ConfigError(f"column {name!r} is both in data.sparse_cols and in data.{which}",
                              hint=f"a categorical column belongs in sparse_cols only: remove it from {which}")


def _declarations(value: Any) -> list[SparseInput]:
    if isinstance(value, SparseInput):
        return [value]
    if isinstance(value, Mapping):
        return [_from_entry(column, entry) for column, entry in value.items()]
    if isinstance(value, (list, tuple)):
        out = []
        for item in value:
            if not isinstance(item, SparseInput):
                raise ConfigError(f"data.sparse_cols holds {item!r}, not a SparseInput",
                                  hint="a list holds SparseInput(column, ...) values; or write a table "
                                       "{column: {num_rows = ..., ...}}")
            out.append(item)
        return out
    raise ConfigError(f"data.sparse_cols must be a table {{column: {{table, num_rows, dim, weights_col, "
                      f"out_of_range}}}} or a list of SparseInput, got {value!r}", hint=_EXAMPLE)


_KEYS = tuple(f.name for f in fields(SparseInput) if f.name != "column")


def _from_entry(column: Any, entry: Any) -> SparseInput:
    if not isinstance(column, str) or not column:
        raise ConfigError(f"data.sparse_cols has key {column!r}, not a column name", hint=_EXAMPLE)
    if isinstance(entry, str):
        return SparseInput(column, table=entry)
    if not isinstance(entry, Mapping):
        raise ConfigError(f"data.sparse_cols[{column!r}] must be a table name or a table of options "
                          f"({', '.join(_KEYS)}), got {entry!r}", hint=_EXAMPLE)
    for key in entry:
        if key not in _KEYS:
            raise ConfigError(f"unknown option data.sparse_cols[{column!r}].{key}", hint=suggest(str(key), _KEYS))
    return SparseInput(column, **dict(entry))


def _positive(key: str, value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ConfigError(f"{key} must be a positive integer, got {value!r}",
                          hint="num_rows: the table's rows (ids 0..num_rows-1); dim: the embedding width")


def _check_one(item: SparseInput) -> None:
    where = f"data.sparse_cols[{item.column!r}]"
    if not isinstance(item.column, str) or not item.column:
        raise ConfigError(f"data.sparse_cols holds a column name {item.column!r}", hint=_EXAMPLE)
    for key in ("table", "weights_col"):
        value = getattr(item, key)
        if value is not None and (not isinstance(value, str) or not value):
            raise ConfigError(f"{where}.{key} must be a non-empty name, got {value!r}", hint="or leave it unset")
    _positive(f"{where}.num_rows", item.num_rows)
    _positive(f"{where}.dim", item.dim)
    if item.out_of_range not in OUT_OF_RANGE_MODES:
        raise ConfigError(f"{where}.out_of_range must be one of {', '.join(map(repr, OUT_OF_RANGE_MODES))}, "
                          f"got {item.out_of_range!r}", hint=suggest(str(item.out_of_range), OUT_OF_RANGE_MODES))
    if item.weights_col == item.column:
        raise ConfigError(f"{where}.weights_col is the id column itself", hint="name the column of per-id weights")


def _check_weights(declared: list[SparseInput]) -> None:
    ids = {i.column for i in declared}
    users: dict[str, str] = {}
    for item in declared:
        weights = item.weights_col
        if weights is None:
            continue
        if weights in ids:
            raise ConfigError(f"data.sparse_cols[{item.column!r}].weights_col {weights!r} is itself a sparse column",
                              hint="weights are an array of numbers beside the ids, not ids")
        if weights in users:
            raise ConfigError(f"data.sparse_cols: columns {users[weights]!r} and {item.column!r} both weigh by "
                              f"{weights!r}", hint="each multi-hot column has its own weights column")
        users[weights] = item.column


def _agreed(table: str, key: str, items: list[SparseInput]) -> int | None:
    """The one value of `key` the declarations of `table` give (None when none does)."""
    given = [(i.column, getattr(i, key)) for i in items if getattr(i, key) is not None]
    for column, value in given[1:]:
        if value != given[0][1]:
            raise ConfigError(f"table {table!r} is declared with {key}={given[0][1]} by column {given[0][0]!r} "
                              f"and {key}={value} by column {column!r}",
                              hint=f"give the table's {key} once (on one column), or the same on both")
    return given[0][1] if given else None


def _tables(declared: list[SparseInput]) -> tuple[SparseTable, ...]:
    grouped: dict[str, list[SparseInput]] = {}
    for item in declared:
        grouped.setdefault(item.table_name, []).append(item)
    tables = []
    for name, items in grouped.items():
        num_rows = _agreed(name, "num_rows", items)
        if num_rows is None:
            columns = ", ".join(repr(i.column) for i in items)
            raise ConfigError(f"table {name!r} (used by {columns}) has no num_rows",
                              hint=f"give num_rows on one of its columns, e.g. "
                                   f"sparse_cols={{{items[0].column!r}: {{'table': {name!r}, 'num_rows': 100000}}}}")
        tables.append(SparseTable(name=name, num_rows=num_rows, dim=_agreed(name, "dim", items),
                                  columns=tuple(i.column for i in items)))
    return tuple(tables)
