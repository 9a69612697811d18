"""Ingest benchmark: how fast a worker spools Spark's Arrow batches and replays them per epoch.

Part A (always, no Spark): 2 ranks' halves of N rows x D float32 features as 10,000-row list<float>
record batches, as Spark sends them. Per rank: spool write rows/s (epoch 1), shuffled epoch rows/s
from the spool (epochs 2+), and the same epoch from an Arrow table already in memory (the
in-memory limit). The target is spool/in-memory >= 0.5.

Part B (--spark): the same shape generated in Spark (cached first), fed through
mapInArrow(barrier=True) on local[2]; each task spools its iterator (epoch 1) and replays it
(epochs 2+). A job that only consumes Spark's batches shows what delivery alone costs.

Part C (--peers): the user's view of the same cached DataFrame (64 float columns + an int label,
in 2 partitions), side by side with PySpark's TorchDistributor in one run: epoch 1 of a
`sparkdl.run` loop over ctx.batches(0) (streamed, with ctx.task_phases of the slowest rank), its
epochs 2+, TorchDistributor's loader, Spark's own Arrow delivery, and the no-op `sparkdl.run` /
`TorchDistributor.run` on warm workers. It is benchmarks/peers_parts/ingest.py (the ingest part of
benchmarks/peers.py) run from here; --repeats rounds.

Prints one JSON object. Figures are medians over --repeats (part B: --spark-rounds jobs, each
replaying --repeats epochs); nothing here asserts a timing. Every JSON object is set against the
figures recorded by the last run (benchmarks/results/records/ingest*.json: the ratio now / then of
each figure goes to stderr, drops beyond 1.25x marked WORSE), then recorded (--no-record: not).

Tensor columns (input_cols layouts), no Spark, one rank, torch at 1 intra-op thread; each prints its
own JSON object with the machine's load (os.getloadavg) before and after:

--case tokens: --rows x --seq-len int32 tokens (list<int32> input column, spooled as int32 and handed
out as int64) plus a per-position int32 -> int64 label column of the same shape, as a language model
gets them. Spool write rows/s, epochs 2+ from the spool (shuffled and in order, through the default
TensorAssembler), and the same epochs from one in-memory Arrow table of the same rows (the limit).

--case images: --image-rows 8x8 grayscale digit PNGs (a binary column) with an int64 label, decoded
by transform_fn=sparkdl.datasets.decode_digit_png. Images/s of (a) decoding alone, (b) shuffled spool
batches through TensorAssembler(layout, decode_digit_png) feeding a training step in turn, and (c)
the same batches through prefetched(batches, 2), so that decoding overlaps the step. The step is a
small CNN's forward + backward + SGD (--image-step cnn) or a fixed sleep (--image-step sleep).

--case all: the default object (with part B under --spark), then tokens, then images.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sparkdl.data.batches import Spool, last_batch_size, steps_per_epoch, table_batches  # noqa: E402
from sparkdl.data.layout import (BINARY, FEATURES_COLUMN, FIXED, INPUT_PREFIX, LABEL_COLUMN, FeedLayout,  # noqa: E402
                                 TensorColumn)

SPARK_BATCH_ROWS = 10_000  # spark.sql.execution.arrow.maxRecordsPerBatch default


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows in all (features: split over 2 ranks; tokens: one rank)")
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-mb", type=int, default=64, help="spool chunk size")
    parser.add_argument("--spark", action="store_true", help="also run part B through Spark")
    parser.add_argument("--spark-rounds", type=int, default=2, help="part B: spool/deliver job pairs")
    parser.add_argument("--peers", action="store_true",
                        help="also run part C: sparkdl.run on the cached DataFrame beside TorchDistributor")
    parser.add_argument("--no-record", action="store_true",
                        help="compare with benchmarks/results/records/ but do not replace the record")
    parser.add_argument("--case", choices=("features", "tokens", "images", "all"), default="features",
                        help="features: parts A (and B), the default; tokens / images: tensor columns")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens: tokens per row (--rows rows)")
    parser.add_argument("--image-rows", type=int, default=50_000, help="images: PNG rows")
    parser.add_argument("--image-step", choices=("cnn", "sleep"), default="cnn",
                        help="images: the simulated training step (a small CNN, or a fixed sleep)")
    parser.add_argument("--step-ms", type=float, default=2.0, help="images: the sleep per step, --image-step sleep")
    args = parser.parse_args()
    if min(args.repeats, args.spark_rounds, args.rows, args.features, args.batch_size, args.seq_len,
           args.image_rows) < 1:
        parser.error("--rows, --features, --batch-size, --repeats, --spark-rounds, --seq-len and "
                     "--image-rows must be >= 1")
    if args.step_ms < 0:
        parser.error("--step-ms must be >= 0")
    return args


def median_rate(rows: int, seconds: list[float]) -> float:
    return round(rows / statistics.median(seconds), 1)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def drain(batches: Iterator[tuple[Any, Any]]) -> float:
    """Consume an epoch, touching every batch so lazily produced data is really read."""
    total = 0.0
    for features, _ in batches:
        total += float(features[-1, -1])
    return total


def epoch_options(counts: list[int], batch_size: int, rank: int) -> dict[str, Any]:
    return dict(batch_size=batch_size, steps=steps_per_epoch(counts, batch_size, drop_last=False),
                last_batch_size=last_batch_size(counts, batch_size, drop_last=False), seed=0,
                rank=rank, drop_last=False)


# ------------------------------------------------------------------------------------ part A


def spark_like_batches(rows: int, width: int, seed: int) -> list[pa.RecordBatch]:
    rng = np.random.default_rng(seed)
    batches = []
    for start in range(0, rows, SPARK_BATCH_ROWS):
        n = min(SPARK_BATCH_ROWS, rows - start)
        values = pa.array(rng.random(n * width, dtype=np.float32))
        offsets = pa.array(np.arange(0, (n + 1) * width, width, dtype=np.int32))
        batches.append(pa.record_batch({FEATURES_COLUMN: pa.ListArray.from_arrays(offsets, values)}))
    return batches


def in_memory_table(batches: list[pa.RecordBatch], width: int) -> pa.Table:
    values = pa.concat_arrays([b.column(0).flatten() for b in batches])
    features = pa.FixedSizeListArray.from_arrays(values, width)
    return pa.table({FEATURES_COLUMN: features})


def bench_rank(rank: int, counts: list[int], batches: list[pa.RecordBatch], layout: FeedLayout,
               args: argparse.Namespace, directory: str) -> dict[str, Any]:
    rows = counts[rank]
    options = epoch_options(counts, args.batch_size, rank)
    table = in_memory_table(batches, layout.num_features)
    write_s: list[float] = []
    for repeat in range(args.repeats):  # epoch 1: consume the input into a fresh spool
        seconds, spool = timed(lambda: Spool.write(iter(batches), layout, directory,
                                                   chunk_bytes=args.chunk_mb << 20))
        write_s.append(seconds)
        if repeat < args.repeats - 1:
            spool.close()
    shuffled_s, in_order_s, memory_s = [], [], []
    # Epochs 2+ replay the last spool, as training does, alternating with the in-memory runs so
    # that both see the same machine.
    with spool:
        chunks = spool.chunk_count
        for epoch in range(2, 2 + args.repeats):
            shuffled_s.append(timed(lambda: drain(spool.batches(epoch, shuffle=True, **options)))[0])
            memory_s.append(timed(lambda: drain(table_batches(table, layout, epoch, shuffle=True,
                                                              **options)))[0])
            in_order_s.append(timed(lambda: drain(spool.batches(epoch, shuffle=False, **options)))[0])
    epoch_rows = (options["steps"] - 1) * args.batch_size + options["last_batch_size"]
    spool_rate, memory_rate = median_rate(epoch_rows, shuffled_s), median_rate(epoch_rows, memory_s)
    return {
        "rank": rank,
        "rows": rows,
        "steps_per_epoch": options["steps"],
        "spool_chunks": chunks,
        "spool_write_rows_per_s": median_rate(rows, write_s),
        "spool_epoch_shuffled_rows_per_s": spool_rate,
        "spool_epoch_in_order_rows_per_s": median_rate(epoch_rows, in_order_s),
        "in_memory_epoch_shuffled_rows_per_s": memory_rate,
        "ratio_spool_to_in_memory": round(spool_rate / memory_rate, 3),
    }


def part_a(args: argparse.Namespace) -> dict[str, Any]:
    layout = FeedLayout(num_features=args.features, label_dtype=None)
    counts = [args.rows // 2, args.rows - args.rows // 2]
    ranks = []
    with tempfile.TemporaryDirectory(prefix="sparkdl-ingest-") as directory:
        for rank, rows in enumerate(counts):
            batches = spark_like_batches(rows, args.features, seed=rank)
            ranks.append(bench_rank(rank, counts, batches, layout, args, directory))
    worst = min(r["ratio_spool_to_in_memory"] for r in ranks)
    return {"ranks": ranks, "min_ratio_spool_to_in_memory": worst, "target_ratio": 0.5,
            "meets_target": worst >= 0.5}


# ------------------------------------------------------------------------------------ part B


def part_b(args: argparse.Namespace) -> dict[str, Any]:
    # Executors must run this Python and import this checkout.
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    spark = (SparkSession.builder.master("local[2]").appName("sparkdl-ingest-bench")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.memory", "4g").getOrCreate())
    layout = FeedLayout(num_features=args.features, label_dtype=None)
    runs: dict[int, dict[str, list[float]]] = {}
    try:
        columns = [F.rand(seed=i).cast("float").alias(f"f{i}") for i in range(args.features)]
        df = (spark.range(args.rows).select(*columns)
              .select(F.array(*[f"f{i}" for i in range(args.features)]).alias(FEATURES_COLUMN))
              .repartition(2).cache())
        generate_s, _ = timed(df.count)  # materialise once: epoch 1 then times Arrow delivery only
        deliver = df.mapInArrow(_deliver_task, _DELIVER_SCHEMA, barrier=True)
        spool = df.mapInArrow(_spooling_task(layout, args.batch_size, args.repeats), _SPOOL_SCHEMA,
                              barrier=True)
        deliver.collect()  # warms the JVM's Arrow path and the Python workers
        for _ in range(args.spark_rounds):  # alternated, so both jobs see the same machine
            for row in [*spool.collect(), *deliver.collect()]:
                for key, value in row.asDict().items():
                    runs.setdefault(row.rank, {}).setdefault(key, []).append(value)
    finally:
        spark.stop()
    ranks = [{"rank": rank, "rows": int(r["rows"][0]), "steps_per_epoch": int(r["steps_per_epoch"][0]),
              "epoch1_spool_rows_per_s": median_rate(int(r["rows"][0]), r["epoch1_s"]),
              "deliver_only_rows_per_s": median_rate(int(r["rows"][0]), r["deliver_s"]),
              "epochN_shuffled_rows_per_s": round(statistics.median(r["epochN_rows_per_s"]), 1)}
             for rank, r in sorted(runs.items())]
    return {"master": "local[2]", "rounds": args.spark_rounds,
            "generate_and_cache_s": round(generate_s, 2), "ranks": ranks}


_SPOOL_SCHEMA = "rank int, rows long, steps_per_epoch int, epoch1_s double, epochN_rows_per_s double"
_DELIVER_SCHEMA = "rank int, deliver_s double"


def _spooling_task(layout: FeedLayout, batch_size: int, epochs: int
                   ) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import BarrierTaskContext

        context = BarrierTaskContext.get()
        rank = context.partitionId()
        with tempfile.TemporaryDirectory(prefix="sparkdl-spool-") as directory:
            epoch1_s, spool = timed(lambda: Spool.write(batches, layout, directory))
            with spool:
                # Every rank needs every rank's row count to agree on the step count.
                counts = [int(c) for c in context.allGather(str(spool.num_rows))]
                options = epoch_options(counts, batch_size, rank)
                seconds = [timed(lambda e=e: drain(spool.batches(e, shuffle=True, **options)))[0]
                           for e in range(2, 2 + epochs)]
                epoch_rows = (options["steps"] - 1) * batch_size + options["last_batch_size"]
                result = {"rank": [rank], "rows": [spool.num_rows], "steps_per_epoch": [options["steps"]],
                          "epoch1_s": [epoch1_s], "epochN_rows_per_s": [median_rate(epoch_rows, seconds)]}
        yield pa.RecordBatch.from_pydict(result, schema=_arrow_schema(_SPOOL_SCHEMA))

    return task


def _deliver_task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Reference: consume Spark's batches without spooling, to show what the spool adds."""
    from pyspark import BarrierTaskContext

    start = time.perf_counter()
    for _ in batches:
        pass
    seconds = time.perf_counter() - start
    yield pa.RecordBatch.from_pydict({"rank": [BarrierTaskContext.get().partitionId()],
                                      "deliver_s": [seconds]}, schema=_arrow_schema(_DELIVER_SCHEMA))


