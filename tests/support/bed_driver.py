"""Driver script of the multi-host bed's tests (tests/support/multihost.py), run on the bed's driver
host against its standalone master. One process runs several scenarios on one SparkSession (a
session start costs tens of seconds on the bed) and writes one JSON object per scenario to OUT:
what it measured, or the error's type and text. What a scenario needs of the network (a link
shaped or cut, a firewall, a host listening on the wire) it asks of the test process through
files in --ask (tests/support/bed_controller.py).

    python bed_driver.py MASTER OUT SCENARIO[,SCENARIO...] --shared DIR [--ask DIR] [--conf K=V]

Scenarios: fit-<strategy> (data_parallel, diloco, hybrid, ist, sharded), fit-horovod,
fit-checkpoint-local (checkpoint_dir under this host's /tmp), fit-firewalled (the worker hosts reject each other), fit-unreachable-client (the worker
hosts reject this one: MASTER is then a Connect server's sc:// URL), kill (an executor JVM killed
mid-fit, resumed from checkpoints in --shared), calibrate-hetero (the last worker host at 20 Mbit/s: the probe's
pair matrix, then a hybrid fit of three stages placed on it), cut-short / cut-long / cut-resume
(rank 0's host cut off mid-fit: shorter than launch.timeout_s, longer without checkpoints, longer
with checkpoints in --shared), inject (a host without the run's secret tries the driver channel
mid-fit; the model is then saved under this host's /tmp and loaded back), plan.
"""
from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

FEATURES = [f"f{i}" for i in range(8)]
CUT_TIMEOUT_S = 15.0  # launch.timeout_s of the cut scenarios
SLOW_MBIT = 20


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))


def rows(count: int = 1200, seed: int = 3) -> list[tuple[Any, ...]]:
    """Three separable classes: every strategy reaches a high accuracy in a few epochs."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(count, 8))
    y = (x[:, 0] > 0.4).astype(int) + (x[:, 1] + x[:, 2] > 0.8).astype(int)
    return [(*map(float, r), int(t)) for r, t in zip(x, y)]


def frame(spark: Any, workers: int) -> Any:
    # Fixed partitions (no shuffle): each rank's rows and their order are the same on every master.
    if not hasattr(spark, "sparkContext") or spark.__class__.__module__.startswith("pyspark.sql.connect"):
        return spark.createDataFrame(rows(), FEATURES + ["label"]).repartition(workers).cache()  # a Connect client
    return spark.sparkContext.parallelize(rows(), workers).toDF(FEATURES + ["label"]).cache()


def accuracy(model: Any, df: Any) -> float:
    scored = model.transform(df).select("label", "prediction").collect()
    return sum(int(r["label"]) == int(r["prediction"]) for r in scored) / len(scored)


def fit(spark: Any, df: Any, workers: int, strategy: str, backend: str = "torch", **extra: Any) -> dict[str, Any]:
    from sparkdl import TorchEstimator

    options: dict[str, Any] = dict(model=net, feature_cols=FEATURES, label_col="label", batch_size=32, epochs=6,
                                   num_workers=workers, optimizer="adam", lr=0.01, seed=7, strategy=strategy,
                                   backend=backend, tracking=False, progress=False)
    if strategy == "diloco":
        options.update(strategy="data_parallel", sync="diloco", sync_every=2, epochs=10)
    if strategy == "hybrid":
        options.update(stages=2)
    options.update(extra)
    started = time.monotonic()
    model = TorchEstimator(**options).fit(df)
    return {"accuracy": accuracy(model, df), "seconds": round(time.monotonic() - started, 1),
            "history": model.history[-1] if model.history else None}


# -- asking the test process ------------------------------------------------------------------------
ASK = {"dir": ""}


def ask(request: dict[str, Any], wait: bool = True, timeout: float = 180.0) -> dict[str, Any]:
    """Hand `request` to the test process's controller; its answer (or {} at once without `wait`)."""
    directory = Path(ASK["dir"])
    path = directory / f"{time.time_ns()}-{socket.gethostname()}.json"
    path.with_suffix(".part").write_text(json.dumps(request))
    path.with_suffix(".part").replace(path)
    if not wait:
        return {}
    done, deadline = path.with_suffix(".done"), time.monotonic() + timeout
    while not done.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the controller did not answer {request}")
        time.sleep(0.05)
    answer = json.loads(done.read_text())
    if "error" in answer:
        raise RuntimeError(f"the controller could not {request}: {answer['error']}")
    return answer


