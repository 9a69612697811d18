"""Read and write small files: model files where the session writes Spark ML metadata (Hadoop via
py4j on a classic driver, pyarrow under Spark Connect: sparkdl/session.py), kept plans through pyarrow.
"""
from __future__ import annotations

from typing import Any

from sparkdl.errors import SparkdlError
from sparkdl.session import facts


def write_bytes(spark: Any, uri: str, payload: bytes) -> None:
    try:
        facts(spark).write_bytes(uri, payload)
    except Exception as exc:  # noqa: BLE001 - Py4J and pyarrow errors carry the filesystem's reason in their text
        raise SparkdlError(f"cannot write {uri!r}: {_first_line(exc)}",
                           hint="check that the path is writable from the driver") from None


def read_bytes(spark: Any, uri: str) -> bytes:
    """The file's bytes; FileNotFoundError when it is not there."""
    return facts(spark).read_bytes(uri)


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
