"""Step time: the same MLP (64-512-512-10), batch (256 rows per rank) and SGD on 2 ranks, sparkdl
data parallel (TorchEstimator.fit on a Spark DataFrame, batches from its spool) against torchrun +
DistributedDataParallel (gloo, the batches already in memory as tensors). One intra-op thread per
rank in both (sparkdl's default for 2 ranks on 2 cores, torchrun's OMP_NUM_THREADS=1). Per run:
median over epochs 2+ of epoch seconds / steps; the first epoch (warm-up, spool) is left out.
Target: sparkdl <= 1.05x torchrun DDP.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from peers_parts import common  # noqa: E402
from peers_parts.workloads import mlp  # noqa: E402

FEATURES, HIDDEN, CLASSES, BATCH = 64, 512, 10, 256


def sparkdl_step_s(frame: Any, epochs: int) -> float:
    from sparkdl import TorchEstimator

    model = TorchEstimator(model=mlp(FEATURES, HIDDEN, CLASSES), feature_cols=common.feature_names(FEATURES),
                           label_col="label", batch_size=BATCH, epochs=epochs, num_workers=common.WORLD,
                           strategy="data_parallel", optimizer="sgd", lr=0.01, tracking=False,
                           progress=False).fit(frame)
    return statistics.median(h["seconds"] / h["steps"] for h in model.history[1:])


def torchrun_step_s(rows_per_rank: int, epochs: int) -> float:
    _, _, result = common.run_workload("torchrun", "ddp", rows_per_rank=rows_per_rank, epochs=epochs,
                                       features=FEATURES, hidden=HIDDEN, classes=CLASSES, batch=BATCH)
    return statistics.median(e["seconds"] / e["steps"] for e in result["epochs"][1:])


def measure(spark: Any, args: Any) -> dict[str, Any]:
    rows = args.step_rows
    frame = common.make_frame(spark, rows, FEATURES, CLASSES)
    runs: dict[str, list[float]] = {"sparkdl_step_ms": [], "torchrun_ddp_step_ms": []}
    try:
        for round_no in range(args.repeats):
            common.log(f"steps round {round_no + 1}/{args.repeats}")
            runs["sparkdl_step_ms"].append(1000 * sparkdl_step_s(frame, args.step_epochs))
            runs["torchrun_ddp_step_ms"].append(1000 * torchrun_step_s(rows // common.WORLD, args.step_epochs))
    finally:
        frame.unpersist()
    return {"part": "steps", "figures": {k: round(common.median(v), 3) for k, v in runs.items()},
            "runs": {k: [round(x, 3) for x in v] for k, v in runs.items()},
            "ratios": [common.ratio_entry("step time: sparkdl data parallel / torchrun DDP",
                                          list(zip(runs["sparkdl_step_ms"], runs["torchrun_ddp_step_ms"])),
                                          1.05, "lower")],
            "notes": [f"MLP {FEATURES}-{HIDDEN}-{HIDDEN}-{CLASSES}, {BATCH} rows per rank and step, SGD, "
                      f"{rows} rows, {args.step_epochs} epochs per run, median of epochs 2+; sparkdl's step "
                      "includes taking the batch from its spool, torchrun's indexing an in-memory tensor"],
            "errors": {}}


if __name__ == "__main__":
    common.run_alone(measure, __doc__.splitlines()[0], step_rows=102_400, step_epochs=3)