# -- cutting rank 0's host off mid-fit ---------------------------------------------------------------
CUT = {"ask": "", "seconds": 0.0, "calls": 0, "once": ""}


def cutting_loss(output: Any, labels: Any) -> Any:
    """Cross-entropy; rank 0's 40th call asks for its own host to be cut off for CUT["seconds"]
    (the request goes through the shared directory, which the executors see too) and waits a
    second, so that the cut lands while the ranks still train. Once per fit: a retried attempt
    (a new task, a fresh count) finds the marker file."""
    CUT["calls"] += 1
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if CUT["ask"] and rank == 0 and CUT["calls"] == 40:
        try:
            Path(CUT["once"]).touch(exist_ok=False)
        except FileExistsError:
            return nn.functional.cross_entropy(output, labels)
        ASK["dir"] = CUT["ask"]
        ask({"do": "cut", "host": socket.gethostname(), "seconds": CUT["seconds"]}, wait=False)
        time.sleep(1.0)
    return nn.functional.cross_entropy(output, labels)


def trained_weights(df: Any, workers: int, cut_s: float = 0.0, **extra: Any) -> tuple[dict[str, Any], Any]:
    from sparkdl import TorchEstimator

    CUT.update(ask=ASK["dir"] if cut_s else "", seconds=cut_s, calls=0, once=str(Path(ASK["dir"]) / f"cut-{time.time_ns()}"))
    # strategy named: under "auto" the batch follows measured speeds (batch_balance="dynamic"), and a
    # cut host's split differs from the reference's by float rounding; these tests compare bit for bit.
    model = TorchEstimator(model=net, feature_cols=FEATURES, label_col="label", batch_size=16, epochs=4,
                           num_workers=workers, optimizer="sgd", lr=0.05, seed=7, tracking=False, progress=False,
                           loss=cutting_loss, **{"strategy": "data_parallel", **extra}).fit(df)
    return {k: v.detach().clone() for k, v in model.torch_module().state_dict().items()}, model


REFERENCE: dict[str, Any] = {}


def reference_weights(df: Any, workers: int) -> dict[str, Any]:
    if "weights" not in REFERENCE:
        REFERENCE["weights"] = trained_weights(df, workers)[0]
    return REFERENCE["weights"]


def said(pattern: str) -> Callable[[], list[tuple[float, str]]]:
    """The sparkdl log lines containing `pattern` from now on, with their times (time.time())."""
    lines: list[tuple[float, str]] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if pattern in record.getMessage():
                lines.append((time.time(), record.getMessage()))

    logger = logging.getLogger("sparkdl")
    logger.addHandler(Keep())
    logger.setLevel(min(logger.level or logging.INFO, logging.INFO))
    return lambda: lines


def cut_short(df: Any, workers: int) -> dict[str, Any]:
    """A link cut shorter than launch.timeout_s mid-run: training goes on, to the same weights."""
    reference = reference_weights(df, workers)
    started = time.monotonic()
    cut, _ = trained_weights(df, workers, cut_s=8.0, timeout_s=60)
    return {"same_weights": all(torch.equal(reference[k], cut[k]) for k in reference),
            "seconds": round(time.monotonic() - started, 1), "cut_for_s": 8.0}


