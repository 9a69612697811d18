"""Petastorm's side of the ingest comparison: make_spark_converter (the DataFrame written as a
Parquet cache) and make_torch_dataloader read by 2 shard processes at once.

Petastorm imports pyarrow.filesystem, removed in pyarrow 16, so it cannot import beside PySpark 4
(which needs pyarrow >= 18). Then `legacy_round` runs the same round in a second interpreter,
.venv-petastorm (PySpark 3.5, pyarrow < 16, built by `make bench`), over a DataFrame of the same shape
made by the same code: `python petastorm_reader.py --rows N ...` prints one round's JSON.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

_BENCHMARKS = str(Path(__file__).resolve().parents[1])
if _BENCHMARKS not in sys.path:
    sys.path.insert(0, _BENCHMARKS)

from peers_parts import common  # noqa: E402

# pip's output for petastorm: `make bench` keeps it in the bench venv; an ad-hoc build may have left /tmp's
BENCH_VENV_LOGS = (Path(sys.prefix) / "petastorm-install.log", Path("/tmp/benchvenv.log"))
LEGACY_PYTHON = Path(_BENCHMARKS).parent / ".venv-petastorm" / "bin" / "python"


def error_text(exc: BaseException, stage: str, limit: int = 2000) -> str:
    """Type and message verbatim, plus where it was raised, so a reader can look it up."""
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" [raised at {frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line}]" if frames else ""
    return f"{stage}: {text[:limit]}{where}"


class Reported(Exception):
    """An error whose text is already formatted (it may come from another process)."""


def rate(rows: list[int], seconds: list[float]) -> float:
    return sum(rows) / max(seconds) if seconds and max(seconds) > 0 else float("nan")


def _petastorm_shard(converter: Any, shard: int, batch_size: int, names: list[str], barrier: Any,
                     queue: Any) -> None:
    """One reader rank in its own process: two passes over its shard (the cache is already written)."""
    try:
        import time

        import torch

        torch.set_num_threads(1)
        passes = []
        for _ in range(2):
            barrier.wait(timeout=600)  # both shards read at the same time
            started, seen, total = time.perf_counter(), 0, 0.0
            with converter.make_torch_dataloader(batch_size=batch_size, num_epochs=1, cur_shard=shard,
                                                 shard_count=common.WORLD) as loader:
                for batch in loader:  # a dict of column tensors
                    features = torch.stack([batch[name] for name in names], dim=1).float()
                    total += float(features.sum())
                    seen += int(features.shape[0])
                passes.append({"rows": seen, "seconds": time.perf_counter() - started})
        queue.put((shard, passes, None))
    except BaseException as exc:  # noqa: BLE001 - reported to the driver verbatim
        queue.put((shard, None, error_text(exc, f"petastorm reader shard {shard}")))
        barrier.abort()  # the other shard must not wait for this one forever


def petastorm_round(spark: Any, frame: Any, args: argparse.Namespace) -> dict[str, float]:
    from petastorm.spark import SparkDatasetConverter, make_spark_converter

    cache = (Path(args.work_dir) / "petastorm-cache").resolve()
    cache.mkdir(parents=True, exist_ok=True)
    spark.conf.set(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF, cache.as_uri())
    try:
        convert_s, converter = common.timed(lambda: make_spark_converter(frame))
    except Exception as exc:  # noqa: BLE001
        raise Reported(error_text(exc, "make_spark_converter")) from None
    shards: list[Any] = []
    try:
        # Spawned (not forked) so the shards share nothing with this JVM-backed driver.
        context = multiprocessing.get_context("spawn")
        barrier, queue = context.Barrier(common.WORLD), context.Queue()
        names = common.feature_names(args.features)
        shards = [context.Process(target=_petastorm_shard, args=(converter, r, args.batch_size, names, barrier, queue))
                  for r in range(common.WORLD)]
        for process in shards:
            process.start()
        reports = [queue.get(timeout=1800) for _ in shards]
    finally:
        for process in shards:
            process.join(timeout=60)
            if process.is_alive():  # a hung reader must not keep this interpreter from exiting
                process.terminate()
        converter.delete()  # also forgets the cached plan, so the next round writes its cache afresh
    # The shard that failed first is the story; the other only saw its barrier broken.
    failed = sorted((error for _, _, error in reports if error), key=lambda e: "BrokenBarrierError" in e)
    if failed:
        raise Reported(failed[0])
    passes = [p for _, p, _ in sorted(reports, key=lambda r: r[0])]
    rows = [p[0]["rows"] for p in passes]
    return {"petastorm_epoch1": sum(rows) / (convert_s + max(p[0]["seconds"] for p in passes)),
            "petastorm_epochs2plus": rate([p[1]["rows"] for p in passes], [p[1]["seconds"] for p in passes])}


def install_line() -> str | None:
    """What pip said about petastorm when the bench venv was built (the log may be absent)."""
    log_path = next((p for p in BENCH_VENV_LOGS if p.exists()), None)
    if log_path is None:
        return None
    lines = log_path.read_text(errors="replace").splitlines()
    installed = [ln.strip() for ln in lines if ln.startswith("Successfully installed") and "petastorm-" in ln]
    if installed:
        return f"pip (from {log_path}): {installed[-1]}"
    failures = [ln.strip() for ln in lines if ("ERROR" in ln or "error:" in ln) and "petastorm" in ln.lower()]
    return f"pip install petastorm failed (from {log_path}): " + " | ".join(failures[:5]) if failures else None


def import_error() -> str | None:
    try:
        from petastorm.spark import SparkDatasetConverter, make_spark_converter  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - ImportError or anything petastorm raises on import
        return error_text(exc, "import petastorm.spark")
    return None


def legacy_round(args: argparse.Namespace) -> dict[str, float]:
    """One round in .venv-petastorm (its own local[2] Spark 3.5 session, same rows and columns)."""
    python = Path(os.environ.get("SPARKDL_PETASTORM_PYTHON", LEGACY_PYTHON))
    env = dict(os.environ, PYSPARK_PYTHON=str(python), PYSPARK_DRIVER_PYTHON=str(python))
    env.pop("SPARK_HOME", None)
    cmd = [str(python), __file__, "--rows", str(args.rows), "--features", str(args.features),
           "--batch-size", str(args.batch_size), "--work-dir", str(args.work_dir)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise Reported(f"petastorm in {python} (rc={done.returncode}): {done.stderr.strip()[-1500:]}")
    out = json.loads(lines[-1])
    if "error" in out:
        raise Reported(out["error"])
    return out


def legacy_versions() -> str | None:
    """'petastorm X, pyarrow Y, pyspark Z' of .venv-petastorm, or None when it is not there."""
    python = Path(os.environ.get("SPARKDL_PETASTORM_PYTHON", LEGACY_PYTHON))
    if not python.exists():
        return None
    probe = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(', '.join("
                            "f'{p} {m.version(p)}' for p in ('petastorm', 'pyarrow', 'pyspark')))"],
                           capture_output=True, text=True, timeout=120)
    return probe.stdout.strip() if probe.returncode == 0 else None


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one Petastorm ingest round (run by ingest.py)")
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--features", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--work-dir", type=Path, required=True)
    cli = parser.parse_args()
    session = common.spark_session()
    try:
        frame = common.make_frame(session, cli.rows, cli.features)
        result: dict[str, Any] = petastorm_round(session, frame, cli)
    except Reported as exc:
        result = {"error": str(exc)}
    except Exception as exc:  # noqa: BLE001 - reported verbatim to the parent
        result = {"error": error_text(exc, "petastorm round")}
    finally:
        session.stop()
    print(json.dumps(result))
