"""The driver side of benchmarks/slow_links.py: runs on the multi-host bed's driver host, asks the
benchmark process (which owns the links) to set each network, and trains every row on it.

Every row trains the same GPT on the same byte tokens with the same batch and lr schedule for the
same steps; sparkdl's rows are one TorchEstimator fit each, TorchDistributor's is plain DDP in a
train function reading the same rows from the shared directory. Figures per row: wall seconds of the
training loop, bytes each rank sent, eval loss after every epoch on the same held-out rows, compute
utilisation (1 - seconds blocked on communication / seconds).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "examples"), str(HERE.parent / "tests" / "support")]

import bed_driver  # noqa: E402 - the bed's ask() (tests/support)
import language_model  # noqa: E402 - the GPT of examples/language_model.py

SEQ_LEN, HEADS = 64, 4
SHAPE = {"d_model": 128, "layers": 2}  # set from --d-model / --layers in main()
LR, MIN_LR, WARMUP = 3e-3, 3e-4, 20


def rows_for(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each row's sparkdl options (TorchDistributor's row is separate)."""
    streamed = {"strategy": "data_parallel", "sync": "diloco", "sync_every": args.streaming_h,
                "fragments": args.fragments, "fragment_sync_delay": args.delay}
    return {
        "data_parallel": {"strategy": "data_parallel"},
        "diloco_fp32": {"strategy": "data_parallel", "sync": "diloco", "sync_every": args.diloco_h},
        "streaming_int8": {**streamed, "sync_dtype": "int8"},
        "streaming_int4": {**streamed, "sync_dtype": "int4"},
        "diloco_fp16": {"strategy": "data_parallel", "sync": "diloco", "sync_every": args.diloco_h,
                        "sync_dtype": "fp16"},
        "islands": {**streamed, "sync_dtype": "int4", "islands": 2},
        "auto": {"strategy": "auto"},
    }


def fit_row(spark: Any, train: Any, evaluation: Any, options: dict[str, Any], args: argparse.Namespace,
            cap_s: float) -> dict[str, Any]:
    from sparkdl import TorchEstimator

    spent = {"s": 0.0}

    def capped(record: dict[str, Any]) -> str | None:
        spent["s"] += record["seconds"]
        return "stop" if spent["s"] >= cap_s else None

    started = time.perf_counter()
    approximate = options.get("sync") == "diloco" or options.get("strategy") == "auto"
    epochs = args.approximate_epochs if approximate and args.approximate_epochs else args.epochs
    estimator = TorchEstimator(
        model=_model_factory, validation_df=evaluation, input_cols=["tokens"], label_col="targets",
        loss="cross_entropy", optimizer="adamw", lr=LR, lr_schedule="cosine", warmup_steps=WARMUP, min_lr=MIN_LR,
        batch_size=args.batch, epochs=epochs, num_workers=args.workers, seed=0, progress=False, tracking=False,
        # The emulated hosts share this machine's cores: one torch thread a rank, as DDP's (two each
        # made 8 threads on 2 cores, whose OpenMP spinning at every collective slowed data parallel 5x).
        threads_per_worker=1, callbacks=[capped], **options)
    fitted = estimator.fit(train)
    wall = time.perf_counter() - started
    history = fitted.history
    seconds = [float(r["seconds"]) for r in history]
    waits = [float(r.get("max_comm_wait_s_per_rank", 0.0)) for r in history]
    plan = fitted.plan
    return {"fit_wall_s": round(wall, 2), "train_s": round(sum(seconds), 2),
            "steps": int(sum(r["steps"] for r in history)),
            "bytes_per_rank": int(sum(r["bytes_sent_all_ranks"] for r in history) / args.workers),
            "curve": [[round(sum(seconds[: i + 1]), 3), int(sum(r["steps"] for r in history[: i + 1])),
                       float(r["val_loss"])] for i, r in enumerate(history)],
            "eval_loss": float(history[-1]["val_loss"]),
            "compute_utilisation": round(1 - sum(waits) / max(sum(seconds), 1e-9), 3),
            "capped": sum(seconds) >= cap_s and len(history) < epochs, "epochs": epochs,
            "plan": plan.strategy if plan is not None else "", "options": _plain(plan.options) if plan is not None else {},
            "explain": plan.explain() if plan is not None and plan.auto is not None else "",
            # The planner's predicted step of each candidate, against the rows' measured ones (slow_links.py)
            "candidates": [{"label": c.label, "predicted_step_s": c.predicted_step_s} for c in plan.candidates]
            if plan is not None else [],
            "chosen_label": plan.choice.label if plan is not None and plan.choice is not None else ""}


def _plain(options: dict[str, Any]) -> dict[str, Any]:
    return {k: v if isinstance(v, (int, float, str, bool)) else json.loads(json.dumps(v)) for k, v in options.items()}