def cut_long(df: Any, workers: int, checkpoints: Path | None) -> dict[str, Any]:
    """Rank 0's host cut off for longer than launch.timeout_s: without checkpoints the fit fails
    naming the rank and its host; with them the attempt is retried once the host is back and
    resumes to the weights of an uninterrupted run."""
    reference = reference_weights(df, workers) if checkpoints else {}
    cut_s = CUT_TIMEOUT_S + 12.0
    failures = said("failed (training failed")  # an attempt that is retried
    extra: dict[str, Any] = {"timeout_s": CUT_TIMEOUT_S}
    if checkpoints:
        extra.update(checkpoint_dir=str(checkpoints), checkpoint_every=5)
    started, since = time.monotonic(), time.time()
    result: dict[str, Any] = {"cut_for_s": cut_s, "timeout_s": CUT_TIMEOUT_S}
    try:
        weights, model = trained_weights(df, workers, cut_s=cut_s, **extra)
        result.update(same_weights=all(torch.equal(reference[k], weights[k]) for k in reference),
                      resumed_from=[h.get("resumed_from_step") for h in model.history if h.get("resumed_from_step")])
    except Exception as exc:  # noqa: BLE001 - the test asserts on it
        result.update(error=type(exc).__name__, message=str(exc), hint=getattr(exc, "hint", ""))
    cut_at = _cut_time(since)
    result["error_after_cut_s"] = round(time.time() - cut_at, 1) if "error" in result and cut_at else None
    result["attempt_failed"] = [(round(t - cut_at, 1) if cut_at else None, line) for t, line in failures()]
    result["seconds"] = round(time.monotonic() - started, 1)
    _wait_for_mend(cut_at, cut_s)
    return result


def _cut_time(since: float) -> float | None:
    """When (time.time(): one clock for every process of the machine) a cut after `since` was done."""
    answers = [json.loads(done.read_text()) for done in Path(ASK["dir"]).glob("*.done")]
    cuts = [a["cut_at"] for a in answers if a.get("cut_at", 0) > since]
    return max(cuts) if cuts else None


def _wait_for_mend(cut_at: float | None, cut_s: float) -> None:
    if cut_at is not None:
        time.sleep(max(0.0, cut_at + cut_s + 1.0 - time.time()))


# -- other scenarios --------------------------------------------------------------------------------
def firewalled(spark: Any, df: Any, workers: int, between: str) -> dict[str, Any]:
    """A fit while the worker hosts reject each other's connections to ports the OS picks, where
    gloo listens ("workers": a firewall open only for Spark's configured ports), or every
    connection to this host ("client": a Connect client the executors cannot reach)."""
    ask({"do": "firewall", "on": True, "between": between, "host": socket.gethostname()})
    try:
        return fit(spark, df, workers, "data_parallel")
    finally:
        ask({"do": "firewall", "on": False, "between": between, "host": socket.gethostname()})


def kill(spark: Any, shared: Path) -> dict[str, Any]:
    """standalone_fit's fit whose rank-1 executor JVM is SIGKILLed mid-run, with checkpoints in the
    shared directory: its weights (in the shared directory) and what the driver said."""
    from pyspark import cloudpickle

    import standalone_fit

    cloudpickle.register_pickle_by_value(standalone_fit)  # the executors cannot import it: its loss goes by value
    retried = said("attempt 1 of")
    standalone_fit.MARKER.update(path=str(shared / "killed"), checkpoints=str(shared / "kill-ckpt"))
    try:
        model = standalone_fit.estimator(checkpoint_dir=str(shared / "kill-ckpt"), checkpoint_every=3,
                                         slot_wait_s=60).fit(standalone_fit.rows_df(spark))
    finally:
        standalone_fit.MARKER.update(path="", checkpoints="")
    torch.save({"state": model.torch_module().state_dict(), "history": model.history}, shared / "killed.pt")
    return {"killed": (shared / "killed").exists(), "retried": [line for _, line in retried()],
            "resumed_from": [h["resumed_from_step"] for h in model.history if "resumed_from_step" in h], "weights": str(shared / "killed.pt")}


def save_and_load(df: Any, model: Any) -> dict[str, Any]:
    """`model` saved under this host's own /tmp (no executor sees it) and loaded back here."""
    from sparkdl import TorchModel

    path = f"/tmp/sparkdl-model-{time.time_ns()}"
    model.save(path)
    loaded = TorchModel.load(path)
    before = [r["prediction"] for r in model.transform(df).select("prediction").collect()]
    after = [r["prediction"] for r in loaded.transform(df).select("prediction").collect()]
    return {"path": path, "same_predictions": before == after, "files": sorted(p.name for p in Path(path).iterdir())}


