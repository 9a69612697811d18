"""Driver side of packed delivery (data.delivery="packed", or "auto" when the DataFrame qualifies).

Spark's own Arrow delivery of the features builds an array per row on the executor and writes it
into Arrow element by element: on a cached DataFrame of 64 float columns that is what bounds epoch 1
(about 0.4M rows/s per rank here, while the same bytes as one binary value per row arrive at 1.5M).
The JVM bridge (ai.sparkdl.bridge.PackedRows) reads each row's values once and hands the ranks
blocks of rows instead: one binary value per block and spool column, row-major little-endian, which
the ranks view as numpy without a copy (data/arrow_rows.unpacked_batches).

Qualifies: a classic (non-Connect) session with the bridge jar, scalar numeric feature columns, the
partitioning kept (one partition per rank: nothing to deal, so the rows keep their ranks and order)
and no validation split. Everything else goes through Spark's rows, with the reason logged.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pyspark.sql import DataFrame

from sparkdl.data.arrow_rows import spool_columns
from sparkdl.errors import ConfigError

if TYPE_CHECKING:
    from sparkdl.data.feed import PreparedData

_log = logging.getLogger("sparkdl")
PACKER = "ai.sparkdl.bridge.PackedRows"
BLOCK_ROWS = 8192  # rows per block: 2 MiB of 64 float features, one Arrow batch each
ARROW_BATCH_CONF = "spark.sql.execution.arrow.maxRecordsPerBatch"
_jars_added: set[int] = set()  # SparkContexts whose executors were given the bridge jar


class NotPacked(Exception):
    """Why a DataFrame is delivered by Spark's rows rather than packed."""


def with_packed_delivery(prepared: "PreparedData", delivery: str) -> "PreparedData":
    """`prepared` with `packed` set when data.delivery allows it and the DataFrame qualifies; with
    delivery="packed" a DataFrame that does not qualify raises, saying why."""
    if delivery in ("spark", "parquet") or prepared.source is not None:
        return prepared
    try:
        packed = _pack(prepared)
    except NotPacked as why:
        if delivery == "packed":
            raise ConfigError(f"data.delivery='packed' packs blocks of rows on the JVM, but {why}",
                              hint="use data.delivery='auto' (Spark delivers what does not qualify) or 'spark'")
        _log.info("sparkdl: rows delivered as Spark's Arrow rows (not packed): %s", why)
        return prepared
    _log.info("sparkdl: rows delivered packed into blocks of %d rows (data.delivery=%r)", BLOCK_ROWS, delivery)
    return replace(prepared, packed=packed)


def _pack(prepared: "PreparedData") -> DataFrame:
    if prepared.layout.tensor_inputs:
        raise NotPacked("input_cols runs are delivered as Spark's rows (packing covers feature_cols)")
    flat = prepared.flat
    if flat is None:
        raise NotPacked("it packs scalar feature columns of a DataFrame that keeps one partition per worker, "
                        "without a validation split (this one has array or vector features, is dealt over the "
                        "workers, or holds validation rows)")
    from sparkdl.spark import jvm

    spark = flat.sparkSession
    if jvm.jar_path() is None or jvm.bridge_loader(spark) is None:
        raise NotPacked("the JVM bridge is not reachable (Spark Connect, or no sparkdl-bridge.jar built)")
    specs = spool_columns(prepared.layout)
    # Input column i (features f0..fN-1, then label, then weight) -> its output (spool) column.
    groups = [0] * prepared.layout.num_features + list(range(1, len(specs)))
    _give_executors_the_jar(spark)
    try:
        packed = jvm.call_static(spark, PACKER, "pack", flat._jdf, ("int", groups),  # noqa: SLF001
                                 ("java.lang.String", [c.name for c in specs]), ("int", BLOCK_ROWS))
    except Exception as exc:  # noqa: BLE001 - py4j wraps the JVM's exception
        raise NotPacked(f"the JVM bridge could not pack it ({str(exc).splitlines()[0][:300]})") from None
    return DataFrame(packed, spark)


def _give_executors_the_jar(spark: Any) -> None:
    """The executors deserialise the bridge's packing function: they need its jar (a jar attached at
    session creation through spark.jars is there already; adding it again is harmless)."""
    from sparkdl.spark import jvm

    context = spark.sparkContext
    if id(context) in _jars_added:
        return
    context._jsc.addJar(str(jvm.jar_path()))  # noqa: SLF001 - PySpark has no addJar of its own
    _jars_added.add(id(context))


def one_block_per_arrow_batch(spark: Any) -> Any:
    """A context manager for the packed job's execution: each Arrow batch carries one block (a block
    is already thousands of rows; Spark's default 10,000 records per batch would hold a whole
    partition). The session's own setting is restored afterwards."""
    from contextlib import contextmanager

    @contextmanager
    def scope() -> Any:
        previous = spark.conf.get(ARROW_BATCH_CONF, None)
        spark.conf.set(ARROW_BATCH_CONF, "1")
        try:
            yield
        finally:
            if previous is None:
                spark.conf.unset(ARROW_BATCH_CONF)
            else:
                spark.conf.set(ARROW_BATCH_CONF, previous)

    return scope()
