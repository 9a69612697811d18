"""Optional bridge to the JVM side (jvm-bridge/): the BarrierWatch listener and the Preflight check.

The jar is compiled with javac against the jars inside the pyspark wheel (no Maven: `make jvm`, which
`make test` and `make demo` run) into sparkdl/jars/sparkdl-bridge.jar. Attach it when the session is
created (`SparkSession.builder.config(map=sparkdl.spark.jvm.session_options())`: spark.jars and
spark.extraListeners, so executor events from the very start are seen) or at run time
(`attach(spark)`: the jar is loaded into the driver JVM by a class loader and the listener added).
Everything works without it (Spark Connect has no JVM to reach, or no javac built the jar): callers
get None and fall back to the Python-side checks, with less precise messages.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

JAR_NAME = "sparkdl-bridge.jar"
PACKAGE = "ai.sparkdl.bridge"
LISTENER = f"{PACKAGE}.BarrierWatch"
PREFLIGHT = f"{PACKAGE}.Preflight"
_SOURCES = Path(__file__).resolve().parents[2] / "jvm-bridge" / "src" / "main" / "java"
_log = logging.getLogger("sparkdl")
_loaded: dict[int, Any] = {}  # id of the JVM gateway -> its class loader for the bridge


def packaged_jar() -> Path:
    return Path(__file__).resolve().parents[1] / "jars" / JAR_NAME


def jar_path() -> Path | None:
    """The bridge jar: SPARKDL_BRIDGE_JAR, else the one built into the package; None if neither exists."""
    override = os.environ.get("SPARKDL_BRIDGE_JAR")
    for candidate in ([Path(override)] if override else []) + [packaged_jar()]:
        if candidate.is_file():
            return candidate
    return None


def spark_jars_dir() -> Path:
    """The jars Spark runs with: SPARK_HOME/jars, else the pyspark wheel's."""
    home = os.environ.get("SPARK_HOME")
    if home and (Path(home) / "jars").is_dir():
        return Path(home) / "jars"
    import pyspark

    return Path(pyspark.__file__).resolve().parent / "jars"


def build_jar(output: Path | None = None, sources: Path = _SOURCES) -> Path:
    """Compile jvm-bridge/ with javac against Spark's jars and package it with `jar`."""
    output = output or packaged_jar()
    javac, jar = shutil.which("javac"), shutil.which("jar")
    if javac is None or jar is None:
        raise RuntimeError("javac and jar (a JDK >= 17) are needed to build the sparkdl JVM bridge; "
                           "`make check-java` says how to install one")
    files = sorted(str(p) for p in sources.rglob("*.java"))
    if not files:
        raise RuntimeError(f"no Java sources under {sources}")
    with tempfile.TemporaryDirectory(prefix="sparkdl-jvm-") as classes:
        subprocess.run([javac, "--release", "17", "-Xlint:all,-path", "-Werror", "-d", classes,
                        "-cp", str(spark_jars_dir() / "*"), *files], check=True)
        output.parent.mkdir(parents=True, exist_ok=True)
        temporary = output.with_suffix(".tmp")
        subprocess.run([jar, "cf", str(temporary), "-C", classes, "."], check=True)
        temporary.replace(output)
    return output


def session_options(jar: Path | None = None) -> dict[str, str]:
    """Spark options that load the bridge when a session is created (listener from the start).
    Empty when the driver JVM is already running (spark-submit, an existing gateway): spark.jars set
    then would not reach the driver's class path, and an unloadable listener fails the session;
    `attach` (run by every fit) covers that case."""
    jar = jar or jar_path()
    if jar is None or "PYSPARK_GATEWAY_PORT" in os.environ:
        return {}
    return {"spark.jars": str(jar), "spark.extraListeners": LISTENER}


def _bridge(spark: Any, jar: Path | None = None) -> Any:
    """The class loader that sees the bridge classes in this driver JVM, or None."""
    try:
        gateway = spark.sparkContext._gateway  # noqa: SLF001 - no public handle on the JVM
        jvm = spark.sparkContext._jvm  # noqa: SLF001
    except Exception:  # noqa: BLE001 - Spark Connect: no JVM on this side
        return None
    if gateway is None or jvm is None:
        return None
    key = id(gateway)
    if key in _loaded:
        return _loaded[key]
    parent = jvm.java.lang.Thread.currentThread().getContextClassLoader()
    try:
        parent.loadClass(LISTENER)  # attached at session creation (spark.jars)
        loader = parent
    except Exception:  # noqa: BLE001 - py4j wraps ClassNotFoundException
        jar = jar or jar_path()
        if jar is None:
            return None
        urls = gateway.new_array(jvm.java.net.URL, 1)
        urls[0] = jvm.java.io.File(str(jar)).toURI().toURL()
        loader = jvm.java.net.URLClassLoader(urls, parent)
    _loaded[key] = loader
    return loader


