"""Driver script of benchmarks/recsys.py --mode bed: runs on the bed's driver host (tests/support/
multihost.py) against its standalone master, and writes one JSON object to OUT.

    python recsys_bed_driver.py MASTER OUT --shared DIR --ask DIR --opts JSON

One SparkSession, one synthetic Criteo-like log (benchmarks/recsys.py's make_log: the same rows,
seeds and planted labels as the local mode), and the variants one after the other on the same
worker hosts, data, DLRM, batch (per rank), epochs and optimizers (Adam on the dense part):
  sharded      TorchEstimator.fit, sparse_cols, embedding_placement="sharded", embedding_optimizer="adam"
  replicated   the same with embedding_placement="replicated" (skipped where sparkdl lacks it)
  ddp          pyspark.ml.torch.distributor.TorchDistributor(num_processes=W, local_mode=False,
               use_gpu=False).run(train_fn): DDP over gloo on the same DLRM with its tables whole,
               the DataFrame written to Parquet in the shared directory and each process reading its
               contiguous share (what TorchDistributor users do), one Adam with two groups (dense lr,
               tables lr). Dense table gradients: DDP refuses the collection's sparse ones (see
               SPARSE_DDP below; the run records the error it raised).
At every epoch end the worker hosts' interface counters are read through the test process's
controller (what each host's link carried, whatever sent it): sparkdl from a driver callback (rank 0
waits for it), DDP from rank 0 between two barriers. AUC on the held-out rows: sparkdl's model on the
driver, DDP's scored on its rank 0.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests" / "support")]

import recsys  # noqa: E402 - the local mode's generator and AUC
from recsys import DENSE, TABLES, _auc, _batch, make_log, table_rows  # noqa: E402

DENSE_COLS = [f"d{i}" for i in range(DENSE)]
SPARSE_NAMES = [f"c{t}" for t in range(TABLES)]
# What DDP does with the collection's sparse table gradients (DLRM(sparse_grad=True)), measured here
# once per run: its reducer expects sparse gradients only from nn.Embedding/EmbeddingBag modules
# with sparse=True, and the functional lookups' ones fail in backward.
SPARSE_DDP = {"error": ""}


def ask(directory: str, request: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    """The test process's controller answers `request` (a file in the shared `directory`)."""
    path = Path(directory) / f"{time.time_ns()}-{socket.gethostname()}-{os.getpid()}.json"
    path.with_suffix(".part").write_text(json.dumps(request))
    path.with_suffix(".part").replace(path)
    done, deadline = path.with_suffix(".done"), time.monotonic() + timeout
    while not done.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the controller did not answer {request}")
        time.sleep(0.02)
    return json.loads(done.read_text())


def model_factory(opts: dict[str, Any], sparse_grad: bool = False) -> Callable[[], Any]:
    rows = table_rows(opts["rows_min"], opts["rows_max"])

    def build() -> Any:
        import torch

        from sparkdl.embeddings import DLRM, TableSpec

        torch.manual_seed(opts["seed"])
        specs = [TableSpec(name, n, opts["dim"]) for name, n in zip(SPARSE_NAMES, rows)]
        return DLRM(DENSE, specs, bottom=[32, opts["dim"]], top=[64, 32], seed=opts["seed"],
                    sparse_grad=sparse_grad)
    return build


def frame(spark: Any, log: dict[str, np.ndarray]) -> Any:
    import pandas as pd

    columns = {name: log["dense"][:, i].astype(np.float64) for i, name in enumerate(DENSE_COLS)}
    columns.update({name: log["ids"][:, t] for t, name in enumerate(SPARSE_NAMES)})
    columns["label"] = log["labels"].astype(np.float64)
    return spark.createDataFrame(pd.DataFrame(columns))


def scores(model: Any, held: dict[str, np.ndarray]) -> np.ndarray:
    import torch

    model.eval()
    out = []
    with torch.no_grad():
        for start in range(0, len(held["labels"]), 4096):
            dense, sparse, _ = _batch(held, start, min(start + 4096, len(held["labels"])))
            out.append(model(dense, sparse).numpy())
    return np.concatenate(out)