def _arrow_schema(ddl: str) -> pa.Schema:
    types = {"int": pa.int32(), "long": pa.int64(), "double": pa.float64()}
    return pa.schema([(name, types[kind]) for name, kind in (f.split() for f in ddl.split(", "))])


# ------------------------------------------------------------------------ tensor columns


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def median_s(seconds: list[float]) -> float:
    return round(statistics.median(seconds), 4)


def drain_tensors(batches: Iterator[tuple[Any, Any, Any]]) -> int:
    """Consume an input_cols epoch, touching every batch's inputs and label."""
    total = 0
    for inputs, label, _ in batches:
        total += int(inputs[0].reshape(-1)[-1]) + int(label.reshape(-1)[-1])
    return total


def list_column(values: np.ndarray) -> pa.ListArray:
    """(n, width) numpy -> list<...> as Spark sends an array column (zero-copy values)."""
    rows, width = values.shape
    offsets = pa.array(np.arange(0, (rows + 1) * width, width, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(values.reshape(-1)))


def tokens_layout(seq_len: int) -> FeedLayout:
    tokens = TensorColumn("tokens", f"{INPUT_PREFIX}0", FIXED, "int32", "int64", (seq_len,))
    label = TensorColumn("labels", LABEL_COLUMN, FIXED, "int32", "int64", (seq_len,))
    return FeedLayout(num_features=0, label_dtype="int64", inputs=(tokens,), label=label)


def token_arrays(rows: int, seq_len: int, vocab: int = 32_000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random int32 tokens and their next-token labels (-100 at the last position)."""
    tokens = np.random.default_rng(seed).integers(0, vocab, size=(rows, seq_len), dtype=np.int32)
    labels = np.empty_like(tokens)
    labels[:, :-1] = tokens[:, 1:]
    labels[:, -1] = -100
    return tokens, labels


def tokens_case(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    load_start, started = loadavg(), time.perf_counter()
    layout = tokens_layout(args.seq_len)
    rows = args.rows
    tokens, labels = token_arrays(rows, args.seq_len)
    # Spark's 10,000-row list<int32> batches and one in-memory fixed_size_list table: views of the same
    # numpy arrays, so the rows exist once in memory.
    batches = [pa.record_batch({layout.inputs[0].column: list_column(tokens[a:a + SPARK_BATCH_ROWS]),
                                LABEL_COLUMN: list_column(labels[a:a + SPARK_BATCH_ROWS])})
               for a in range(0, rows, SPARK_BATCH_ROWS)]
    table = pa.table({layout.inputs[0].column: pa.FixedSizeListArray.from_arrays(pa.array(tokens.reshape(-1)),
                                                                                 args.seq_len),
                      LABEL_COLUMN: pa.FixedSizeListArray.from_arrays(pa.array(labels.reshape(-1)), args.seq_len)})
    options = epoch_options([rows], args.batch_size, 0)
    epoch_rows = (options["steps"] - 1) * args.batch_size + options["last_batch_size"]
    write_s: list[float] = []
    runs: dict[str, list[float]] = {k: [] for k in ("spool_shuffled", "memory_shuffled", "spool_in_order",
                                                    "memory_in_order")}
    with tempfile.TemporaryDirectory(prefix="sparkdl-ingest-tokens-") as directory:
        for repeat in range(args.repeats):
            seconds, spool = timed(lambda: Spool.write(iter(batches), layout, directory,
                                                       chunk_bytes=args.chunk_mb << 20))
            write_s.append(seconds)
            if repeat < args.repeats - 1:
                spool.close()
        with spool:
            chunks = spool.chunk_count
            for epoch in range(2, 2 + args.repeats):  # alternated: every figure sees the same machine
                for shuffle, kind in ((True, "shuffled"), (False, "in_order")):
                    runs[f"spool_{kind}"].append(timed(lambda: drain_tensors(
                        spool.batches(epoch, shuffle=shuffle, **options)))[0])
                    runs[f"memory_{kind}"].append(timed(lambda: drain_tensors(
                        table_batches(table, layout, epoch, shuffle=shuffle, **options)))[0])
    rates = {k: median_rate(epoch_rows, v) for k, v in runs.items()}
    ratio_shuffled = round(rates["spool_shuffled"] / rates["memory_shuffled"], 3)
    ratio_in_order = round(rates["spool_in_order"] / rates["memory_in_order"], 3)
    return {
        "benchmark": "ingest", "case": "tokens", "rows": rows, "seq_len": args.seq_len,
        "input": "list<int32> -> spool int32 -> torch int64", "label": "list<int32> (per position) -> int64",
        "batch_size": args.batch_size, "repeats": args.repeats, "chunk_mb": args.chunk_mb,
        "input_batch_rows": SPARK_BATCH_ROWS, "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "steps_per_epoch": options["steps"], "spool_chunks": chunks,
        "spool_mib": round(rows * args.seq_len * 4 * 2 / (1 << 20), 1),
        "spool_write_rows_per_s": median_rate(rows, write_s),
        "spool_epoch_shuffled_rows_per_s": rates["spool_shuffled"],
        "spool_epoch_in_order_rows_per_s": rates["spool_in_order"],
        "in_memory_epoch_shuffled_rows_per_s": rates["memory_shuffled"],
        "in_memory_epoch_in_order_rows_per_s": rates["memory_in_order"],
        "ratio_spool_to_in_memory_shuffled": ratio_shuffled,
        "ratio_spool_to_in_memory_in_order": ratio_in_order,
        "target_ratio": 0.5, "meets_target": min(ratio_shuffled, ratio_in_order) >= 0.5,
        "seconds": {"spool_write": [round(x, 3) for x in write_s],
                    **{k: [round(x, 3) for x in v] for k, v in runs.items()}},
        "loadavg_start": load_start, "loadavg_end": loadavg(),
        "wall_s": round(time.perf_counter() - started, 1),
    }


def images_layout() -> FeedLayout:
    # As tensor_feed prepares a binary input_cols column under transform_fn: storage "", and a dtype
    # that only applies when input_dtypes names the column (it does not here).
    png = TensorColumn("png", f"{INPUT_PREFIX}0", BINARY, "", "float32", ())
    label = TensorColumn("label", LABEL_COLUMN, FIXED, "int64", "int64", ())
    return FeedLayout(num_features=0, label_dtype="int64", inputs=(png,), label=label, transformed=True)


def digit_png_rows(rows: int) -> tuple[list[bytes], np.ndarray]:
    """The 1,797 digits as 8x8 grayscale PNGs (datasets.digit_pngs), repeated to `rows`."""
    from sparkdl.datasets import load_digits
    from sparkdl.datasets.images_text import digit_pngs

    counts, labels = load_digits()
    pngs = digit_pngs(counts)
    index = np.arange(rows) % len(pngs)
    return [pngs[i] for i in index], labels[index].astype(np.int64)


def training_step(kind: str, step_ms: float) -> Callable[[Any, Any], None]:
    import torch
    from torch import nn

    if kind == "sleep":
        def sleep_step(inputs: Any, label: Any) -> None:
            time.sleep(step_ms / 1000.0)
        return sleep_step
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()

    def cnn_step(inputs: Any, label: Any) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(inputs), label).backward()
        optimizer.step()
    return cnn_step


def images_case(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from sparkdl.data.assemble import TensorAssembler, prefetched
    from sparkdl.datasets import decode_digit_png

    torch.set_num_threads(1)
    load_start, started = loadavg(), time.perf_counter()
    layout = images_layout()
    rows = args.image_rows
    pngs, labels = digit_png_rows(rows)
    batches = [pa.record_batch({layout.inputs[0].column: pa.array(pngs[a:a + SPARK_BATCH_ROWS], pa.binary()),
                                LABEL_COLUMN: pa.array(labels[a:a + SPARK_BATCH_ROWS])})
               for a in range(0, rows, SPARK_BATCH_ROWS)]
    options = epoch_options([rows], args.batch_size, 0)
    epoch_rows = (options["steps"] - 1) * args.batch_size + options["last_batch_size"]
    step = training_step(args.image_step, args.step_ms)
    lists = [pngs[a:a + args.batch_size] for a in range(0, rows, args.batch_size)]

    # A fixed decoded batch: the step's own cost per epoch (no data), and a warm-up of the model.
    fixed = TensorAssembler(layout, decode_digit_png)((pa.array(pngs[:args.batch_size], pa.large_binary()),
                                                        labels[:args.batch_size]))
    for _ in range(10):
        step(fixed[0][0], fixed[1])

    def step_only() -> None:
        for _ in range(options["steps"]):
            step(fixed[0][0], fixed[1])

    def decode_only() -> None:
        for chunk in lists:
            decode_digit_png({"png": chunk})

    def train_epoch(spool: Spool, epoch: int, depth: int) -> tuple[float, float]:
        """(seconds to the first batch, seconds in transform_fn) of one training epoch."""
        assemble = TensorAssembler(layout, decode_digit_png)
        start = time.perf_counter()
        first = None
        for inputs, label, _ in prefetched(spool.batches(epoch, shuffle=True, assemble=assemble, **options), depth):
            first = time.perf_counter() - start if first is None else first
            step(inputs[0], label)
        return first or 0.0, assemble.transform_seconds

    runs: dict[str, list[float]] = {k: [] for k in ("decode_only", "step_only", "no_prefetch", "prefetch_2")}
    transform_s: dict[str, list[float]] = {"no_prefetch": [], "prefetch_2": []}
    first_s: dict[str, list[float]] = {"no_prefetch": [], "prefetch_2": []}
    with tempfile.TemporaryDirectory(prefix="sparkdl-ingest-images-") as directory:
        write_s, spool = timed(lambda: Spool.write(iter(batches), layout, directory, chunk_bytes=args.chunk_mb << 20))
        with spool:
            chunks = spool.chunk_count
            train_epoch(spool, 1, 0)  # warm-up epoch, unrecorded
            for epoch in range(2, 2 + args.repeats):  # alternated: every figure sees the same machine
                runs["decode_only"].append(timed(decode_only)[0])
                runs["step_only"].append(timed(step_only)[0])
                for depth, key in ((0, "no_prefetch"), (2, "prefetch_2")):
                    seconds, (first, decoding) = timed(lambda: train_epoch(spool, epoch, depth))
                    runs[key].append(seconds)
                    first_s[key].append(first)
                    transform_s[key].append(decoding)
    epoch_s = {k: median_s(v) for k, v in runs.items()}
    return {
        "benchmark": "ingest", "case": "images", "rows": rows, "image": "8x8 grayscale PNG",
        "png_bytes_mean": round(sum(map(len, pngs)) / rows, 1),
        "transform_fn": "sparkdl.datasets.decode_digit_png", "batch_size": args.batch_size,
        "repeats": args.repeats, "input_batch_rows": SPARK_BATCH_ROWS, "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "steps_per_epoch": options["steps"], "spool_chunks": chunks,
        "step": (f"sleep {args.step_ms} ms" if args.image_step == "sleep"
                 else "CNN conv16-conv32-pool-fc64-fc10 forward+backward+SGD"),
        "spool_write_rows_per_s": round(rows / write_s, 1),
        "decode_only_images_per_s": median_rate(rows, runs["decode_only"]),
        "no_prefetch_images_per_s": median_rate(epoch_rows, runs["no_prefetch"]),
        "prefetch_2_images_per_s": median_rate(epoch_rows, runs["prefetch_2"]),
        "epoch_s": {"decode_only": epoch_s["decode_only"], "step_only": epoch_s["step_only"],
                    "no_prefetch": epoch_s["no_prefetch"], "prefetch_2": epoch_s["prefetch_2"],
                    "ideal_overlap": max(epoch_s["decode_only"], epoch_s["step_only"])},
        "transform_s_per_epoch": {k: median_s(v) for k, v in transform_s.items()},
        "first_batch_s": {k: median_s(v) for k, v in first_s.items()},
        "speedup_prefetch_over_none": round(epoch_s["no_prefetch"] / epoch_s["prefetch_2"], 3),
        "seconds": {k: [round(x, 3) for x in v] for k, v in runs.items()},
        "loadavg_start": load_start, "loadavg_end": loadavg(),
        "wall_s": round(time.perf_counter() - started, 1),
    }


def main() -> None:
    args = parse_args()
    if args.case in ("features", "all"):
        features_case(args)
    if args.case in ("tokens", "all"):
        emit(f"ingest_tokens_{args.rows}_{args.seq_len}", tokens_case(args), args)
    if args.case in ("images", "all"):
        emit(f"ingest_images_{args.image_rows}_{args.image_step}", images_case(args), args)


def emit(record_name: str, result: dict[str, Any], args: argparse.Namespace) -> None:
    """Set against the last recorded figures (stderr), recorded, then printed."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import records

    result["against_record"] = records.compare_and_record(record_name, result, keep=not args.no_record)
    print(json.dumps(result), flush=True)


def part_c(args: argparse.Namespace) -> dict[str, Any]:
    """The ingest part of benchmarks/peers.py on the cached DataFrame: sparkdl.run beside
    TorchDistributor (and Petastorm where it imports) in one local[2] application."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from peers_parts import common
    from peers_parts import ingest as peers_ingest

    options = argparse.Namespace(rows=args.rows, features=args.features, batch_size=args.batch_size,
                                 repeats=args.repeats, source="cached")
    with tempfile.TemporaryDirectory(prefix="ingest-peers-") as scratch:
        options.work_dir = Path(scratch)
        spark = common.spark_session()
        try:
            return peers_ingest.measure(spark, options)
        finally:
            spark.stop()


def features_case(args: argparse.Namespace) -> None:
    report: dict[str, Any] = {
        "benchmark": "ingest",
        "rows": args.rows, "features": args.features, "batch_size": args.batch_size,
        "repeats": args.repeats, "chunk_mb": args.chunk_mb, "input_batch_rows": SPARK_BATCH_ROWS,
        "cpus": os.cpu_count(),
    }
    started = time.perf_counter()
    report["part_a"] = part_a(args)
    if args.spark:
        report["part_b"] = part_b(args)
    if args.peers:
        report["part_c"] = part_c(args)
    report["wall_s"] = round(time.perf_counter() - started, 1)
    report["loadavg_after"] = loadavg()
    parts = "a" + ("b" if args.spark else "") + ("c" if args.peers else "")
    emit(f"ingest_{parts}_{args.rows}_{args.features}", report, args)


if __name__ == "__main__":
    main()
