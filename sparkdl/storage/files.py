"""Where a run's files live: checkpoints, the trained model's parts, TorchModel.save/load and kept plans.

One module for every file sparkdl writes or reads outside Spark's own writers. Paths are local paths
or pyarrow filesystem URIs (file://, s3://?endpoint_override=..., gs://, abfs://, hdfs:// where
libhdfs is installed). Writes are atomic on local disks: a file goes to a temporary name, is flushed,
fsynced and renamed (the directory fsynced too); local files are created exclusive, not through a
link, mode 0600, and the directories sparkdl makes for them 0700 (storage/private_dirs.py). An
object store's upload becomes visible once complete; one that fails is deleted again, so the window
where a reader could list half an object is short, and sparkdl's readers never go by listing alone
(a manifest, metadata written last).

Spark ML's metadata (DefaultParamsWriter) still goes through the session (Hadoop on a classic driver,
sparkdl/spark/session.py): PipelineModel.load reads it there. Worker-side: no pyspark import at module level.
"""
from __future__ import annotations

import os
import re
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO, Iterator

from sparkdl.errors import SparkdlError
from sparkdl.storage.private_dirs import make_dirs, open_private

if TYPE_CHECKING:
    import pyarrow.fs as pafs

WRITE_PIECE_BYTES = 8 << 20
_SCHEME = re.compile(r"^[A-Za-z][\w+.-]+:")  # two letters or more: C:\\ is a Windows drive, not a scheme  # one write() to a stream: bounded so no second copy of a large payload forms


@dataclass(frozen=True)
class Location:
    """A resolved path: the pyarrow filesystem, the path on it, and whether it is this host's disk."""

    fs: "pafs.FileSystem"
    path: str
    local: bool

    def child(self, *names: str) -> "Location":
        return Location(self.fs, "/".join([self.path.rstrip("/"), *names]), self.local)

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]


def locate(uri: str) -> Location:
    """The filesystem and path of a local path or URI; SparkdlError when pyarrow cannot open it."""
    import pyarrow.fs as pafs

    target = uri[len("file:"):] if uri.startswith("file:") and not uri.startswith("file://") else uri
    if "://" not in target and _SCHEME.match(target):  # dbfs:/x, hdfs:/x: Hadoop's, not a local name
        raise SparkdlError(f"cannot open {uri!r} with pyarrow (a scheme without '//')",
                           hint="the session's Hadoop filesystem carries it where Spark writes it; sparkdl's own "
                                "files need a local path or a URI such as s3://, gs://, abfs://")
    try:
        if "://" not in target:
            return Location(pafs.LocalFileSystem(), os.path.abspath(target), True)
        fs, path = pafs.FileSystem.from_uri(target)
    except (OSError, ValueError, TypeError) as exc:  # pyarrow: unknown scheme, missing libhdfs, bad query
        raise SparkdlError(f"cannot open {uri!r}: {_first_line(exc)}",
                           hint="use a local path or a URI pyarrow opens (file://, s3://, gs://, abfs://, "
                                "hdfs:// with libhdfs)") from None
    return Location(fs, path, isinstance(fs, pafs.LocalFileSystem))


def join(uri: str, *names: str) -> str:
    """`uri` with path segments appended, before its query (s3://b/p?endpoint_override=... keeps
    its options)."""
    base, question, query = uri.partition("?")
    return "/".join([base.rstrip("/"), *(n.strip("/") for n in names)]) + question + query


def is_local_path(uri: str) -> bool:
    """A path on this host's own disk (a different directory on every host of a cluster)."""
    return uri.startswith("file:") or ("://" not in uri and not _SCHEME.match(uri))


@contextmanager
def atomic_output(where: Location) -> Iterator[BinaryIO]:
    """A stream whose bytes appear at `where` only when the block ends without an exception."""
    directory = where.path.rsplit("/", 1)[0]
    if directory and where.local:
        make_dirs(directory)  # what sparkdl makes is 0700; the user's own directories stay as they are
    elif directory:
        where.fs.create_dir(directory, recursive=True)
    if not where.local:
        # An object store makes an object visible only when its upload completes. pyarrow completes
        # it on close even after an exception, so a failed block deletes what it published: readers
        # that go by a manifest (checkpoints) or by metadata written last (saves) never take it.
        stream = where.fs.open_output_stream(where.path)
        try:
            yield stream
        except BaseException:
            with _ignored():
                stream.close()
                where.fs.delete_file(where.path)
            raise
        stream.close()
        return
    temporary = f"{where.path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        # 0600, exclusive and not through a link: checkpoints hold the model and optimizer state, and
        # a checkpoint directory may be shared; the rename then replaces a link at the name, not its target.
        with open_private(temporary) as stream:
            yield stream  # type: ignore[misc]
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, where.path)
    except BaseException:
        with _ignored():
            os.unlink(temporary)
        raise
    _fsync_directory(directory)


