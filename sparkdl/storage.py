"""Read and write small files: model files through Spark's Hadoop filesystem layer, kept plans through pyarrow.

TorchModel.save writes Spark ML metadata through Hadoop; its model files must land on the same
filesystem (HDFS, S3A, ABFS, DBFS, a local disk), so they go through Hadoop too, via py4j.
"""
from __future__ import annotations

from typing import Any

from sparkdl.errors import SparkdlError

_PIECE = 16 << 20  # py4j copies byte arrays through its socket: bounded pieces keep memory flat


def _filesystem(spark: Any, uri: str) -> tuple[Any, Any]:
    jvm = spark.sparkContext._jvm  # noqa: SLF001 - Hadoop is reachable only through the gateway
    path = jvm.org.apache.hadoop.fs.Path(uri)
    return path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration()), path  # noqa: SLF001


def write_bytes(spark: Any, uri: str, payload: bytes) -> None:
    fs, path = _filesystem(spark, uri)
    try:
        out = fs.create(path, True)
        try:
            for start in range(0, len(payload), _PIECE):
                out.write(bytearray(payload[start: start + _PIECE]))
        finally:
            out.close()
    except Exception as exc:  # noqa: BLE001 - Py4J errors carry the Hadoop reason in their text
        raise SparkdlError(f"cannot write {uri!r}: {_first_line(exc)}",
                           hint="check that the path is writable from the driver") from None


def read_bytes(spark: Any, uri: str) -> bytes:
    fs, path = _filesystem(spark, uri)
    if not fs.exists(path):
        raise FileNotFoundError(uri)
    stream = fs.open(path)
    try:
        jvm = spark.sparkContext._jvm  # noqa: SLF001
        return bytes(jvm.org.apache.commons.io.IOUtils.toByteArray(stream))
    finally:
        stream.close()


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip() and not ln.strip().startswith("at ")]
    return lines[1] if len(lines) > 1 and lines[0].startswith("An error occurred") else (lines[0] if lines else "")


def read_plan_file(path: str) -> str:
    """A plan's JSON from a local path or a pyarrow filesystem URI (no Spark needed)."""
    import os

    import pyarrow.fs as pafs

    from sparkdl.errors import ConfigError

    try:
        fs, where = pafs.FileSystem.from_uri(path if "://" in path else os.path.abspath(path))
        with fs.open_input_stream(where) as stream:
            return stream.read().decode("utf-8")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read train.plan_file {path!r}: {_first_line(exc)}",
                          hint="write one with `sparkdl plan --conf ... --out plan.json`, or pass plan= instead") from None
