"""Tracking overhead benchmark: training step time with MLflow tracking + progress bar ON vs OFF.

One SparkSession (local[2]), one generated DataFrame (--rows x 64 float features + a class label
0..9, cached and counted first), an MLP 64 -> 256 -> 256 -> 10 trained by TorchEstimator with 2
workers. Fits alternate OFF, ON, OFF, ON, ... (--repeats pairs) so both settings see the same
machine state.

The step time compared excludes Spark job startup, spooling (epoch 1) and model logging: it is
taken from the per-epoch history each fit returns, epochs 2+ only (sum of seconds / sum of steps).
ON = tracking=True (MLflow, a sqlite store in a temporary directory) and progress=True (tqdm on
stderr); OFF = both False. The target is ON/OFF <= 1.03. --breakdown adds tracking-only and
progress-only fits to the rotation. Also reported: the driver process's CPU time per timed step
(on local[2] the driver shares the cores with both workers, so what it spends is taken from them)
and, for information, whole-fit wall times, which include the MLflow run creation, the params,
the loss curve and the model.

Prints one JSON object as the last line of stdout (the progress bar goes to stderr). Nothing here
asserts a timing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FEATURES = 64
CLASSES = 10
TARGET_OVERHEAD_PCT = 3.0
EXPERIMENT = "sparkdl-bench-tracking"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000, help="rows of the generated DataFrame")
    parser.add_argument("--repeats", type=int, default=4, help="OFF/ON pairs of fits")
    parser.add_argument("--epochs", type=int, default=2, help="epochs per fit (epochs 2+ are timed)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--breakdown", action="store_true",
                        help="also alternate tracking-only and progress-only fits, to say which one costs")
    args = parser.parse_args()
    if min(args.rows, args.repeats, args.batch_size, args.log_every) < 1:
        parser.error("--rows, --repeats, --batch-size and --log-every must be >= 1")
    if args.epochs < 2:
        parser.error("--epochs must be >= 2: epoch 1 (spooling, job startup) is not timed")
    return args


def make_model() -> Any:
    """Zero-argument factory: every rank (and the driver's probe) builds the same MLP."""
    import torch.nn as nn

    return nn.Sequential(nn.Linear(FEATURES, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, CLASSES))


def make_spark() -> Any:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").appName("sparkdl-bench-tracking")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "2")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def make_frame(spark: Any, rows: int) -> tuple[Any, list[str]]:
    from pyspark.sql import functions as F

    names = [f"f{i}" for i in range(FEATURES)]
    df = spark.range(0, rows, 1, 2).select(
        *[F.rand(seed=i).cast("float").alias(name) for i, name in enumerate(names)],
        (F.col("id") % CLASSES).cast("int").alias("label"))
    df = df.cache()
    df.count()
    return df, names


def step_time(history: list[dict[str, Any]]) -> tuple[float, int, float]:
    """(seconds per step, steps, samples/s) over epochs 2+ (index >= 1) of one fit."""
    later = [h for h in history if int(h["epoch"]) >= 1]
    seconds = sum(float(h["seconds"]) for h in later)
    steps = sum(int(h["steps"]) for h in later)
    rate = statistics.median(float(h["samples_per_sec"]) for h in later)
    return seconds / steps, steps, rate


# (name, tracking, progress); --breakdown adds the two single-feature modes to the rotation
MODES = {"off": (False, False), "on": (True, True)}
BREAKDOWN_MODES = {"tracking_only": (True, False), "progress_only": (False, True)}

# The driver process's CPU time when each epoch record reaches the driver's monitor: the CPU the
# driver spent between the first and the last record is what it spent during the timed epochs
# (MLflow writes, progress bar, channel threads). A pure observation; messages are passed on unchanged.
_EPOCH_CPU: list[float] = []


def observe_epoch_records() -> None:
    from sparkdl.driver.monitor import RunMonitor

    original = RunMonitor.on_message

    def on_message(self: Any, message: dict[str, Any]) -> None:
        if message.get("kind") == "epoch":
            _EPOCH_CPU.append(time.process_time())
        original(self, message)

    RunMonitor.on_message = on_message  # type: ignore[method-assign]


def one_fit(df: Any, names: list[str], args: argparse.Namespace, mode: str, uri: str) -> dict[str, Any]:
    from sparkdl import TorchEstimator

    tracking, progress = {**MODES, **BREAKDOWN_MODES}[mode]
    estimator = TorchEstimator(model=make_model, feature_cols=names, label_col="label",
                               batch_size=args.batch_size, epochs=args.epochs, num_workers=2, lr=1e-3,
                               log_every=args.log_every, progress=progress, tracking=tracking, tracking_uri=uri,
                               experiment=EXPERIMENT)
    _EPOCH_CPU.clear()
    started = time.perf_counter()
    model = estimator.fit(df)
    wall = time.perf_counter() - started
    per_step, steps, rate = step_time(model.history)
    # None when the epoch records did not reach the driver (channel unreachable)
    driver_cpu = (_EPOCH_CPU[-1] - _EPOCH_CPU[0]) / steps if len(_EPOCH_CPU) >= 2 else None
    return {"mode": mode, "step_s": per_step, "timed_steps": steps, "samples_per_sec": rate, "wall_s": wall,
            "driver_cpu_per_step_s": driver_cpu, "mlflow_run_id": model.run_id}


def make_experiment(uri: str, artifacts: Path) -> None:
    """The experiment, with its artifacts (loss curves, models) in the temporary directory too."""
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri=uri).create_experiment(EXPERIMENT, artifact_location=artifacts.as_uri())


