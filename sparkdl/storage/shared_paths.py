"""Is a local directory the same directory on the driver and on every executor's host?

checkpoint_dir and run_dir hold files that every rank writes and that other ranks, a resumed run
or the driver read back. On separate hosts a plain local path (no scheme, or file:) is a different
directory on each host unless it is a shared mount (NFS, /dbfs, /Volumes): rank 0 would mark
steps complete without the others' files, and a resume would fail on a file that is on another
host. Under a cluster master the driver writes a marker there, a small barrier job of the run's
ranks (one per training slot, as the training job will be placed) checks it sees the marker and
writes one of its own, and the driver looks for every rank's; any miss is a ConfigError before
training. local[N] and local-cluster masters share one host's disk and are not checked. The
markers are removed again, and so is the directory when the check created it.
"""
from __future__ import annotations

import shutil
import socket
import uuid
from pathlib import Path
from typing import Any, Iterator

from sparkdl.errors import ConfigError

_checked: set[tuple[str, str, int]] = set()  # (master, directory, ranks) found shared in this process


def local_directory(path: str | None) -> str | None:
    """The local filesystem path of `path`, or None for a URI pyarrow or Hadoop opens remotely."""
    if not path:
        return None
    if path.startswith("file://"):
        return path[len("file://"):]
    if path.startswith("file:"):
        return path[len("file:"):]
    if "://" in path or (":" in path.split("/", 1)[0] and not path.startswith("/")):
        return None  # s3://, hdfs://, dbfs:/ ...
    return path


def is_cluster_master(master: str) -> bool:
    return not (master.startswith("local") or master == "")


def check_shared(spark: Any, path: str | None, ranks: int, option: str) -> None:
    """Raise a ConfigError naming `option` when `path` is a local directory that the driver and the
    hosts of `ranks` ranks do not share (see the module's text)."""
    directory = local_directory(path)
    if directory is None or ranks < 1:
        return
    from sparkdl.spark.session import facts, is_connect

    if is_connect(spark):
        return  # no view of the executors' placement from a Connect client
    master = facts(spark).master()
    if not is_cluster_master(master) or (master, directory, ranks) in _checked:
        return
    root = Path(directory)
    created = _missing_parent(root)
    probe = root / f".sparkdl-shared-{uuid.uuid4().hex[:12]}"
    try:
        probe.mkdir(parents=True)
        (probe / "driver").write_text(socket.gethostname())
        seen = _rank_markers(spark, str(probe), ranks)
        missing = [(rank, host, why) for rank, host, why in seen if why] + \
            [(rank, host, "the driver does not see the file it wrote") for rank, host, why in seen
             if not why and not (probe / f"rank-{rank}").exists()]
    except OSError as exc:
        raise ConfigError(f"{option}={path!r} cannot be written from the driver: {exc}",
                          hint=f"set {option} to a directory the driver and every executor can write") from None
    finally:
        shutil.rmtree(probe, ignore_errors=True)
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
    if missing:
        detail = "; ".join(f"rank {rank} on host {host}: {why}" for rank, host, why in sorted(missing))
        raise ConfigError(f"{option}={path!r} is a local directory that is not shared between the driver "
                          f"({socket.gethostname()}) and the executors' hosts under master {master}: {detail}",
                          hint=f"set {option} to a directory every host mounts at the same path (NFS, /dbfs, "
                               "/Volumes, a shared disk) or to an object store URI (s3://..., gs://...)")
    _checked.add((master, directory, ranks))


def _missing_parent(path: Path) -> Path | None:
    """The outermost directory of `path` that does not exist yet (removed after the check)."""
    missing = None
    for candidate in [path, *path.parents]:
        if candidate.exists():
            break
        missing = candidate
    return missing


def _rank_markers(spark: Any, probe: str, ranks: int) -> list[tuple[int, str, str]]:
    """(rank, host, what is wrong or "") for every rank of a barrier job of `ranks` tasks."""

    def check(index: int, _: Iterator[Any]) -> Iterator[tuple[int, str, str]]:
        host = socket.gethostname()
        directory = Path(probe)
        if not (directory / "driver").exists():
            yield index, host, f"it does not see the driver's file {directory / 'driver'}"
            return
        try:
            (directory / f"rank-{index}").write_text(host)
        except OSError as exc:
            yield index, host, f"it cannot write there ({exc.strerror or exc})"
            return
        yield index, host, ""

    rdd = spark.sparkContext.parallelize(range(ranks), ranks).barrier().mapPartitionsWithIndex(check)
    return [(int(r), str(h), str(w)) for r, h, w in rdd.collect()]


def shared_dirs_of(train: Any, launch: Any) -> list[tuple[str, str | None]]:
    """(option, path) of the run's directories the ranks and the driver must share (config.TrainConfig
    and LaunchConfig: storage/ does not import config)."""
    return [("train.checkpoint_dir", train.checkpoint_dir), ("launch.run_dir", launch.run_dir)]


def check_run_dirs(spark: Any, train: Any, launch: Any, ranks: int) -> None:
    for option, path in shared_dirs_of(train, launch):
        check_shared(spark, path, ranks, option)


__all__ = ["check_shared", "check_run_dirs", "local_directory", "is_cluster_master"]