def write_atomic(where: Location, data: bytes | memoryview) -> None:
    with atomic_output(where) as stream:
        view = memoryview(data)
        for start in range(0, len(view), WRITE_PIECE_BYTES):
            stream.write(view[start: start + WRITE_PIECE_BYTES])


def read_all(where: Location) -> bytes:
    """The file's bytes; FileNotFoundError when it is not there."""
    if not exists(where):
        raise FileNotFoundError(where.path)
    with where.fs.open_input_stream(where.path) as stream:
        return stream.read()


def open_input(where: Location) -> Any:
    """A seekable input file (pyarrow NativeFile); FileNotFoundError when it is not there."""
    if not exists(where):
        raise FileNotFoundError(where.path)
    return where.fs.open_input_file(where.path)


def exists(where: Location) -> bool:
    import pyarrow.fs as pafs

    return where.fs.get_file_info(where.path).type != pafs.FileType.NotFound


def is_dir(where: Location) -> bool:
    import pyarrow.fs as pafs

    return where.fs.get_file_info(where.path).type == pafs.FileType.Directory


def list_names(where: Location) -> list[str]:
    """Names directly under a directory (empty when it does not exist)."""
    import pyarrow.fs as pafs

    if not is_dir(where):
        return []
    return sorted(info.base_name for info in where.fs.get_file_info(pafs.FileSelector(where.path)))


def delete_tree(where: Location) -> None:
    """A directory and what it holds, or a file; nothing when absent."""
    import pyarrow.fs as pafs

    kind = where.fs.get_file_info(where.path).type
    if kind == pafs.FileType.Directory:
        where.fs.delete_dir(where.path)
    elif kind != pafs.FileType.NotFound:
        where.fs.delete_file(where.path)


def remove_empty_dir(where: Location) -> None:
    """A local directory once nothing is left in it (an object store has no empty directories to
    remove); nothing when it is absent or still holds files."""
    if where.local:
        with _ignored():
            os.rmdir(where.path)


def _fsync_directory(directory: str) -> None:
    """The rename itself survives a crash of the machine."""
    if not directory or not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def _ignored() -> Iterator[None]:
    try:
        yield
    except OSError:
        pass


# -- files beside Spark ML's metadata (TorchModel.save/load) -------------------------------------
def pyarrow_reaches(uri: str) -> bool:
    """Whether pyarrow itself opens `uri` (else the session's Hadoop filesystem carries the file)."""
    try:
        locate(uri)
    except SparkdlError:
        return False
    return True


def write_bytes(spark: Any, uri: str, payload: bytes) -> None:
    """A small file where the session writes Spark ML metadata: through pyarrow when it reaches the
    URI (atomic), else through the session (Hadoop on a classic driver: dbfs:, s3a:, ...)."""
    try:
        if pyarrow_reaches(uri):
            write_atomic(locate(uri), payload)
            return
        from sparkdl.spark.session import facts

        facts(spark).write_bytes(uri, payload)
    except SparkdlError:
        raise
    except Exception as exc:  # noqa: BLE001 - Py4J and pyarrow errors carry the filesystem's reason in their text
        raise SparkdlError(f"cannot write {uri!r}: {_first_line(exc)}",
                           hint="check that the path is writable from the driver") from None


def read_bytes(spark: Any, uri: str) -> bytes:
    """The file's bytes; FileNotFoundError when it is not there."""
    if pyarrow_reaches(uri):
        return read_all(locate(uri))
    from sparkdl.spark.session import facts

    return facts(spark).read_bytes(uri)


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip() and not ln.strip().startswith("at ")]
    return lines[1] if len(lines) > 1 and lines[0].startswith("An error occurred") else (lines[0] if lines else "")


def read_plan_file(path: str) -> str:
    """A plan's JSON from a local path or a pyarrow filesystem URI (no Spark needed)."""
    from sparkdl.errors import ConfigError

    try:
        return read_all(locate(path)).decode("utf-8")
    except (OSError, ValueError, SparkdlError) as exc:
        raise ConfigError(f"cannot read train.plan_file {path!r}: {_first_line(exc)}",
                          hint="write one with `sparkdl plan --conf ... --out plan.json`, or pass plan= instead") from None