def fit_sparkdl(df: Any, held: dict[str, np.ndarray], opts: dict[str, Any], placement: str) -> dict[str, Any]:
    from sparkdl import TorchEstimator

    rows = table_rows(opts["rows_min"], opts["rows_max"])
    counters: list[dict[str, Any]] = []

    def read_links(record: dict[str, Any]) -> None:  # rank 0 waits for the callbacks: no step runs meanwhile
        counters.append(ask(opts["ask"], {"do": "counters"}))

    started = time.perf_counter()
    trained = TorchEstimator(
        model=model_factory(opts), feature_cols=DENSE_COLS, label_col="label", loss="bce_with_logits",
        sparse_cols={name: {"num_rows": n} for name, n in zip(SPARSE_NAMES, rows)},
        strategy="embeddings", embedding_placement=placement, embedding_optimizer="adam",
        embedding_lr=opts["table_lr"], optimizer="adam", lr=opts["dense_lr"], batch_size=opts["batch"],
        epochs=opts["epochs"], num_workers=opts["world"], seed=opts["seed"], shuffle=False,
        threads_per_worker=1, tracking=False, progress=False, callbacks=[read_links]).fit(df)
    wall = time.perf_counter() - started
    epochs = [{"epoch": r["epoch"], "steps": int(r["steps"]), "samples": int(r["samples"]),
               "seconds": float(r["seconds"]), "bytes_sent_all_ranks": int(r.get("bytes_sent_all_ranks", 0)),
               "links": c} for r, c in zip(trained.history, counters)]
    predicted = scores(trained.torch_module(), held)
    return {"epochs": epochs, "fit_wall_s": round(wall, 1), "auc": _auc(held["labels"], predicted),
            "options": {k: str(v) for k, v in trained.options.items() if "embedding" in k or "strategy" in k}}


def ddp_train(opts: dict[str, Any], parquet: str, held_path: str, build: Callable[[], Any]) -> Any:
    """TorchDistributor's train function: DDP (gloo) on this process's contiguous share of the rows."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world, batch = dist.get_rank(), dist.get_world_size(), opts["batch"]
    table = pq.read_table(parquet)
    share = table.num_rows // world
    part = table.slice(rank * share, share)
    log = {"dense": np.stack([part.column(c).to_numpy() for c in DENSE_COLS], axis=1).astype(np.float32),
           "ids": np.stack([part.column(c).to_numpy() for c in SPARSE_NAMES], axis=1).astype(np.int64),
           "labels": part.column("label").to_numpy().astype(np.float32)}
    model = build()
    ddp = DistributedDataParallel(model)
    tables = list(model.embeddings.weights)
    ids = {id(p) for p in tables}
    dense = [p for p in model.parameters() if id(p) not in ids]
    optimizer = torch.optim.Adam([{"params": dense, "lr": opts["dense_lr"]},
                                  {"params": tables, "lr": opts["table_lr"]}])
    loss_fn = torch.nn.BCEWithLogitsLoss()
    epochs, step_s = [], []
    for _ in range(opts["epochs"]):
        dist.barrier()
        began = time.perf_counter()
        steps = share // batch
        for step in range(steps):
            tick = time.perf_counter()
            x, sparse, y = _batch(log, step * batch, (step + 1) * batch)
            optimizer.zero_grad(set_to_none=True)
            loss_fn(ddp(x, sparse), y).backward()
            optimizer.step()
            step_s.append(time.perf_counter() - tick)
        seconds = time.perf_counter() - began
        dist.barrier()
        links = ask(opts["ask"], {"do": "counters"}) if rank == 0 else {}
        epochs.append({"steps": steps, "samples": steps * batch * world, "seconds": seconds, "links": links})
        dist.barrier()
    result = None
    if rank == 0:
        with np.load(held_path) as held:
            result = {"epochs": epochs, "step_s": step_s, "scores": scores(model, dict(held)).tolist(),
                      "host": socket.gethostname()}
    dist.destroy_process_group()
    return result


def fit_ddp(df: Any, held: dict[str, np.ndarray], opts: dict[str, Any], shared: Path) -> dict[str, Any]:
    from pyspark.ml.torch.distributor import TorchDistributor
    parquet = shared / "train.parquet"
    if not parquet.exists():
        df.write.parquet(str(parquet))
    held_path = shared / "held.npz"
    np.savez(held_path, **held)
    started = time.perf_counter()
    out = TorchDistributor(num_processes=opts["world"], local_mode=False, use_gpu=False).run(
        ddp_train, opts, str(parquet), str(held_path), model_factory(opts))
    wall = time.perf_counter() - started
    return {"epochs": out["epochs"], "step_s": out["step_s"], "fit_wall_s": round(wall, 1),
            "auc": _auc(held["labels"], np.asarray(out["scores"])),
            "table_gradients": "dense (one Adam, tables' group at the table lr)",
            "sparse_gradients_error": SPARSE_DDP["error"]}


def probe_sparse_ddp(opts: dict[str, Any]) -> str:
    """One backward of DLRM(sparse_grad=True) under DDP in a world of one: the error it raises, or ''."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        small = {**opts, "rows_min": 10, "rows_max": 20}
        ddp = DistributedDataParallel(model_factory(small, sparse_grad=True)())
        log = make_log(table_rows(10, 20), 8, opts["zipf"], 0)
        x, sparse, y = _batch(log, 0, 8)
        torch.nn.functional.binary_cross_entropy_with_logits(ddp(x, sparse), y).backward()
        return ""
    except Exception as exc:  # noqa: BLE001 - the answer itself
        return f"{type(exc).__name__}: {exc}"
    finally:
        dist.destroy_process_group()


