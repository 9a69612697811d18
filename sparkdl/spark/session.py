"""What sparkdl asks of a Spark session, for a classic (py4j) driver and a Spark Connect client alike.

Every SparkContext use lives here: a Spark Connect session (Databricks Connect, Databricks shared
access mode, Spark 4's spark.api.mode=connect) has no SparkContext and no JVM on the client side,
so each fact has a classic answer (the JVM's own figure) and a Connect one (conf values the server
reports, a tiny probe job, pyarrow filesystems, bytes inside the task closure).
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import weakref
from typing import Any, ContextManager, Iterable, Iterator, Protocol

log = logging.getLogger("sparkdl")
_PIECE = 16 << 20  # py4j copies byte arrays through its socket: bounded pieces keep memory flat
_LOCAL = re.compile(r"^local(?:\[(\*|\d+)(?:,\s*\d+)?\])?$")
_LOCAL_CLUSTER = re.compile(r"^local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*\d+\s*\]$")
_warned: set[str] = set()
# Per session: (module, names looked up in it) -> whether the executors can import it.
_importable: "weakref.WeakKeyDictionary[Any, dict[tuple[str, tuple[str, ...]], bool]]" = weakref.WeakKeyDictionary()


def is_connect(spark: Any) -> bool:
    """A Spark Connect session (no SparkContext behind it on this side)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


class SessionFacts(Protocol):
    """What the rest of sparkdl may ask of a session; ClassicSession and ConnectSession answer."""

    connect: bool

    def master(self) -> str: ...
    def conf(self, key: str, default: str | None = None) -> str | None: ...
    def slots(self, profile: Any = None, wanted: int = 0) -> int: ...
    def executors(self) -> tuple[str, ...]: ...
    def channel_host(self) -> str: ...
    def job_group(self, group: str, description: str) -> ContextManager[None]: ...
    def ship(self, payload: bytes) -> Any: ...
    def num_partitions(self, df: Any) -> int | None: ...
    def metadata_context(self) -> Any: ...
    def write_bytes(self, uri: str, payload: bytes) -> None: ...
    def read_bytes(self, uri: str) -> bytes: ...


def facts(spark: Any) -> SessionFacts:
    return ConnectSession(spark) if is_connect(spark) else ClassicSession(spark)


def warn_once(what: str, message: str) -> None:
    """One logged line per process for a capability a Connect session lacks."""
    if what not in _warned:
        _warned.add(what)
        log.warning("sparkdl: %s", message)


class Shipped:
    """Bytes a task reads as `.value`, like a broadcast variable; travels inside the task closure."""

    def __init__(self, payload: bytes) -> None:
        self.value = payload


def without_driver(executors: list[str], driver: str) -> tuple[str, ...]:
    """The executors' host:port with the driver's own entry taken out, wherever it sorts (on separate
    hosts it is not the first one); the driver alone (local mode) stays."""
    others = tuple(e for e in executors if e != driver)
    return others or tuple(executors)


