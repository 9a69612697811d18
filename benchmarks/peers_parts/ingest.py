"""Ingest part of the peers benchmark: rows/s from one Spark DataFrame (cached, or --source parquet: a
Parquet scan) into torch batches on
2 ranks, for sparkdl (epoch 1 = spool + first pass; epochs 2+ = replay from the spool),
TorchDistributor's DataFrame path (private `_train_on_dataframe` + `_get_spark_partition_data_loader`,
shipped with PySpark) and Petastorm's `make_spark_converter` (Parquet cache + reader).

Run alone: .venv-bench/bin/python benchmarks/peers_parts/ingest.py --rows 100000 --repeats 1
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

_BENCHMARKS = str(Path(__file__).resolve().parents[1])
if _BENCHMARKS not in sys.path:  # run as a script, `peers_parts` is not on the path yet
    sys.path.insert(0, _BENCHMARKS)
# Local-mode Python workers inherit the JVM's environment, i.e. the driver's when the session starts;
# with this they can import peers_parts should anything be pickled by reference.
if _BENCHMARKS not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_BENCHMARKS, os.environ.get("PYTHONPATH")) if p)

from peers_parts import common
from peers_parts import petastorm_reader
from peers_parts.petastorm_reader import Reported as _Reported
from peers_parts.petastorm_reader import error_text as _error_text
from peers_parts.petastorm_reader import rate as _rate

# TorchDistributor's loader converts every row in Python; past this many seconds a pass stops early.
# Its cost is per row and constant, so the rate of a cut pass is the rate of a full one.
TD_PASS_BUDGET_S = 150.0
SPARKDL_PASSES = 3  # epoch 0 (right after the spool), then epochs 1 and 2 replayed
WARM_UP_ROWS = 10_000
FIGURES = ("spark_arrow_delivery", "sparkdl_epoch1", "sparkdl_epochs2plus", "sparkdl_end_to_end_epoch1", "torchdistributor_loader",
           "torchdistributor_end_to_end", "petastorm_epoch1", "petastorm_epochs2plus",  # rows/s, in report order
           "sparkdl_run_noop_s", "torchdistributor_run_noop_s")  # seconds of a no-op job on warm workers
PHASES = ("memory_reset", "delivery", "conversion", "spool_write", "space_check", "handover_wait", "rendezvous",
          "communicator", "agreement")  # ctx.task_phases of sparkdl's ranks, slowest rank, seconds

NOTES = [
    (f"'on {common.WORLD} ranks' = rows summed over the ranks / the slowest rank's seconds; figures are "
     "medians over rounds, ratios are medians of per-round ratios (every tool runs once per round)."),
    ("Every tool hands out float32 (batch, features) tensors plus labels, and every batch is summed so "
     "that nothing is skipped lazily; each rank uses 1 torch thread."),
    ("sparkdl_epoch1: per rank, from the task's start to the end of the first shuffled pass over "
     "ctx.batches(0), which streams while the partition arrives (the spool for later epochs is written "
     "alongside); includes the rendezvous, excludes job launch and the driver's prepare()."),
    ("sparkdl_phase_*: ctx.task_phases of the slowest rank (seconds): delivery = waiting for Spark's next "
     "Arrow batch, conversion = Arrow to numpy views, spool_write = copying into the spool file, "
     "handover_wait = the reader waiting for the loop; these run on the reader thread beside the pass."),
    ("sparkdl_run_noop_s / torchdistributor_run_noop_s: sparkdl.run(lambda ctx: None) and "
     "TorchDistributor.run(noop) on 2 ranks, each on warm Python workers (right after an untimed job)."),
    "sparkdl_epochs2plus: median of the shuffled passes over epochs 1 and 2, replayed from the spool.",
    ("sparkdl_end_to_end_epoch1: sparkdl.run's wall time minus the slowest rank's epochs 1-2 passes, so "
     "approximately launch + prepare + spool + epoch 1 + teardown."),
    ("torchdistributor_loader: one pass of _get_spark_partition_data_loader(num_workers=0) in each "
     "torchrun rank, its per-column tensors stacked into float32 (B, features); in file order (no shuffle); "
     "excludes the Spark job, the dump of the partition to an Arrow file and torchrun's start. It reopens "
     "the file and converts every row via pandas each epoch, so the figure holds for every epoch."),
    ("torchdistributor_end_to_end: _train_on_dataframe's wall time (barrier job, log server, Arrow dump, "
     "torchrun launch, the loader pass, result return)."),
    ("spark_arrow_delivery: a Spark job that only hands the same features array column to Python and counts "
     "the rows (job launch included): what Spark's JVM costs to produce the Arrow batches, the ceiling for "
     "any epoch 1 read from Spark on this host."),
    ("TorchDistributor's barrier tasks leave Spark's Python workers unusable for reuse (new worker pids "
     "after its job): each sparkdl round starts with an untimed no-op sparkdl job so that its spool timer "
     "does not include Python worker start and imports."),
    (f"Before the recorded rounds every tool runs once, unrecorded, on a {WARM_UP_ROWS:,}-row frame: Python "
     "worker start and imports are paid once per application, not per row ingested."),
]


def _sparkdl_rank(ctx: Any) -> list[dict[str, Any]]:
    """Runs on every rank; rank 0's return value (everyone's timings) comes back from sparkdl.run."""
    import time

    passes, epoch1_s = [], 0.0
    for epoch in range(SPARKDL_PASSES):
        started, total = time.perf_counter(), 0.0
        for features, _labels in ctx.batches(epoch):
            total += float(features.sum())
        passes.append(time.perf_counter() - started)
        if epoch == 0:
            epoch1_s = time.perf_counter() - ctx.task_started
    mine = {"rows": ctx.num_rows, "epoch1_s": epoch1_s, "spool_s": float(ctx.spool_seconds), "pass_s": passes,
            "phases": ctx.task_phases}
    return list(ctx.comm.allgather_object(mine))


def _count_rows(batches: Any) -> Any:
    import pyarrow as pa

    rows = sum(batch.num_rows for batch in batches)
    yield pa.RecordBatch.from_pydict({"rows": [rows]})


def _delivery_round(frame: Any, args: argparse.Namespace) -> dict[str, float]:
    """The ceiling for any epoch 1 that starts from Spark: the same features array column (sparkdl's
    own expression) delivered to Python by a mapInArrow job that only counts the rows it receives."""
    from sparkdl.data.feed import features_expression

    names = common.feature_names(args.features)
    job = frame.select(features_expression(frame, names).alias("features"), "label")
    seconds, rows = common.timed(lambda: sum(r.rows for r in job.mapInArrow(_count_rows, "rows long").collect()))
    return {"spark_arrow_delivery": rows / seconds}


def _noop(ctx: Any) -> None:
    return None


def _sparkdl_round(frame: Any, args: argparse.Namespace) -> dict[str, float]:
    import sparkdl

    # TorchDistributor's tasks do not hand their Python workers back to Spark's pool: after its round
    # sparkdl's tasks would start in fresh workers and pay interpreter start and imports inside the
    # spool's timer. An untimed no-op job restores what any session that ran a job has.
    sparkdl.run(_noop, num_workers=common.WORLD, progress=False)
    noop_s, _ = common.timed(lambda: sparkdl.run(_noop, num_workers=common.WORLD, progress=False))
    wall, ranks = common.timed(lambda: sparkdl.run(
        _sparkdl_rank, df=frame, num_workers=common.WORLD, feature_cols=common.feature_names(args.features),
        label_col="label", batch_size=args.batch_size, progress=False, shuffle=True, threads_per_worker=1))
    common.log("ingest: sparkdl per rank: " + "; ".join(
        f"rows={r['rows']} epoch1={r['epoch1_s']:.2f}s (partition in after {r['spool_s']:.2f}s) passes="
        + "/".join(f"{s:.3f}" for s in r["pass_s"]) + " phases=" + ", ".join(
            f"{k}={r['phases'].get(k, 0.0):.3f}" for k in PHASES) for r in ranks) + f"; run wall={wall:.1f}s; "
        f"no-op run {noop_s:.2f}s")
    rows = [r["rows"] for r in ranks]
    later = [common.median(r["pass_s"][1:]) for r in ranks]
    replay = max(sum(r["pass_s"][1:]) for r in ranks)
    slowest = max(ranks, key=lambda r: r["epoch1_s"])
    return {"sparkdl_epoch1": _rate(rows, [r["epoch1_s"] for r in ranks]),
            "sparkdl_epochs2plus": _rate(rows, later),
            "sparkdl_end_to_end_epoch1": sum(rows) / (wall - replay), "sparkdl_run_noop_s": noop_s,
            **{f"sparkdl_phase_{k}_s": float(slowest["phases"].get(k, 0.0)) for k in PHASES}}


def _td_rank(batch_size: int, budget_s: float) -> list[dict[str, Any]]:
    """Runs in each torchrun child; returns every rank's timing (gathered over gloo)."""
    import os
    import time

    import pyarrow as pa
    import torch
    import torch.distributed as dist
    from pyspark.ml.torch import distributor

    torch.set_num_threads(1)
    # The task dumped exactly its partition to this Arrow stream: count it rather than trust a split.
    with pa.OSFile(os.environ[distributor.SPARK_PARTITION_ARROW_DATA_FILE]) as source:
        rows = sum(batch.num_rows for batch in pa.ipc.open_stream(source))
    loader = distributor._get_spark_partition_data_loader(num_samples=rows, batch_size=batch_size, num_workers=0)
    dist.init_process_group("gloo")
    dist.barrier()  # both ranks read at the same time, as they would while training
    seen, total, capped = 0, 0.0, False
    started = time.perf_counter()
    for batch in loader:  # a list of 65 per-column tensors (the row's fields, collated)
        features = torch.stack(batch[:-1], dim=1).float()
        total += float(features.sum())
        seen += int(features.shape[0])
        if time.perf_counter() - started > budget_s:
            capped = seen < rows
            break
    seconds = time.perf_counter() - started
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"rows": seen, "partition_rows": rows, "seconds": seconds, "capped": capped})
    dist.destroy_process_group()
    return gathered