def replicated_available() -> str:
    """'' where sparkdl trains embedding_placement='replicated', else why not."""
    import importlib.util

    if importlib.util.find_spec("sparkdl.embeddings.replicated") is None:
        return "sparkdl.embeddings.replicated does not exist at this commit"
    return ""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("master")
    parser.add_argument("out", type=Path)
    parser.add_argument("--shared", type=Path, required=True)
    parser.add_argument("--ask", required=True)
    parser.add_argument("--opts", required=True, help="benchmarks/recsys.py's options (JSON)")
    args = parser.parse_args()
    opts = {**json.loads(args.opts), "ask": args.ask}
    import cloudpickle
    from pyspark import cloudpickle as spark_cloudpickle

    # benchmarks/ is not importable on the executors: recsys's functions travel by value (sparkdl
    # pickles with pyspark's cloudpickle, TorchDistributor with the cloudpickle package).
    for pickler in (cloudpickle, spark_cloudpickle):
        pickler.register_pickle_by_value(recsys)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(args.master).appName("sparkdl-recsys")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.executor.cores", "1").config("spark.task.cpus", "1").config("spark.executor.memory", "1g")
             .config("spark.cores.max", str(opts["world"])).config("spark.driver.maxResultSize", "2g")
             .config("spark.sql.execution.arrow.pyspark.enabled", "true")
             .config("spark.scheduler.minRegisteredResourcesRatio", "1.0")
             .config("spark.scheduler.maxRegisteredResourcesWaitingTime", "120s")
             # TorchDistributor's gloo advertises what the host name resolves to (127.0.0.1 here) unless told.
             .config("spark.executorEnv.GLOO_SOCKET_IFNAME", "eth0").getOrCreate())
    rows = table_rows(opts["rows_min"], opts["rows_max"])
    train_rows = opts["steps_per_epoch"] * opts["world"] * opts["batch"]
    log = make_log(rows, train_rows + opts["held_out"], opts["zipf"], opts["seed"])
    held = {k: v[train_rows:] for k, v in log.items()}
    train = {k: v[:train_rows] for k, v in log.items()}
    results: dict[str, Any] = {"variants": {}, "train_rows": train_rows, "table_rows": rows,
                               "planted_model_auc": _auc(held["labels"], held["logit"])}
    SPARSE_DDP["error"] = probe_sparse_ddp(opts)
    try:
        df = frame(spark, train).repartition(opts["world"]).cache()
        df.count()
        for name in opts["variants"]:
            started = time.monotonic()
            try:
                if name == "ddp":
                    row = fit_ddp(df, held, opts, args.shared)
                elif name == "replicated" and replicated_available():
                    row = {"skipped": replicated_available()}
                else:
                    row = fit_sparkdl(df, held, opts, name)
            except Exception as exc:  # noqa: BLE001 - reported; the next variant still runs
                row = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-4000:]}
            row["variant_wall_s"] = round(time.monotonic() - started, 1)
            results["variants"][name] = row
            args.out.write_text(json.dumps(results))
            print(f"[recsys] {name}: {json.dumps(row)[:600]}", file=sys.stderr, flush=True)
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
