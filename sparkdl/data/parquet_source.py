"""Driver side of direct Parquet delivery (data.delivery): is this DataFrame a plain Parquet scan
whose rows the executors can read themselves, and which rows does each rank read?

Spark's semantics stay exact because only a scan that Spark would hand over unchanged qualifies:
the optimized plan is a Parquet relation under projections of plain columns (no filter, join,
limit, sample, cache, computed column or Delta-style format), the used columns are numeric scalars
or arrays in every file, and the fit holds nothing back (no validation split, no dropped rows).
Anything else is read through Spark as before. The row counts come from the files' footers, so
the ranks' shares are known before the job without a counting job.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from pyspark.sql import DataFrame

from sparkdl.data.parquet_shards import ParquetShards, SourceColumn, assign_pieces
from sparkdl.errors import ConfigError

if TYPE_CHECKING:
    from sparkdl.config import DataConfig
    from sparkdl.data.feed import PreparedData

_log = logging.getLogger("sparkdl")


class NotEligible(Exception):
    """Why a DataFrame is read through Spark (its message goes to the log, or to the user's error)."""


@dataclass(frozen=True)
class ParquetScan:
    """A DataFrame found to be a plain Parquet scan, before its rows are dealt to the ranks."""
    files: tuple[str, ...]
    widths: dict[str, int | None]  # used column -> 0 scalar, fixed array width, None for a list
    row_groups: tuple[tuple[str, int, int], ...]  # (path, row group, rows), in scan order


def direct_candidate(df: DataFrame, data: "DataConfig", validation_df: DataFrame | None = None) -> ParquetScan | None:
    """The scan when data.delivery allows direct reads and the DataFrame qualifies so far (what the
    plan and the footers tell, before any Spark job); None for delivery through Spark."""
    if data.delivery == "spark":
        return None
    try:
        return _scan(df, data, validation_df)
    except NotEligible as why:
        return _through_spark(data.delivery, why)


def with_parquet_source(prepared: "PreparedData", scan: ParquetScan | None, delivery: str,
                        num_workers: int) -> "PreparedData":
    """`prepared` with `source` set when the candidate still qualifies after preparation (no rows
    dropped, the counts agree); with data.delivery="parquet" a DataFrame that does not qualify
    raises, saying why."""
    if scan is None:
        return prepared
    try:
        shards = _shards(prepared, scan, num_workers)
    except NotEligible as why:
        return _through_spark(delivery, why, prepared)
    _log.info("sparkdl: each rank reads its rows from %d Parquet file(s) directly (data.delivery=%r)",
              shards.files, delivery)
    return replace(prepared, source=shards, shard_rows=shards.row_counts)


def _through_spark(delivery: str, why: NotEligible, prepared: Any = None) -> Any:
    if delivery == "parquet":
        raise ConfigError(f"data.delivery='parquet' reads a plain Parquet scan directly, but {why}",
                          hint="use data.delivery='auto' (Spark delivers what does not qualify) or 'spark'; "
                               "or write the prepared rows to Parquet first and fit on spark.read.parquet(path)")
    _log.info("sparkdl: rows delivered by Spark (not direct Parquet reads): %s", why)
    return prepared


def _scan(df: DataFrame, data: "DataConfig", validation_df: DataFrame | None) -> ParquetScan:
    if data.input_cols is not None:
        raise NotEligible("input_cols runs are delivered by Spark (direct reads cover feature_cols)")
    if validation_df is not None or data.validation_fraction > 0:
        raise NotEligible("a validation split is marked by Spark (validation_fraction / validation_df)")
    if not hasattr(df, "_jdf"):
        raise NotEligible("a Spark Connect DataFrame's plan cannot be inspected from the client")
    label = data.label_col if data.label_col in df.columns else None
    used = list(dict.fromkeys([*data.feature_cols, *(c for c in (label, data.weight_col) if c)]))
    files = _plain_scan_files(df, used)
    footers = _footers(files, data.delivery == "parquet")
    widths = _checked_columns(footers, used)
    row_groups = row_groups_of(footers)
    if not row_groups:
        raise NotEligible("the scan's files hold no rows")
    return ParquetScan(tuple(files), widths, tuple(row_groups))


def _shards(prepared: "PreparedData", scan: ParquetScan, num_workers: int) -> ParquetShards:
    layout = prepared.layout
    if prepared.dropped_rows:
        raise NotEligible("on_invalid='skip' dropped rows, which Spark filters")
    if prepared.num_validation_rows or layout.split_column is not None or layout.tensor_inputs:
        raise NotEligible("the prepared rows carry a validation split or tensor inputs")
    widths = _array_widths(scan.widths, layout.source_feature_cols, layout.num_features)
    features = tuple(SourceColumn(name, widths[name]) for name in layout.source_feature_cols)
    shards = ParquetShards(features=features, label=layout.source_label_col if layout.label_dtype else None,
                           weight=layout.source_weight_col,
                           pieces=assign_pieces(scan.row_groups, num_workers), files=len(scan.files))
    if shards.num_features != layout.num_features or sum(shards.row_counts) != prepared.num_rows:
        raise NotEligible(f"the files hold {sum(shards.row_counts)} rows x {shards.num_features} features where "
                          f"Spark counted {prepared.num_rows} x {layout.num_features}")
    return shards


def _class_name(java_object: Any) -> str:
    return str(java_object.getClass().getSimpleName())


def _seq(scala_seq: Any) -> list[Any]:
    return [scala_seq.apply(i) for i in range(scala_seq.size())]


def _plain_scan_files(df: DataFrame, used: list[str]) -> list[str]:
    """The scan's files when the optimized plan is projections of plain columns over one Parquet
    relation; raises NotEligible otherwise (a plan this Spark version shapes differently, too)."""
    from py4j.protocol import Py4JError

    try:
        return _inspected_scan_files(df, used)
    except Py4JError as exc:
        raise NotEligible(f"its plan could not be inspected ({str(exc).splitlines()[0][:200]})") from None


def _inspected_scan_files(df: DataFrame, used: list[str]) -> list[str]:
    node = df._jdf.queryExecution().optimizedPlan()
    while _class_name(node) == "Project":
        computed = [e for e in _seq(node.projectList()) if _class_name(e) != "AttributeReference"]
        if computed:
            raise NotEligible(f"the plan computes a column ({computed[0].sql()})")
        node = node.child()
    kind = _class_name(node)
    if kind != "LogicalRelation":
        raise NotEligible(f"the plan is not a plain file scan (its top operator below projections is {kind})")
    relation = node.relation()
    if _class_name(relation) != "HadoopFsRelation" or _class_name(relation.fileFormat()) != "ParquetFileFormat":
        raise NotEligible(f"the relation is not a plain Parquet scan ({_class_name(relation)})")
    partition_columns = {str(name) for name in relation.partitionSchema().fieldNames()}
    from_partitions = [c for c in used if c in partition_columns]
    if from_partitions:
        raise NotEligible(f"column {from_partitions[0]!r} is a partition column (in the directory names, not the files)")
    return sorted(df.inputFiles())


def local_path(uri: str) -> str:
    """A path pyarrow opens: a local file path for file: URIs, else the URI itself."""
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        return unquote(parsed.path)
    return uri


def _array_widths(widths: dict[str, int | None], feature_cols: tuple[str, ...], num_features: int) -> dict[str, int]:
    """Every feature column's width: a list column's from the feature width the stats job checked
    (every row of it has the same length); two or more such columns cannot be told apart."""
    unknown = [c for c in feature_cols if widths[c] is None]
    if len(unknown) > 1:
        raise NotEligible(f"feature columns {unknown} are variable-length arrays in the files (one at most)")
    known = sum(widths[c] or 1 for c in feature_cols if widths[c] is not None)
    return {c: (num_features - known if widths[c] is None else widths[c]) for c in feature_cols}  # type: ignore[misc]


def _footers(files: list[str], forced: bool) -> list[tuple[str, Any]]:
    """(uri, pyarrow FileMetaData) of every file, each footer read once."""
    import pyarrow.parquet as pq

    if not files:
        raise NotEligible("the scan lists no files")
    remote = [f for f in files if urlparse(f).scheme not in ("", "file")]
    if remote and not forced:
        raise NotEligible(f"{remote[0]} is not on a local file system (data.delivery='parquet' reads it through "
                          "pyarrow.fs)")
    footers = []
    for uri in files:
        try:
            footers.append((uri, pq.read_metadata(_readable(uri))))
        except (OSError, ValueError) as exc:
            raise NotEligible(f"the driver cannot read {uri} with pyarrow ({exc})") from None
    return footers


def _checked_columns(footers: list[tuple[str, Any]], used: list[str]) -> dict[str, int | None]:
    """{used column: 0 for a scalar, the width of a fixed-size array, None for a list}, after every
    file was found to hold every used column as a numeric scalar or array of the same kind."""
    widths: dict[str, int | None] = {}
    for uri, metadata in footers:
        schema = metadata.schema.to_arrow_schema()
        for name in used:
            index = schema.get_field_index(name)
            if index < 0:
                raise NotEligible(f"{uri} has no column {name!r} (a schema merged or evolved by Spark)")
            width = _numeric_width(schema.field(index).type, name)
            if name in widths and widths[name] != width:
                raise NotEligible(f"column {name!r} has different types in different files")
            widths[name] = width
    return widths


def _numeric_width(arrow_type: Any, name: str) -> int | None:
    """0 for a numeric scalar, None for a numeric list (its length is checked by the stats job, but
    only a fixed-size list says it in the schema), raising for anything pyarrow would convert
    differently from Spark (decimal, strings, structs such as ML vectors)."""
    import pyarrow as pa

    def numeric(t: Any) -> bool:
        return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)

    if numeric(arrow_type):
        return 0
    if pa.types.is_fixed_size_list(arrow_type) and numeric(arrow_type.value_type):
        return int(arrow_type.list_size)
    if (pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)) and numeric(arrow_type.value_type):
        return None
    raise NotEligible(f"column {name!r} has Parquet type {arrow_type}, which direct reads do not convert "
                      "(numeric scalars and arrays only)")


def _readable(uri: str) -> Any:
    path = local_path(uri)
    if "://" not in path:
        return path
    import pyarrow.fs as pafs

    filesystem, inner = pafs.FileSystem.from_uri(path)
    return filesystem.open_input_file(inner)


def row_groups_of(footers: list[tuple[str, Any]]) -> list[tuple[str, int, int]]:
    """(path, row group, rows) of every non-empty row group, in file order."""
    return [(local_path(uri), i, metadata.row_group(i).num_rows) for uri, metadata in footers
            for i in range(metadata.num_row_groups) if metadata.row_group(i).num_rows]


def scan_row_groups(df: DataFrame, used: list[str]) -> list[tuple[str, int, int]]:
    """The row groups of a plain Parquet scan (benchmarks build their own ParquetShards from it)."""
    return row_groups_of(_footers(_plain_scan_files(df, used), forced=True))