def _model_factory(d_model: int = 0, layers: int = 0) -> Any:
    return language_model.gpt(d_model or SHAPE["d_model"], layers or SHAPE["layers"], HEADS, SEQ_LEN)


def ddp_train(tokens_path: str, eval_path: str, epochs: int, batch: int, steps_per_epoch: int, cap_s: float,
              d_model: int, layers: int) -> Any:
    """TorchDistributor's train function: plain DDP (gloo) on this rank's share of the same rows."""
    import os

    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = np.load(tokens_path)
    evaluation = torch.from_numpy(np.load(eval_path)).long()
    shard = torch.from_numpy(data[rank::world]).long()
    torch.manual_seed(0)
    model = language_model.gpt(d_model, layers, HEADS, SEQ_LEN)
    # Compute alone (no communication): a few local steps on a copy, for the utilisation figure.
    import copy

    alone = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(alone.parameters(), lr=LR, weight_decay=0.0)
    times = []
    for i in range(6):
        x = shard[i * batch:(i + 1) * batch]
        tick = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(alone(x[:, :-1]).reshape(-1, 256), x[:, 1:].reshape(-1)).backward()
        optimizer.step()
        times.append(time.perf_counter() - tick)
    compute_step_s = sorted(times[1:])[len(times[1:]) // 2]
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=0.0)
    total = epochs * steps_per_epoch

    def factor(step: int) -> float:  # sparkdl's LrCurve("cosine", total, WARMUP, MIN_LR / LR)
        if step < WARMUP:
            return step / WARMUP
        span = max(1, total - WARMUP)
        m = MIN_LR / LR
        return m + (1 - m) * (1 + math.cos(math.pi * min(step - WARMUP, span) / span)) / 2

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    curve, step, started = [], 0, time.perf_counter()
    for epoch in range(epochs):
        order = torch.randperm(len(shard), generator=torch.Generator().manual_seed(epoch))
        for i in range(steps_per_epoch):
            x = shard[order[i * batch:(i + 1) * batch]]
            optimizer.zero_grad()
            F.cross_entropy(ddp(x[:, :-1]).reshape(-1, 256), x[:, 1:].reshape(-1)).backward()
            optimizer.step()
            scheduler.step()
            step += 1
        trained = time.perf_counter() - started
        with torch.no_grad():
            model.eval()
            loss = float(F.cross_entropy(model(evaluation[:, :-1]).reshape(-1, 256), evaluation[:, 1:].reshape(-1)))
            model.train()
        curve.append([round(trained, 3), step, loss])
        started += time.perf_counter() - started - trained  # evaluation time is not training time
        if trained >= cap_s:
            break
    dist.destroy_process_group()
    if rank == 0:
        return {"curve": curve, "compute_step_s": compute_step_s, "world": world,
                "host": os.uname().nodename}
    return None


def ddp_row(spark: Any, shared: Path, args: argparse.Namespace, steps_per_epoch: int, cap_s: float) -> dict[str, Any]:
    from pyspark.ml.torch.distributor import TorchDistributor

    started = time.perf_counter()
    out = TorchDistributor(num_processes=args.workers, local_mode=False, use_gpu=False).run(
        ddp_train, str(shared / "train.npy"), str(shared / "eval.npy"), args.epochs, args.batch, steps_per_epoch,
        cap_s, SHAPE["d_model"], SHAPE["layers"])
    wall = time.perf_counter() - started
    curve = out["curve"]
    params = sum(p.numel() for p in _model_factory().parameters())
    steps = curve[-1][1]
    train_s = curve[-1][0]
    w = args.workers
    return {"fit_wall_s": round(wall, 2), "train_s": train_s, "steps": steps,
            # DDP allreduces every gradient every step: a ring's 2 (W-1)/W of the fp32 gradients per rank.
            "bytes_per_rank": int(steps * 2 * (w - 1) / w * 4 * params), "curve": curve, "eval_loss": curve[-1][2],
            "compute_utilisation": round(min(1.0, steps * out["compute_step_s"] / max(train_s, 1e-9)), 3),
            "capped": steps < args.epochs * steps_per_epoch, "bytes_counted": "ring formula"}


NETWORKS = {
    "1gbit": {"mbit": 1000},
    "100mbit": {"mbit": 100},
    "20mbit": {"mbit": 20},
    "islands": {"mbit": 1000, "islands": [[1, 2], [3, 4]], "across_mbit": 20},
}
# Which rows run where (to keep the whole run near 30 minutes): every row at 1 Gbit/s; elsewhere the
# rows whose figures there are asked for.
WHERE = {"diloco_fp16": ("1gbit",), "streaming_int8": ("1gbit", "100mbit"), "diloco_fp32": ("1gbit", "20mbit", "islands"),
         "islands": ("islands",)}