def _static(spark: Any, class_name: str, method: str, types: list[Any], args: list[Any]) -> Any:
    loader = _bridge(spark)
    if loader is None:
        return None
    gateway = spark.sparkContext._gateway  # noqa: SLF001
    jvm = spark.sparkContext._jvm  # noqa: SLF001
    cls = loader.loadClass(class_name)
    java_types = gateway.new_array(jvm.java.lang.Class, len(types))
    for i, t in enumerate(types):
        java_types[i] = t
    java_args = gateway.new_array(jvm.java.lang.Object, len(args))
    for i, a in enumerate(args):
        java_args[i] = a
    return cls.getMethod(method, java_types).invoke(None, java_args)


def bridge_loader(spark: Any) -> Any:
    """The class loader of the bridge classes in this driver JVM, or None (Spark Connect, no jar)."""
    return _bridge(spark)


def call_static(spark: Any, class_name: str, method: str, *args: Any) -> Any:
    """A public static method of a bridge class, found by name and argument count. An argument is a
    JVM object, or (element type, value): a list becomes a Java array of that type ("int",
    "java.lang.String"), a Python scalar stays one."""
    loader = _bridge(spark)
    if loader is None:
        raise RuntimeError("the sparkdl JVM bridge is not reachable from this session")
    gateway = spark.sparkContext._gateway  # noqa: SLF001
    jvm = spark.sparkContext._jvm  # noqa: SLF001
    cls = loader.loadClass(class_name)
    found = [m for m in cls.getMethods() if m.getName() == method and m.getParameterCount() == len(args)]
    if not found:
        raise RuntimeError(f"{class_name} has no public static {method} of {len(args)} arguments")
    java_args = gateway.new_array(jvm.java.lang.Object, len(args))
    for i, arg in enumerate(args):
        if isinstance(arg, tuple) and isinstance(arg[1], (list, tuple)):
            kind, values = arg
            element = jvm.int if kind == "int" else getattr(jvm, kind.split(".")[0])
            for part in kind.split(".")[1:]:
                element = getattr(element, part)
            array = gateway.new_array(element, len(values))
            for j, value in enumerate(values):
                array[j] = value
            java_args[i] = array
        else:
            java_args[i] = arg[1] if isinstance(arg, tuple) else arg
    return found[0].invoke(None, java_args)


def attach(spark: Any, jar: Path | None = None) -> bool:
    """Make sure a BarrierWatch listens in this session (added now unless it already does)."""
    loader = _bridge(spark, jar)
    if loader is None:
        return False
    if _static(spark, LISTENER, "isInstalled", [], []):
        return True
    gateway = spark.sparkContext._gateway  # noqa: SLF001
    jvm = spark.sparkContext._jvm  # noqa: SLF001
    cls = loader.loadClass(LISTENER)
    listener = cls.getDeclaredConstructor(gateway.new_array(jvm.java.lang.Class, 0)).newInstance(
        gateway.new_array(jvm.java.lang.Object, 0))
    spark.sparkContext._jsc.sc().addSparkListener(listener)  # noqa: SLF001
    return True


def wait_for_events(spark: Any, timeout_ms: int = 2000) -> None:
    """Let Spark's listener bus deliver what it has queued (events arrive asynchronously)."""
    try:
        spark.sparkContext._jsc.sc().listenerBus().waitUntilEmpty(timeout_ms)  # noqa: SLF001
    except Exception:  # noqa: BLE001 - private in Scala, may change; a short pause does as well
        import time

        time.sleep(0.2)


def drain_events(spark: Any) -> list[dict[str, Any]]:
    """BarrierWatch's events since the last call (empty without the bridge)."""
    try:
        text = _static(spark, LISTENER, "drain", [], [])
    except Exception as exc:  # noqa: BLE001 - the bridge is optional; never fail a fit over it
        _log.debug("sparkdl: BarrierWatch unavailable: %s", exc)
        return []
    return json.loads(text) if text else []


def preflight(spark: Any, ranks: int) -> dict[str, Any] | None:
    """Preflight's report for a barrier job of `ranks` ranks, or None without the bridge."""
    try:
        jvm = spark.sparkContext._jvm  # noqa: SLF001
        sc_class = jvm.java.lang.Class.forName("org.apache.spark.SparkContext")
        text = _static(spark, PREFLIGHT, "check", [sc_class, jvm.java.lang.Integer.TYPE],
                       [spark.sparkContext._jsc.sc(), jvm.java.lang.Integer(int(ranks))])  # noqa: SLF001
    except Exception as exc:  # noqa: BLE001 - the bridge is optional
        _log.debug("sparkdl: Preflight unavailable: %s", exc)
        return None
    return json.loads(text) if text else None
