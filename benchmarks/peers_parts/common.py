"""Helpers shared by the peers benchmark parts: the Spark session, the common DataFrame, timing,
pairwise ratios and the subprocess environment of the bare launchers."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import Any

WORLD = 2  # every comparison runs 2 ranks on this host


def log(message: str) -> None:
    """Progress goes to stderr: stdout carries only the JSON result."""
    print(f"[peers {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def ratio_entry(name: str, pairs: Sequence[tuple[float, float]], target: float | None, better: str,
                unit: str = "") -> dict[str, Any]:
    """A ratio taken pair by pair (a, b measured side by side in one round), reported as the median
    of the per-round ratios a/b. `better` is "higher" (a/b >= target wanted) or "lower" (<= target);
    target None: shown for information, no target."""
    ratios = [a / b for a, b in pairs if b > 0]
    if not ratios:  # nothing measured on both sides: no verdict (and valid JSON: null, not NaN)
        return {"name": name, "value": None, "target": target, "better": better, "met": None,
                "per_round": [], "unit": unit}
    value = median(ratios)
    met = None if target is None else value >= target if better == "higher" else value <= target
    return {"name": name, "value": round(value, 3), "target": target, "better": better,
            "met": None if met is None else bool(met),
            "per_round": [round(r, 3) for r in ratios], "unit": unit}


def bare_env(threads: int = 1) -> dict[str, str]:
    """Environment for torchrun/horovodrun ranks: this interpreter's venv first on PATH, one intra-op
    thread per rank (what sparkdl gives each of 2 ranks on 2 cores, and torchrun's own default)."""
    env = dict(os.environ)
    bin_dir = os.path.dirname(sys.executable)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                    env.get("PYTHONPATH", "")) if p)
    return env


def spark_session(driver_memory: str = "6g") -> Any:
    """local[2] (2 ranks = 2 task slots on this 2-core host); executors run this interpreter."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    # Before the JVM starts: Python workers take PYTHONPATH from its environment, and functions of
    # peers_parts (pickled by reference) must import there, as in TorchDistributor's torchrun children.
    os.environ["PYTHONPATH"] = bare_env()["PYTHONPATH"]
    from pyspark.sql import SparkSession

    return (SparkSession.builder.master(f"local[{WORLD}]").appName("sparkdl-peers")
            .config("spark.driver.memory", driver_memory).config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", str(WORLD))
            .config("spark.sql.execution.arrow.pyspark.enabled", "true").getOrCreate())


def feature_names(features: int) -> list[str]:
    return [f"f{i:02d}" for i in range(features)]


def make_frame(spark: Any, rows: int, features: int, classes: int = 10, seed: int = 7) -> Any:
    """rows x `features` float columns plus an integer label, in WORLD partitions, cached and counted
    so that every tool reads the same rows from Spark's memory (no upstream recomputation timed)."""
    from pyspark.sql import functions as F

    cols = [F.rand(seed + i).cast("float").alias(name) for i, name in enumerate(feature_names(features))]
    frame = (spark.range(0, rows, 1, WORLD)
             .select(*cols, (F.abs(F.hash(F.col("id"))) % classes).cast("long").alias("label")))
    frame = frame.cache()
    frame.count()
    return frame


def as_parquet(spark: Any, frame: Any, directory: Any) -> Any:
    """The cached frame written to Parquet once and read back uncached: every tool then reads the
    same files through the same DataFrame (sparkdl's direct reads qualify: data.delivery)."""
    frame.write.mode("overwrite").parquet(str(directory))
    frame.unpersist()
    return spark.read.parquet(str(directory))


def run_workload(launcher: str, mode: str, timeout_s: float = 900, **options: Any) -> tuple[float, float, Any]:
    """Run `python -m peers_parts.workloads --mode MODE --opt value...` on WORLD ranks under the bare
    launcher ("torchrun": --standalone; "horovodrun": --gloo on localhost). Returns (wall clock at
    the call, wall seconds, rank 0's JSON)."""
    with tempfile.TemporaryDirectory(prefix="sparkdl-peers-") as tmp:
        out = os.path.join(tmp, "rank0.json")
        worker = ["-m", "peers_parts.workloads", "--mode", mode, "--out", out]
        worker += [arg for name, value in options.items() for arg in (f"--{name.replace('_', '-')}", str(value))]
        if launcher == "torchrun":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}", *worker]
        else:
            horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
            cmd = [horovodrun, "-np", str(WORLD), "--gloo", "-H", f"localhost:{WORLD}", sys.executable, *worker]
        called = time.time()
        done = subprocess.run(cmd, env=bare_env(), capture_output=True, text=True, timeout=timeout_s)
        wall = time.time() - called
        if done.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"{launcher} --mode {mode} failed (rc={done.returncode}): {done.stdout[-1500:]} "
                               f"{done.stderr[-1500:]}")
        return called, wall, json.loads(Path(out).read_text())


def run_alone(measure: Any, description: str, **defaults: Any) -> None:
    """`python part.py [--repeats N] [--option value]`: one part with its own session, JSON on stdout."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--repeats", type=int, default=3)
    for name, default in defaults.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    session = spark_session()
    print(json.dumps(measure(session, parser.parse_args())))