# The trajectories of exact rows do not depend on the network (same updates): away from 1 Gbit/s they
# run under the short cap, for their step time; their loss curve is the 1 Gbit/s one.
EXACT_ROWS = ("data_parallel", "torchdistributor_ddp")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("master")
    parser.add_argument("out", type=Path)
    parser.add_argument("--shared", type=Path, required=True)
    parser.add_argument("--ask", required=True)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--networks", default=",".join(NETWORKS))
    parser.add_argument("--rows", default="")
    parser.add_argument("--train-rows", type=int, default=2048)
    parser.add_argument("--eval-rows", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--approximate-epochs", type=int, default=0,
                        help="epochs of the DiLoCo-family rows (and auto), to see when they reach data parallel's "
                             "final loss (0: --epochs)")
    parser.add_argument("--diloco-h", type=int, default=32)
    parser.add_argument("--streaming-h", type=int, default=104)
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--delay", type=int, default=2)
    parser.add_argument("--cap-s", type=float, default=120.0, help="training seconds a row may take")
    parser.add_argument("--exact-cap-s", type=float, default=30.0, help="an exact row's cap away from 1 Gbit/s")
    args = parser.parse_args()
    SHAPE.update(d_model=args.d_model, layers=args.layers)
    bed_driver.ASK["dir"] = args.ask
    import os

    import cloudpickle
    from pyspark import cloudpickle as spark_cloudpickle

    # Executors cannot import examples/: the GPT's module travels by value (sparkdl pickles with
    # pyspark's cloudpickle, TorchDistributor with the cloudpickle package).
    for pickler in (cloudpickle, spark_cloudpickle):
        pickler.register_pickle_by_value(language_model)

    import numpy as np
    from pyspark.sql import SparkSession
    from sparkdl.datasets.images_text import _tokens_dataframe, text_token_arrays

    spark = (SparkSession.builder.master(args.master).appName("sparkdl-slow-links")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.executor.cores", "1").config("spark.task.cpus", "1").config("spark.executor.memory", "1g")
             .config("spark.cores.max", str(args.workers))
             .config("spark.scheduler.minRegisteredResourcesRatio", "1.0")
             .config("spark.scheduler.maxRegisteredResourcesWaitingTime", "120s")
             # TorchDistributor's gloo advertises what the host name resolves to (127.0.0.1 here) unless told.
             .config("spark.executorEnv.GLOO_SOCKET_IFNAME", "eth0").getOrCreate())
    results: dict[str, Any] = {"networks": {}, "started": time.time()}
    try:
        tokens, targets = text_token_arrays(SEQ_LEN, args.train_rows + args.eval_rows)
        order = np.random.default_rng(0).permutation(len(tokens))
        tokens, targets = tokens[order], targets[order]
        windows = np.concatenate([tokens, targets[:, -1:]], axis=1)  # tokens + the next byte
        np.save(args.shared / "train.npy", windows[: args.train_rows])
        np.save(args.shared / "eval.npy", windows[args.train_rows:])
        train = _tokens_dataframe(spark, tokens[: args.train_rows], targets[: args.train_rows]) \
            .repartition(args.workers).cache()
        evaluation = _tokens_dataframe(spark, tokens[args.train_rows:], targets[args.train_rows:]).cache()
        train.count(), evaluation.count()
        steps_per_epoch = args.train_rows // args.workers // args.batch
        chosen = [r for r in args.rows.split(",") if r] or [*rows_for(args), "torchdistributor_ddp"]
        for network in [n for n in args.networks.split(",") if n]:
            answer = bed_driver.ask({"do": "network", **NETWORKS[network]})
            os.environ["SPARKDL_CACHE_DIR"] = str(args.shared / f"calibration-{network}")  # measure this network
            rows: dict[str, Any] = {}
            for name in chosen:
                if network not in WHERE.get(name, tuple(NETWORKS)):
                    continue
                cap = args.exact_cap_s if name in EXACT_ROWS and network != "1gbit" else args.cap_s
                started = time.monotonic()
                try:
                    if name == "torchdistributor_ddp":
                        rows[name] = ddp_row(spark, args.shared, args, steps_per_epoch, cap)
                    else:
                        rows[name] = fit_row(spark, train, evaluation, rows_for(args)[name], args, cap)
                except Exception as exc:  # noqa: BLE001 - reported; the next row still runs
                    rows[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2500:]}
                rows[name]["row_s"] = round(time.monotonic() - started, 1)
                print(f"[slow_links] {network} {name}: {json.dumps(rows[name])[:400]}", file=sys.stderr, flush=True)
                results["networks"][network] = {"links": answer, "rows": rows}
                args.out.write_text(json.dumps(results, indent=1))
        results["steps_per_epoch"] = steps_per_epoch
        results["params"] = sum(p.numel() for p in _model_factory().parameters())
        args.out.write_text(json.dumps(results, indent=1))
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