def metric_points(uri: str, run_ids: list[str]) -> int | None:
    """Step-metric points the ON fits logged (a check that tracking really ran)."""
    try:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        return sum(len(client.get_metric_history(r, "loss")) for r in run_ids)
    except Exception:  # noqa: BLE001 - informational only
        return None


def ms(seconds: float) -> float | None:
    return round(seconds * 1000.0, 4) if seconds == seconds else None  # NaN is not JSON


def median_of(fits: list[dict[str, Any]], key: str) -> float:
    values = [f[key] for f in fits if f[key] is not None]
    return statistics.median(values) if values else float("nan")


def main() -> None:
    args = parse_args()
    t0 = time.perf_counter()
    load_start = os.getloadavg()[0]
    spark = make_spark()
    df, names = make_frame(spark, args.rows)
    generate_s = time.perf_counter() - t0
    observe_epoch_records()
    modes = list(MODES) + (list(BREAKDOWN_MODES) if args.breakdown else [])
    with tempfile.TemporaryDirectory(prefix="sparkdl-bench-tracking-") as tmp:
        uri = f"sqlite:///{tmp}/mlflow.db"
        make_experiment(uri, Path(tmp) / "artifacts")
        # Warm-up (not reported): imports torch/mlflow in the driver and creates the MLflow schema,
        # so the first timed ON fit does not pay for the store's migrations.
        one_fit(df, names, args, "on", uri)
        fits: list[dict[str, Any]] = []
        for _ in range(args.repeats):
            for mode in modes:
                fits.append(one_fit(df, names, args, mode, uri))
                print(f"[tracking_overhead] {mode:<13} step {fits[-1]['step_s'] * 1e3:.3f} ms, "
                      f"fit {fits[-1]['wall_s']:.1f} s, load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
        points = metric_points(uri, [f["mlflow_run_id"] for f in fits if f["mode"] == "on" and f["mlflow_run_id"]])
    spark.stop()

    by_mode = {m: [f for f in fits if f["mode"] == m] for m in modes}
    off, on_ = by_mode["off"], by_mode["on"]
    off_step, on_step = median_of(off, "step_s"), median_of(on_, "step_s")
    ratio = on_step / off_step
    paired = statistics.median(b["step_s"] / a["step_s"] for a, b in zip(off, on_))
    overhead = (ratio - 1.0) * 100.0
    result: dict[str, Any] = {
        "benchmark": "tracking_overhead",
        "rows": args.rows, "features": FEATURES, "classes": CLASSES, "model": "mlp 64-256-256-10",
        "batch_size": args.batch_size, "num_workers": 2, "master": "local[2]", "epochs": args.epochs,
        "log_every": args.log_every, "repeats": args.repeats, "cpus": os.cpu_count(),
        "timed_steps_per_fit": off[0]["timed_steps"],
        "off_step_ms_median": ms(off_step),
        "on_step_ms_median": ms(on_step),
        "ratio_on_off": round(ratio, 4),
        "ratio_on_off_paired_median": round(paired, 4),
        "overhead_pct": round(overhead, 2),
        "target_overhead_pct": TARGET_OVERHEAD_PCT,
        "meets_target": overhead <= TARGET_OVERHEAD_PCT,
        "off_step_ms": [ms(f["step_s"]) for f in off],
        "on_step_ms": [ms(f["step_s"]) for f in on_],
        "off_samples_per_sec_median": round(median_of(off, "samples_per_sec"), 1),
        "on_samples_per_sec_median": round(median_of(on_, "samples_per_sec"), 1),
        "off_fit_wall_s_median": round(median_of(off, "wall_s"), 2),
        "on_fit_wall_s_median": round(median_of(on_, "wall_s"), 2),
        # CPU the driver process spent per timed step (both cores are shared with the 2 workers here)
        "off_driver_cpu_ms_per_step_median": ms(median_of(off, "driver_cpu_per_step_s")),
        "on_driver_cpu_ms_per_step_median": ms(median_of(on_, "driver_cpu_per_step_s")),
        "on_loss_points_logged": points,
    }
    for mode in modes[2:]:
        result[f"{mode}_step_ms_median"] = ms(median_of(by_mode[mode], "step_s"))
        result[f"{mode}_ratio_to_off"] = round(median_of(by_mode[mode], "step_s") / off_step, 4)
        result[f"{mode}_step_ms"] = [ms(f["step_s"]) for f in by_mode[mode]]
        result[f"{mode}_driver_cpu_ms_per_step_median"] = ms(median_of(by_mode[mode], "driver_cpu_per_step_s"))
    result.update({
        # Other processes on the machine stretch step times; the alternation shares that noise out
        # between the settings, but a high load average means wide spreads.
        "loadavg_1m_start": round(load_start, 2), "loadavg_1m_end": round(os.getloadavg()[0], 2),
        "generate_and_cache_s": round(generate_s, 2),
        "wall_s": round(time.perf_counter() - t0, 1),
    })
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