def hetero(spark: Any, df: Any) -> dict[str, Any]:
    """Three worker hosts, the last at SLOW_MBIT: the calibration's pair matrix (twice: the first
    also starts the Python workers), then a hybrid fit of three stages placed on it."""
    import sparkdl
    from sparkdl.driver.planning import calibrate, session_facts

    slow = ask({"do": "shape", "last_worker": True, "mbit": SLOW_MBIT})["host"]
    try:
        first = calibrate(spark, 3, refresh=True)
        info = calibrate(spark, 3, refresh=True)
        pairs = {}
        for i in range(3):
            for j in range(i + 1, 3):
                a, b = info.rank_executors[i], info.rank_executors[j]
                pairs[f"{a}-{b}"] = {"typical": info.bandwidth_Bps[i][j], "best": info.best_bandwidth_Bps[i][j]}
        auto = sparkdl.plan(net, df, feature_cols=FEATURES, label_col="label", batch_size=32, epochs=6, num_workers=3,
                            tracking=False, strategy="auto").auto  # on the calibration just cached
        placed = fit(spark, df, 3, "hybrid", stages=3, epochs=2)
        islands = islands_fit(df)
    finally:
        ask({"do": "shape", "last_worker": True, "mbit": 1000})
    return {"slow_host": slow, "pairs": pairs, "probe_s": info.probe_s, "first_probe_s": first.probe_s,
            "plan_links": [[a, b, bandwidth] for a, b, _, bandwidth in (auto.executor_links if auto else ())],
            "cache_executors": list(session_facts(spark, 3).executors),
            "grid_executors": (placed["history"] or {}).get("hybrid_grid_executors"),
            "grid": (placed["history"] or {}).get("hybrid_grid"), "islands": islands}


def islands_fit(df: Any) -> dict[str, Any]:
    """islands=2 on the heterogeneous links: the islands found in the measured pairs, data parallel
    inside, DiLoCo (int8 across, two fragments overlapped by a step) between them."""
    from sparkdl import TorchEstimator

    model = TorchEstimator(model=net, feature_cols=FEATURES, label_col="label", batch_size=32, epochs=6,
                           num_workers=3, optimizer="adam", lr=0.01, seed=7, strategy="data_parallel", sync="diloco",
                           sync_every=4, fragments=2, fragment_sync_delay=1, sync_dtype="int8", islands=2,
                           tracking=False, progress=False).fit(df)
    settings = dict(model.plan.settings)
    return {"strategy": model.plan.strategy, "islands": [list(g) for g in settings["islands"]],
            "accuracy": accuracy(model, df)}


def streaming(spark: Any, df: Any, workers: int) -> dict[str, Any]:
    """Streaming DiLoCo with 4-bit outer gradients across hosts, beside the same fit in fp32."""
    common = dict(sync_every=4, fragments=2, fragment_sync_delay=1, epochs=10)
    quantized = fit(spark, df, workers, "diloco", sync_dtype="int4", **common)
    full = fit(spark, df, workers, "diloco", **common)
    return {"int4": quantized, "fp32": full}