def local_master_slots(master: str, task_cpus: int) -> int | None:
    """Slots of a local or local-cluster master from its URL alone; None for a cluster manager."""
    if (match := _LOCAL.match(master)) is not None:
        cores = match.group(1)
        return (os.cpu_count() or 1) if cores == "*" else int(cores or 1)
    if (match := _LOCAL_CLUSTER.match(master)) is not None:
        return int(match.group(1)) * (int(match.group(2)) // max(task_cpus, 1))
    return None


def task_cpus(value: str | None) -> int:
    """spark.task.cpus as a whole number >= 1 (1 when unset or unreadable, Spark's default)."""
    try:
        return max(int(value or 1), 1)
    except ValueError:
        return 1


def executor_cores(master: str, cores_conf: str | None) -> int | None:
    """Each executor's cores from the master URL (local[N]: N, local[*]: the machine's;
    local-cluster[n,c,m]: c) or spark.executor.cores; None when only the cluster knows (a standalone
    worker's executor takes all the worker's cores when spark.executor.cores is unset)."""
    if (match := _LOCAL.match(master)) is not None:
        cores = match.group(1)
        return (os.cpu_count() or 1) if cores == "*" else int(cores or 1)
    if (match := _LOCAL_CLUSTER.match(master)) is not None:
        return int(match.group(2))
    try:
        return int(cores_conf) if cores_conf else None
    except ValueError:
        return None


def static_slots(master: str, task_cpus: str | None, instances: str | None, cores: str | None,
                 dynamic_allocation: str | None) -> int | None:
    """Slots the conf values alone tell: a local master's, or static allocation's instances x cores
    / task cpus; None when only the running cluster knows (dynamic allocation, unset values)."""
    cpus = max(int(task_cpus or 1), 1)
    local = local_master_slots(master, cpus)
    if local is not None:
        return local
    if instances and cores and (dynamic_allocation or "false").strip().lower() != "true":
        return int(instances) * (int(cores) // cpus)
    return None


def is_local_master(master: str) -> bool:
    """local / local[N]: the slot count is final (no cluster manager adds executors)."""
    return master == "local" or master.startswith("local[")


class ClassicSession:
    """A classic PySpark driver: the SparkContext and its JVM."""

    connect = False

    def __init__(self, spark: Any) -> None:
        self.spark = spark
        self.sc = spark.sparkContext

    def master(self) -> str:
        return str(self.sc.master)

    def conf(self, key: str, default: str | None = None) -> str | None:
        return self.sc.getConf().get(key, default)

    def slots(self, profile: Any = None, wanted: int = 0) -> int:
        """Tasks Spark can run at once now, as its own barrier check counts them; under `profile` (a
        stage-level ResourceProfile) its GPU amount bounds the count too."""
        try:
            jsc = self.sc._jsc.sc()  # noqa: SLF001 - Spark exposes this count only on the JVM side
            manager = jsc.resourceProfileManager()
            if profile is None:
                java_profile = manager.defaultResourceProfile()
            else:
                java_profile = profile._java_resource_profile  # noqa: SLF001
                manager.addResourceProfile(java_profile)  # idempotent; Spark counts only known profiles
            return int(jsc.maxNumConcurrentTasks(java_profile))
        except Exception:  # noqa: BLE001 - an older Spark: fall back to the public figure
            return int(self.sc.defaultParallelism)

    def executors(self) -> tuple[str, ...]:
        """host:port of every executor, the driver excluded (in local mode the driver is the one
        executor, and is kept)."""
        try:
            listed = self.sc._jsc.sc().statusStore().executorList(True)  # noqa: SLF001 - ids, which the tracker lacks
            entries, items = [], listed.iterator()
            while items.hasNext():
                entry = items.next()
                entries.append((str(entry.id()), str(entry.hostPort())))
        except Exception:  # noqa: BLE001
            return ()
        return without_driver(sorted(hp for _, hp in entries), next((hp for i, hp in entries if i == "driver"), ""))

    def channel_host(self) -> str:
        """The address executors reach this driver at."""
        return self.conf("spark.driver.host", "127.0.0.1") or "127.0.0.1"

    @contextlib.contextmanager
    def job_group(self, group: str, description: str) -> Iterator[None]:
        """Jobs started inside carry `group` (cancellable as one from the Spark UI)."""
        self.sc.setJobGroup(group, description, interruptOnCancel=True)
        try:
            yield
        finally:
            self.sc.setLocalProperty("spark.jobGroup.id", None)
            self.sc.setLocalProperty("spark.job.description", None)

    def ship(self, payload: bytes) -> Any:
        """`payload` for every task of a job, sent once per executor (a broadcast variable)."""
        return self.sc.broadcast(payload)

    def num_partitions(self, df: Any) -> int | None:
        return int(df.rdd.getNumPartitions())

    def metadata_context(self) -> Any:
        """What Spark ML's DefaultParamsWriter/Reader take to write and read metadata."""
        return self.sc

    # Model files must land where Spark ML's metadata does (HDFS, S3A, ABFS, DBFS, a local disk):
    # through Hadoop, via py4j.
    def _filesystem(self, uri: str) -> tuple[Any, Any]:
        jvm = self.sc._jvm  # noqa: SLF001 - Hadoop is reachable only through the gateway
        path = jvm.org.apache.hadoop.fs.Path(uri)
        return path.getFileSystem(self.sc._jsc.hadoopConfiguration()), path  # noqa: SLF001

    def write_bytes(self, uri: str, payload: bytes) -> None:
        fs, path = self._filesystem(uri)
        out = fs.create(path, True)
        try:
            for start in range(0, len(payload), _PIECE):
                out.write(bytearray(payload[start: start + _PIECE]))
        finally:
            out.close()

    def read_bytes(self, uri: str) -> bytes:
        fs, path = self._filesystem(uri)
        if not fs.exists(path):
            raise FileNotFoundError(uri)
        stream = fs.open(path)
        try:
            return bytes(self.sc._jvm.org.apache.commons.io.IOUtils.toByteArray(stream))  # noqa: SLF001
        finally:
            stream.close()


class ConnectSession:
    """A Spark Connect client: conf values from the server, jobs for everything else."""

    connect = True
    PROBE_SECONDS = 2.0  # how long each probe task holds its slot: covers the spread of task start times

    def __init__(self, spark: Any) -> None:
        self.spark = spark

    def master(self) -> str:
        return str(self.conf("spark.master", "") or "")

    def conf(self, key: str, default: str | None = None) -> str | None:
        try:
            return self.spark.conf.get(key, default)
        except Exception:  # noqa: BLE001 - a server may refuse to show a static conf value
            return default

    def slots(self, profile: Any = None, wanted: int = 0) -> int:
        """From the master URL or the static executor settings when they say it; else a tiny probe
        job of `wanted` tasks tells how many ran at the same time."""
        known = static_slots(self.master(), self.conf("spark.task.cpus"), self.conf("spark.executor.instances"),
                             self.conf("spark.executor.cores"), self.conf("spark.dynamicAllocation.enabled"))
        return known if known is not None else self.probe_slots(max(wanted, 1))

    def probe_slots(self, tasks: int) -> int:
        """How many of `tasks` tasks, each holding its slot for PROBE_SECONDS, Spark ran at the same
        time (at most `tasks`; never more than the slots, fewer only if start times spread wider)."""
        import pyarrow as pa

        seconds = self.PROBE_SECONDS

        def hold_slot(batches: Any) -> Any:
            import time as clock

            started = clock.time()
            for _ in batches:
                pass
            clock.sleep(seconds)
            yield pa.RecordBatch.from_pydict({"start": [started], "end": [clock.time()]})

        rows = (self.spark.range(0, tasks, 1, tasks).mapInArrow(hold_slot, "start double, end double")
                .collect())
        return max_overlap([(r["start"], r["end"]) for r in rows])

    def executors(self) -> tuple[str, ...]:
        return ()  # no JVM view of the cluster from a Connect client

    def channel_host(self) -> str:
        """This client's address on the interface that routes to the Connect server: the executors
        are on the server's side of the network, so that is the address they most likely reach."""
        server = getattr(getattr(getattr(self.spark, "client", None), "_builder", None), "host", None)
        return route_address(server or "127.0.0.1")

    @contextlib.contextmanager
    def job_group(self, group: str, description: str) -> Iterator[None]:
        self.spark.addTag(group)  # SparkSession.interruptTag(group) cancels the run
        try:
            yield
        finally:
            self.spark.removeTag(group)

    def ship(self, payload: bytes) -> Any:
        return Shipped(payload)  # inside the closure: Connect has no broadcast variables

    def num_partitions(self, df: Any) -> int | None:
        return None  # no RDD view: the caller repartitions

    def metadata_context(self) -> Any:
        return self.spark

    # Spark ML's metadata is written by the server through Spark's own writers; the model files go
    # through pyarrow from here, so the path must be one both sides see (an object store, DBFS,
    # a shared or same-host disk).
    @staticmethod
    def _filesystem(uri: str) -> tuple[Any, str]:
        import pyarrow.fs as pafs

        local = uri[len("file:"):] if uri.startswith("file:") else uri
        if "://" not in local:
            return pafs.LocalFileSystem(), os.path.abspath(re.sub(r"^/+", "/", local))
        return pafs.FileSystem.from_uri(uri)

    def write_bytes(self, uri: str, payload: bytes) -> None:
        fs, path = self._filesystem(uri)
        fs.create_dir(os.path.dirname(path), recursive=True)
        with fs.open_output_stream(path) as out:
            for start in range(0, len(payload), _PIECE):
                out.write(payload[start: start + _PIECE])

    def read_bytes(self, uri: str) -> bytes:
        import pyarrow.fs as pafs

        fs, path = self._filesystem(uri)
        if fs.get_file_info(path).type == pafs.FileType.NotFound:
            raise FileNotFoundError(uri)
        with fs.open_input_stream(path) as stream:
            return stream.read()


def executors_can_import(spark: Any, questions: Iterable[tuple[str, tuple[str, ...]]]) -> frozenset[str]:
    """Which modules of `questions` ((dotted name, top-level names looked up in it)) the executors'
    Python can import, located without importing (spark/importable.py): one small job, a task per
    known executor (a module counts when every task found it), classic and Connect alike. Answers
    are kept per session, so a session asks about each module once."""
    import pyarrow as pa

    asked = sorted({(name, tuple(sorted(needed))) for name, needed in questions})
    known = _importable.setdefault(spark, {})
    unknown = [q for q in asked if q not in known]
    if unknown:
        def find(batches: Any) -> Any:
            from sparkdl.spark.importable import importable

            for _ in batches:
                pass
            yield pa.RecordBatch.from_pydict({"found": [importable(unknown)]}, schema=pa.schema(
                [("found", pa.list_(pa.string()))]))

        tasks = max(1, min(len(facts(spark).executors()), 16))
        rows = spark.range(0, tasks, 1, tasks).mapInArrow(find, "found array<string>").collect()
        everywhere = set.intersection(*(set(r["found"] or ()) for r in rows)) if rows else set()
        known.update({q: q[0] in everywhere for q in unknown})
    return frozenset(name for name, needed in asked if known[(name, needed)])


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The largest number of (start, end) intervals open at one instant."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals],
                    key=lambda e: (e[0], e[1]))  # an end before a start at the same instant
    best = open_now = 0
    for _, delta in events:
        open_now += delta
        best = max(best, open_now)
    return best


def route_address(server_host: str) -> str:
    """The local IP this machine would use to reach `server_host` (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((server_host, 9))
            return str(probe.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())
