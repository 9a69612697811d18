"""How often each table's ids repeat, measured on a sample of the prepared rows: what the planner
needs to price sharded embedding lookups (planner/embeddings.py measure_ids) against replicated ones.

One Spark job for every table: the sampled rows' table rows (multi-hot lists exploded, the columns
sharing a table unioned), counted per (table, row); per table the `top` largest counts come back,
and for the rest only how many distinct rows and how many lookups they hold.
"""
from __future__ import annotations

from dataclasses import dataclass

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.window import Window

from sparkdl.data.layout import FeedLayout
from sparkdl.data.sparse_inputs import prepared_names

SAMPLE_ROWS = 200_000  # rows sampled; ids in batches are drawn from these frequencies
TOP_IDS = 2_000  # the largest counts kept per table; the tail is summarised


@dataclass(frozen=True)
class TableIdCounts:
    table: str
    counts: tuple[int, ...]  # the top counts, largest first
    tail_ids: int  # distinct rows beyond the top
    tail_total: int  # lookups of those rows
    sample_rows: int  # DataFrame rows sampled


def table_id_counts(df: DataFrame, layout: FeedLayout, num_rows: int, seed: int = 0,
                    sample_rows: int = SAMPLE_ROWS, top: int = TOP_IDS) -> dict[str, TableIdCounts]:
    """{table: its sampled id counts} from the prepared DataFrame of a sparse_cols run (`num_rows`:
    its training rows, to size the sample); tables no sampled row looks up get empty counts."""
    fraction = min(1.0, sample_rows / max(num_rows, 1))
    sampled = df.sample(fraction=fraction, seed=seed) if fraction < 1.0 else df
    parts = []
    for index, feature in enumerate(layout.sparse):
        column = F.col(prepared_names(index)[0])
        rows = F.explode(column) if feature.multi_hot else column
        parts.append(sampled.select(F.lit(feature.table).alias("t"), rows.alias("r")))
    ids = parts[0]
    for part in parts[1:]:
        ids = ids.unionByName(part)
    counted = ids.groupBy("t", "r").count()
    ranked = counted.withColumn("k", F.row_number().over(Window.partitionBy("t").orderBy(F.desc("count"))))
    top_count = F.when(F.col("k") <= top, F.col("count"))
    beyond = F.col("k") > top
    summary = ranked.groupBy("t").agg(
        F.sort_array(F.collect_list(top_count), asc=False).alias("top"),
        F.sum(beyond.cast("long")).alias("tail_ids"),
        F.sum(F.when(beyond, F.col("count")).otherwise(F.lit(0))).alias("tail_total"))
    rows_sampled = max(1, round(num_rows * fraction))
    found = {row["t"]: TableIdCounts(row["t"], tuple(int(c) for c in row["top"]), int(row["tail_ids"] or 0),
                                     int(row["tail_total"] or 0), rows_sampled) for row in summary.collect()}
    for feature in layout.sparse:
        found.setdefault(feature.table, TableIdCounts(feature.table, (), 0, 0, rows_sampled))
    return found