def inject(spark: Any, df: Any, workers: int) -> dict[str, Any]:
    """A host without the run's secret tries the driver channel (bed_attacker.py) having recorded
    what reached the driver host on the wire, while the fit waits on its first epoch's callback (as
    a notebook's callback holds training); the run's records must come through intact. The model
    is then saved to a path only this host sees, and loaded back."""
    from sparkdl import TorchEstimator
    from sparkdl.driver import channel as channel_module

    opened: list[Any] = []
    original = channel_module.DriverChannel.__init__

    def remembered(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        opened.append(self)

    seen: list[dict[str, Any]] = []
    report: dict[str, Any] = {}

    def attack_on_first_epoch(record: dict[str, Any]) -> None:
        seen.append(dict(record))
        if len(seen) == 1:
            address = opened[-1].address
            report.update(ask({"do": "attack", "host": address.host, "port": address.port}))

    ask({"do": "sniff", "host": socket.gethostname()})
    channel_module.DriverChannel.__init__ = remembered  # type: ignore[method-assign]
    try:
        model = TorchEstimator(model=net, feature_cols=FEATURES, label_col="label", batch_size=16, epochs=3,
                               num_workers=workers, seed=7, tracking=False, progress=False,
                               callbacks=[attack_on_first_epoch]).fit(df)
    finally:
        channel_module.DriverChannel.__init__ = original  # type: ignore[method-assign]
    history = model.history
    return {"attack": report, "refused": opened[-1].refused, "epochs_seen": [r.get("epoch") for r in seen],
            "same_records": [r.get("loss") for r in seen] == [h.get("loss") for h in history],
            "epochs": [h.get("epoch") for h in history], "saved": save_and_load(df, model)}


def plan(spark: Any, df: Any, workers: int) -> dict[str, Any]:
    import sparkdl

    resolved = sparkdl.plan(net, df, feature_cols=FEATURES, label_col="label", batch_size=32, epochs=6,
                            num_workers=workers, tracking=False, strategy="auto")
    auto = resolved.auto
    return {"strategy": resolved.strategy,
            "links": [[a, b, latency, bandwidth] for a, b, latency, bandwidth in (auto.executor_links if auto else ())]}


def scenario(name: str, spark: Any, df: Any, workers: int, shared: Path) -> dict[str, Any]:
    simple: dict[str, Callable[[], dict[str, Any]]] = {
        "fit-horovod": lambda: fit(spark, df, workers, "data_parallel", backend="horovod"),
        "fit-checkpoint-local": lambda: fit(spark, df, workers, "data_parallel", checkpoint_dir="/tmp/sparkdl-ckpt",
                                            checkpoint_every=5),
        "fit-firewalled": lambda: firewalled(spark, df, workers, "workers"),
        "fit-unreachable-client": lambda: firewalled(spark, df, workers, "client"),
        "kill": lambda: kill(spark, shared),
        "calibrate-hetero": lambda: hetero(spark, df),
        "fit-streaming": lambda: streaming(spark, df, workers),
        "cut-short": lambda: cut_short(df, workers),
        "cut-long": lambda: cut_long(df, workers, None),
        "cut-resume": lambda: cut_long(df, workers, shared / "cut-ckpt"),
        "inject": lambda: inject(spark, df, workers),
        "plan": lambda: plan(spark, df, workers),
    }
    if name in simple:
        return simple[name]()
    if name.startswith("fit-"):
        return fit(spark, df, workers, name[4:])
    raise ValueError(f"unknown scenario {name!r}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("master")
    parser.add_argument("out", type=Path)
    parser.add_argument("scenarios")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--shared", type=Path, required=True, help="a directory every host shares")
    parser.add_argument("--ask", default="", help="where the test process's controller takes requests")
    parser.add_argument("--conf", action="append", default=[])
    args = parser.parse_args()
    ASK["dir"] = args.ask
    from pyspark.sql import SparkSession

    builder = (SparkSession.builder.master(args.master).appName("sparkdl-bed")
               .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
               .config("spark.executor.cores", "1").config("spark.task.cpus", "1")
               .config("spark.executor.memory", "1g")
               .config("spark.scheduler.minRegisteredResourcesRatio", "1.0")
               .config("spark.scheduler.maxRegisteredResourcesWaitingTime", "120s")
               # Executors fetch blocks from each other on this port: a firewall (fit-firewalled) lets it
               # through, as a locked-down cluster opens the ports Spark is configured with.
               .config("spark.blockManager.port", "7100"))
    for item in args.conf:
        key, value = item.split("=", 1)
        builder = builder.config(key, value)
    if args.master.startswith("sc://"):  # a Spark Connect client
        builder = SparkSession.builder.remote(args.master)
    spark = builder.getOrCreate()
    results: dict[str, Any] = {}
    try:
        df = frame(spark, args.workers)
        df.count()
        for name in args.scenarios.split(","):
            started = time.monotonic()
            try:
                results[name] = scenario(name, spark, df, args.workers, args.shared)
            except Exception as exc:  # noqa: BLE001 - reported to the test, the next scenario still runs
                results[name] = {"error": type(exc).__name__, "message": str(exc),
                                 "trace": traceback.format_exc()[-3000:]}
            results[name]["wall_s"] = round(time.monotonic() - started, 1)
            args.out.write_text(json.dumps(results, indent=1))
            print(f"[bed] {name}: {json.dumps(results[name])[:600]}", file=sys.stderr, flush=True)
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