def _td_noop() -> None:
    return None


def _td_round(frame: Any, args: argparse.Namespace) -> dict[str, float]:
    from pyspark.ml.torch.distributor import TorchDistributor

    distributor = TorchDistributor(num_processes=common.WORLD, local_mode=False, use_gpu=False)
    distributor.run(_td_noop)  # as sparkdl's no-op: on workers a job just used
    noop_s, _ = common.timed(lambda: distributor.run(_td_noop))
    wall, ranks = common.timed(lambda: distributor._train_on_dataframe(
        _td_rank, frame, args.batch_size, TD_PASS_BUDGET_S))
    rows, seconds = [r["rows"] for r in ranks], [r["seconds"] for r in ranks]
    common.log("ingest: TorchDistributor per rank: " + "; ".join(
        f"rows={r['rows']}/{r['partition_rows']} pass={r['seconds']:.2f}s" for r in ranks) + f"; wall={wall:.1f}s")
    loader_rate = _rate(rows, seconds)
    capped = any(r["capped"] for r in ranks)
    # A cut pass: what is not the loader (launch, dump) stays, the full pass is extrapolated at its rate.
    full = sum(r["partition_rows"] for r in ranks)
    end_to_end = full / (wall - max(seconds) + full / loader_rate) if capped else full / wall
    return {"torchdistributor_loader": loader_rate, "torchdistributor_end_to_end": end_to_end,
            "torchdistributor_run_noop_s": noop_s,
            "torchdistributor_capped": float(capped)}  # not in FIGURES: a flag for the notes


def measure(spark: Any, args: argparse.Namespace) -> dict[str, Any]:
    # Train fns defined here ship by value, as __main__'s do: executors and torchrun children then
    # need not import peers_parts.
    if __name__ != "__main__":
        from pyspark import cloudpickle

        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    notes, errors, rounds = list(NOTES), dict[str, str](), list[dict[str, float]]()
    install, petastorm_error = petastorm_reader.install_line(), petastorm_reader.import_error()
    notes += [install] if install else []
    if petastorm_error and "No module named 'petastorm'" in petastorm_error and install:
        petastorm_error += f"; {install}"  # the import failed because the install did
    # Delivery right after sparkdl: on the Python workers sparkdl's round warmed (see _sparkdl_round).
    tools: dict[str, Any] = {"sparkdl": lambda f: _sparkdl_round(f, args),
                             "spark_delivery": lambda f: _delivery_round(f, args),
                             "torchdistributor": lambda f: _td_round(f, args)}
    legacy = petastorm_reader.legacy_versions() if petastorm_error else None
    if petastorm_error is None:
        tools["petastorm"] = lambda f: petastorm_reader.petastorm_round(spark, f, args)
    elif legacy:
        # It cannot import here (the error is still recorded); the same round runs in .venv-petastorm.
        tools["petastorm"] = lambda f: petastorm_reader.legacy_round(args)
        notes.append(f"Petastorm cannot import in this environment (see errors); its figures come from "
                     f".venv-petastorm ({legacy}), a second interpreter with its own local[2] Spark session over a "
                     "DataFrame of the same rows and columns made by the same code, one call per round.")
    # Python worker start and imports happen once per application, not per row: a small unrecorded round
    # pays them for every tool, so the first recorded round is not skewed against whichever runs first.
    warm = common.make_frame(spark, WARM_UP_ROWS, args.features)
    source = getattr(args, "source", "cached")
    if source == "parquet":
        warm = common.as_parquet(spark, warm, Path(args.work_dir) / "ingest-warm")
    for tool, run_round in tools.items():
        if tool == "petastorm" and legacy:
            continue  # a fresh interpreter per round: nothing to warm in this one
        common.log(f"ingest warm-up: {tool} ({WARM_UP_ROWS} rows, unrecorded)")
        try:
            run_round(warm)
        except Exception as exc:  # noqa: BLE001 - the recorded rounds report it
            common.log(f"ingest: {tool} warm-up failed: {str(exc)[:300]}")
    warm.unpersist()
    frame = common.make_frame(spark, args.rows, args.features)
    if source == "parquet":
        frame = common.as_parquet(spark, frame, Path(args.work_dir) / "ingest-frame")
        notes.append("--source parquet: the DataFrame is spark.read.parquet of the rows written once (uncached), "
                     "the same files for every tool; sparkdl's ranks read their rows directly (data.delivery='auto'), "
                     "Spark's delivery and TorchDistributor read them through Spark.")
    try:
        for round_index in range(args.repeats):
            figures: dict[str, float] = {}
            for tool, run_round in tools.items():
                if tool in errors:
                    continue  # a tool that failed once is not retried every round
                common.log(f"ingest round {round_index + 1}/{args.repeats}: {tool} ({args.rows} rows)")
                try:
                    out = run_round(frame)
                except Exception as exc:  # noqa: BLE001 - recorded, the other tools still run
                    errors[tool] = str(exc) if isinstance(exc, _Reported) else _error_text(exc, tool)
                    common.log(f"ingest: {tool} failed: {errors[tool][:300]}")
                    continue
                figures.update(out)
                common.log("ingest: " + ", ".join(f"{k}={v:,.0f} rows/s" for k, v in out.items() if k in FIGURES))
            rounds.append(figures)
    finally:
        frame.unpersist()
    reported = FIGURES + tuple(f"sparkdl_phase_{k}_s" for k in PHASES)
    runs = {name: [r[name] for r in rounds if name in r] for name in reported if any(name in r for r in rounds)}
    ratios = []
    for name, a, b, target in (("sparkdl epoch 1 / TorchDistributor loader", "sparkdl_epoch1",
                                "torchdistributor_loader", 10),
                               ("sparkdl epoch 1 / Spark's Arrow delivery of the feature column", "sparkdl_epoch1",
                                "spark_arrow_delivery", 1.5),
                               ("Spark's Arrow delivery alone / TorchDistributor loader (info: epoch 1's ceiling)",
                                "spark_arrow_delivery", "torchdistributor_loader", None),
                               ("sparkdl epochs 2+ / Petastorm reader epochs 2+", "sparkdl_epochs2plus",
                                "petastorm_epochs2plus", 2)):
        pairs = [(r[a], r[b]) for r in rounds if a in r and b in r]  # only rounds where both ran
        if pairs:
            ratios.append(common.ratio_entry(name, pairs, target, "higher"))
    noops = [(r["sparkdl_run_noop_s"], r["torchdistributor_run_noop_s"]) for r in rounds
             if "sparkdl_run_noop_s" in r and "torchdistributor_run_noop_s" in r]
    if noops:
        ratios.append(common.ratio_entry("no-op job, warm workers: sparkdl.run / TorchDistributor.run", noops, 0.2,
                                         "lower"))
    if any(r.get("torchdistributor_capped") for r in rounds):
        notes.append(f"TorchDistributor's loader pass was cut after {TD_PASS_BUDGET_S:.0f} s per rank (a per-row "
                     "Python loop: constant cost per row); its end-to-end figure extrapolates the full pass at "
                     "the measured rate.")
    if "petastorm" in errors or (petastorm_error and not legacy):
        notes.append("Petastorm did not complete (the exact error is in errors): its figures and the "
                     "'epochs 2+ / Petastorm' ratio cover only the rounds it finished, if any.")
    if petastorm_error:
        # Recorded either way; with .venv-petastorm the figures still exist (see the notes).
        errors["petastorm_import"] = petastorm_error
        if "pyarrow.filesystem" in petastorm_error:
            import pyarrow

            notes.append(f"petastorm imports pyarrow.filesystem, removed in pyarrow 16 (apache/arrow#39825); this "
                         f"environment has pyarrow {pyarrow.__version__}, and PySpark 4 needs pyarrow >= 18, so "
                         "petastorm cannot run beside a current PySpark.")
    if "petastorm_epochs2plus" in runs:
        notes += [("petastorm_epoch1: make_spark_converter (the DataFrame written as a Parquet cache, then "
                   "counted) + the slowest shard's first reader pass."),
                  (f"petastorm_epochs2plus: the second pass of make_torch_dataloader(num_epochs=1, cur_shard=r, "
                   f"shard_count={common.WORLD}) in {common.WORLD} concurrent processes, over the cache; a pass "
                   "includes opening the reader (default workers_count=4 threads) as each epoch does with "
                   "num_epochs=1; row groups in reader order.")]
    return {"part": "ingest", "source": source, "figures": {name: common.median(values) for name, values in runs.items()},
            "runs": runs, "ratios": ratios, "notes": notes, "errors": errors}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="peers benchmark, ingest part alone")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--source", choices=("cached", "parquet"), default="cached",
                        help="the frame every tool reads: cached in Spark's memory, or a Parquet scan")
    parser.add_argument("--no-record", action="store_true",
                        help="compare with benchmarks/results/records/ but do not replace the record")
    cli = parser.parse_args()
    if min(cli.rows, cli.features, cli.batch_size, cli.repeats) < 1:
        parser.error("--rows, --features, --batch-size and --repeats must be >= 1")
    with tempfile.TemporaryDirectory(prefix="peers-ingest-") as scratch:
        cli.work_dir = cli.work_dir or Path(scratch)
        session = common.spark_session()
        try:
            result = measure(session, cli)
        finally:
            session.stop()
    result.update(rows=cli.rows, batch_size=cli.batch_size, loadavg_after=os.getloadavg()[0])
    import records

    records.compare_and_record(f"peers_ingest_{cli.source}_{cli.rows}", result, keep=not cli.no_record)
    print(json.dumps(result))
