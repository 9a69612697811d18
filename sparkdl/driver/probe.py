"""The calibration probe: a short barrier job of num_workers ranks that measures what the planner
prices a layout with, and hands it back as data (planner/cluster.py turns it into a ClusterInfo).

Every rank measures its matrix-product FLOP/s with the torch threads it trains with (and reports that
thread count); every pair of ranks measures latency (8-byte ping-pong) and bandwidth (a ping-pong of a message
sized from a first 256 KiB one: up to 16 MiB on fast links (a 1 Gbit/s link carries 4 MiB in 34 ms, too short to time on a busy host), ~0.1 s of transfer on slow ones);
rank 0 times the backend's allreduce (sized the same way). Compute repeats and a pair's bandwidth round
trips go on until their median's relative standard error is within SETTLED_RSE (or a cap and a time
budget run out): a loaded host's spread takes more repeats, and the confidence reached is reported
with the figures (explain() states it). Each measurement is kept at two ends: the median
(what the cluster did during the probe) and the best (what it can do: on a shared host noise only
slows a measurement down), so the planner can tell a decision that holds from one that hinges on
noise. `run_probe` launches the job through the launch modules directly, as `sparkdl.run` does for a
loop without a DataFrame, so the planner never climbs back to the public entry points.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

from sparkdl.planner.speed import matmul_rates

PING_ROUNDS = 20  # 8-byte round trips per pair
BANDWIDTH_ROUNDS = 3  # round trips of the sized message per pair, at least...
MAX_BANDWIDTH_ROUNDS = 12  # ...and at most, until the median's confidence is stated (SETTLED_RSE)
# A measurement is repeated until its median is known to within this relative standard error (a noisy
# host's spread needs more repeats), up to a cap and a time budget: the figure the planner prices with
# then comes with a stated confidence (explain() shows it).
SETTLED_RSE = 0.05
COMPUTE_BUDGET_S = 1.5  # extra matrix-product repeats per rank stop after this long
MAX_COMPUTE_REPEATS = 30
LINK_BUDGET_S = 2.0  # extra round trips per pair stop after this long
ALLREDUCE_ROUNDS = (20, 5)  # timed allreduces of 8 bytes, of the sized message
# Message sizes come from a first measurement, so that a slow link is measured in about a second,
# not in the tens of seconds 4 MiB messages take at 20 Mbit/s: one transfer of the sized message
# takes about TRANSFER_S, within [MIN_MESSAGE_BYTES, MAX_MESSAGE_BYTES].
SIZING_BYTES = 256 << 10
TRANSFER_S = 0.1
MIN_MESSAGE_BYTES, MAX_MESSAGE_BYTES = 64 << 10, 16 << 20


def run_probe(spark: Any, workers: int, threads_per_worker: int | None, trial: Any = None,
              cluster: bool = True) -> dict[str, Any]:
    """Run `probe` on `workers` ranks (a barrier job over `workers` one-row partitions) and return
    rank 0's result, the dict `probe` documents. `trial` (planner/step_trial.StepTrial): the run's
    model step, timed on every rank too; `cluster=False`: only that (the cluster's figures cached)."""
    import functools

    from pyspark import cloudpickle

    from sparkdl.config import DataConfig, LaunchConfig, TrackingConfig, TrainConfig
    from sparkdl.driver.attempts import tracked_submit
    from sparkdl.driver.job import new_run_id
    from sparkdl.wire.spec import TrainSpec

    launch = LaunchConfig(num_workers=workers, backend="torch", threads_per_worker=threads_per_worker or None)
    launch.validate()  # no DataFrame: the data section does not apply
    spec = TrainSpec(run_id=new_run_id(), data=DataConfig(), train=TrainConfig(), launch=launch,
                     tracking=TrackingConfig(progress=False), layout=None,
                     # the trial travels as bytes, unpickled in the rank's own try (model_step): a model the
                     # executors cannot unpickle leaves the probe's figures, and the run, as they were
                     train_fn=functools.partial(probe, trial=(trial.key, cloudpickle.dumps(trial)), cluster=cluster)
                     if trial is not None else probe)
    # No MLflow run: a calibration is not a training run; the driver channel still reports errors.
    result, _ = tracked_submit(spark, spark.range(0, workers, 1, workers), spec)
    return result


def probe(ctx: Any, trial: Any = None, cluster: bool = True) -> dict[str, Any]:
    """Runs on every rank. Returns (on every rank) per-rank lists "flops", "flops_best" and "threads",
    rank-pair tables "latency", "latency_best", "bandwidth", "bandwidth_best" ([i][j], seconds and
    bytes/s), the ring parameters "collective_latency", "collective_bandwidth" and their "_best"
    counterparts, and "executors" (each rank's executor address). With a `trial` ((key, pickled
    planner/step_trial.StepTrial)), also each rank's timed model step: "step", "step_best" (seconds;
    0 where the step failed), "step_rse", "step_repeats", "step_key" and "step_error", and where the
    trial carries IST's layout "ist_step" and "ist_sync" (driver/probe_ist.py, slowest rank's); with
    `cluster=False`, only those and "executors"."""
    if not cluster:
        gathered = ctx.comm.allgather_object(_timed_model(ctx, trial))
        return {**_step_lists(gathered, trial), "executors": list(ctx.world.executors)}
    import torch

    began = time.perf_counter()
    rates = matmul_rates()  # with the threads the worker set for this rank, as training runs
    small, sizing = torch.zeros(2), torch.zeros(SIZING_BYTES // 4)  # 8 bytes, 256 KiB
    links = _links(ctx, small, sizing)
    collective = _collective(ctx, small, sizing)
    rates += matmul_rates()  # again after the messages: a burst of load shows as spread, not as speed
    rates = settle(rates, lambda: matmul_rates(repeats=3), MAX_COMPUTE_REPEATS, COMPUTE_BUDGET_S)
    mine = {"flops": statistics.median(rates), "flops_best": max(rates), "threads": torch.get_num_threads(),
            "flops_rse": median_rse(rates), "flops_repeats": len(rates), **links, **_timed_model(ctx, trial)}
    mine["task_s"] = time.perf_counter() - began
    gathered = ctx.comm.allgather_object(mine)
    world = ctx.world_size
    # Only rank i fills the entries of pair (i, j); the others hold 0 / inf there.
    result: dict[str, Any] = {key: [g[key] for g in gathered]
                              for key in ("flops", "flops_best", "threads", "flops_rse", "flops_repeats")}
    result["bandwidth_rse"] = max((g["bandwidth_rse"] for g in gathered), default=0.0)
    result["task_s"] = max(g["task_s"] for g in gathered)  # measuring, on the slowest rank
    result["bandwidth_rounds"] = max((g["bandwidth_rounds"] for g in gathered), default=0)
    for key in ("latency", "latency_best"):
        result[key] = [[max(g[key][i][j] for g in gathered) for j in range(world)] for i in range(world)]
    for key in ("bandwidth", "bandwidth_best"):
        result[key] = [[min(g[key][i][j] for g in gathered) for j in range(world)] for i in range(world)]
    result.update(collective)
    result.update(_step_lists(gathered, trial))
    result["executors"] = list(ctx.world.executors)
    return result


def model_step(packed: tuple[str, bytes] | None) -> dict[str, Any]:
    """This rank's timed training steps of the pickled trial (planner/step_trial.py) with the threads
    it trains with: after a warm-up, repeated until their median is settled (SETTLED_RSE),
    STEP_BUDGET_S ran out or MAX_STEP_REPEATS; a step longer than the budget is timed once. A trial
    that cannot be unpickled or raises reports 0 (the planner keeps the driver's profile): a trial
    is an improvement, not a new way to fail."""
    if packed is None:
        return {}
    import pickle

    from sparkdl.planner.step_trial import MAX_STEP_REPEATS, STEP_BUDGET_S, step_timer

    try:
        trial = pickle.loads(packed[1])
        one = step_timer(trial.model, trial.train, trial.inputs, trial.target)
        if one() > STEP_BUDGET_S:  # the warm-up: a long step is timed once more, not repeated
            times = [one()]
        else:
            times = settle([one(), one(), one()], lambda: [one()], MAX_STEP_REPEATS, STEP_BUDGET_S)
    except Exception as exc:  # noqa: BLE001 - whatever the user's model raises off the driver
        return {"step": 0.0, "step_best": 0.0, "step_rse": 0.0, "step_repeats": 0,
                "step_error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
    return {"step": statistics.median(times), "step_best": min(times), "step_rse": median_rse(times),
            "step_repeats": len(times)}


def _timed_model(ctx: Any, packed: tuple[str, bytes] | None) -> dict[str, Any]:
    """This rank's model step (`model_step`) and, where the trial carries IST's layout, its IST round
    (driver/probe_ist.py: every rank takes part)."""
    from sparkdl.driver.probe_ist import ist_round

    step = model_step(packed)
    return {**step, **ist_round(ctx, packed, float(step.get("step", 0.0)))} if packed is not None else step


def _step_lists(gathered: list[dict[str, Any]], packed: tuple[str, bytes] | None) -> dict[str, Any]:
    """The ranks' model-step figures as per-rank lists (none without a trial); an IST round's as the
    slowest rank's (its sync holds every rank to it)."""
    if packed is None:
        return {}
    lists = {"step": [g["step"] for g in gathered], "step_best": [g["step_best"] for g in gathered],
             "step_rse": max(g["step_rse"] for g in gathered), "step_repeats": max(g["step_repeats"] for g in gathered),
             "step_key": packed[0], "step_error": next((g["step_error"] for g in gathered if "step_error" in g), "")}
    if all("ist_step" in g for g in gathered):
        lists.update(ist_step=max(g["ist_step"] for g in gathered), ist_sync=max(g["ist_sync"] for g in gathered),
                     ist_every=gathered[0]["ist_every"])
    return lists


def message_bytes(sample_bytes: int, sample_s: float, latency_s: float = 0.0) -> int:
    """Bytes of the measured message: what a transfer of `sample_bytes` in `sample_s` says moves in
    TRANSFER_S, within [MIN_MESSAGE_BYTES, MAX_MESSAGE_BYTES], a whole number of float32 values."""
    rate = sample_bytes / max(sample_s - latency_s, 1e-9)
    wanted = int(min(max(rate * TRANSFER_S, MIN_MESSAGE_BYTES), MAX_MESSAGE_BYTES))
    return wanted - wanted % 4


def median_rse(samples: list[float]) -> float:
    """Relative standard error of the median of `samples` (1.2533 sigma / sqrt(n), over the median):
    how well the repeats pin the figure down. 0 for fewer than 2 samples or a zero median."""
    if len(samples) < 2:
        return 0.0
    middle = statistics.median(samples)
    return 1.2533 * statistics.stdev(samples) / (len(samples) ** 0.5 * abs(middle)) if middle else 0.0


def settle(samples: list[float], more: Callable[[], list[float]], cap: int, budget_s: float,
           tolerance: float = SETTLED_RSE) -> list[float]:
    """`samples` and further batches of `more()` until their median's relative standard error is
    within `tolerance`, there are `cap` samples, or `budget_s` seconds went by."""
    started = time.perf_counter()
    samples = list(samples)
    while median_rse(samples) > tolerance and len(samples) < cap and time.perf_counter() - started < budget_s:
        samples += more()
    return samples


def _links(ctx: Any, small: Any, sizing: Any) -> dict[str, Any]:
    """Ping-pong every pair (i < j): one-way latency of 8 bytes, bandwidth of a message sized from a
    first ping-pong of `sizing`, beyond the latency, its round trips repeated until settled. Also
    this rank's worst bandwidth confidence ("bandwidth_rse") and most round trips of a pair."""
    import torch

    world, rank = ctx.world_size, ctx.rank
    tables: dict[str, Any] = {key: [[0.0 if key.startswith("latency") else float("inf")] * world for _ in range(world)]
                              for key in ("latency", "latency_best", "bandwidth", "bandwidth_best")}
    tables["bandwidth_rse"], tables["bandwidth_rounds"] = 0.0, 0
    for i in range(world):
        for j in range(i + 1, world):
            ctx.comm.barrier()
            small_times = _ping_pong(ctx, small, PING_ROUNDS, i, j)
            sized = torch.zeros(1, dtype=torch.int64)
            if rank == i:
                sample = min(_ping_pong(ctx, sizing, 1, i, j))
                sized[0] = message_bytes(sizing.numel() * 4, sample, statistics.median(small_times))
                ctx.comm.send(sized, j, 33).wait()  # both ends of the pair must send the same bytes
            elif rank == j:
                _ping_pong(ctx, sizing, 1, i, j)
                ctx.comm.recv(sized, i, 33)
            large = torch.zeros(max(int(sized[0]) // 4, 1))
            large_times = _settled_ping_pong(ctx, large, i, j)
            if rank != i:
                continue
            tables["bandwidth_rse"] = max(tables["bandwidth_rse"], median_rse(large_times))
            tables["bandwidth_rounds"] = max(tables["bandwidth_rounds"], len(large_times))
            nbytes = large.numel() * large.element_size()
            typical, best = link_figures(small_times, large_times, nbytes)
            for suffix, (latency, bandwidth) in (("", typical), ("_best", best)):
                tables["latency" + suffix][i][j] = tables["latency" + suffix][j][i] = latency
                tables["bandwidth" + suffix][i][j] = tables["bandwidth" + suffix][j][i] = bandwidth
    return tables


def link_figures(small_times: list[float], large_times: list[float],
                  nbytes: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """(latency, bandwidth) typical (medians) and best. The best bandwidth is never below the typical
    one: min(large) - min(small) can be the smaller difference when the small messages were the
    ones a burst of load hit, and an optimistic figure slower than the typical one would be noise."""
    typical_latency, best_latency = statistics.median(small_times), min(small_times)
    typical = nbytes / max(statistics.median(large_times) - typical_latency, 1e-9)
    best = nbytes / max(min(large_times) - best_latency, 1e-9)
    return (typical_latency, typical), (best_latency, max(best, typical))


def _settled_ping_pong(ctx: Any, buffer: Any, i: int, j: int) -> list[float]:
    """BANDWIDTH_ROUNDS round trips of `buffer` between ranks i and j, then more one at a time while
    rank i finds their median unsettled (it tells j each time: both ends run the same round trips)."""
    import torch

    if ctx.rank not in (i, j):
        return []
    times = _ping_pong(ctx, buffer, BANDWIDTH_ROUNDS, i, j)
    started, again = time.perf_counter(), torch.zeros(1, dtype=torch.int64)
    while True:
        if ctx.rank == i:
            again[0] = int(median_rse(times) > SETTLED_RSE and len(times) < MAX_BANDWIDTH_ROUNDS
                           and time.perf_counter() - started < LINK_BUDGET_S)
            ctx.comm.send(again, j, 34).wait()
        else:
            ctx.comm.recv(again, i, 34)
        if not int(again[0]):
            return times
        times += _ping_pong(ctx, buffer, 1, i, j)


def _ping_pong(ctx: Any, buffer: Any, rounds: int, i: int, j: int) -> list[float]:
    """One-way times of `rounds` round trips between ranks i and j (other ranks return zeros)."""
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        if ctx.rank == i:
            ctx.comm.send(buffer, j, 31).wait()
            ctx.comm.recv(buffer, j, 32)
        elif ctx.rank == j:
            ctx.comm.recv(buffer, i, 31)
            ctx.comm.send(buffer, i, 32).wait()
        times.append((time.perf_counter() - started) / 2)
    return times


def _collective(ctx: Any, small: Any, sizing: Any) -> dict[str, float]:
    """Ring parameters that reproduce the measured allreduce of 8 bytes and of a message sized from a
    first allreduce of `sizing`: T(n) = 2(W-1) a + 2(W-1)/W n / b, from rank 0's median times and
    from its best ones (after a barrier, so all ranks start together). Every rank returns rank 0's
    figures."""
    import torch

    world = ctx.world_size
    if world < 2:
        return {"collective_latency": 0.0, "collective_bandwidth": 0.0,
                "collective_latency_best": 0.0, "collective_bandwidth_best": 0.0}
    ctx.comm.barrier()
    ctx.comm.allreduce(sizing.clone(), op="sum")  # warm-up (connections, buffers)
    started = time.perf_counter()
    ctx.comm.allreduce(sizing.clone(), op="sum")
    # Every rank sizes from the slowest rank's time, so all of them allreduce the same bytes.
    slowest = ctx.comm.allreduce(torch.tensor([time.perf_counter() - started], dtype=torch.float64), op="max")
    large = torch.zeros(message_bytes(sizing.numel() * 4, float(slowest[0])) // 4)
    samples = []
    for buffer, rounds in zip((small, large), ALLREDUCE_ROUNDS):
        ctx.comm.barrier()
        ctx.comm.allreduce(buffer.clone(), op="sum")  # warm-up
        times = []
        for _ in range(rounds):
            work = buffer.clone()
            started = time.perf_counter()
            ctx.comm.allreduce(work, op="avg")
            times.append(time.perf_counter() - started)
        samples.append(times)
    hops = 2 * (world - 1)
    nbytes = large.numel() * large.element_size()
    decided: dict[str, float] = {}
    for suffix, pick in (("", statistics.median), ("_best", min)):
        small_s, large_s = pick(samples[0]), pick(samples[1])
        decided["collective_latency" + suffix] = small_s / hops
        decided["collective_bandwidth" + suffix] = hops / world * nbytes / max(large_s - small_s, 1e-9)
    # as for links: the optimistic ring bandwidth is never below the typical one
    decided["collective_bandwidth_best"] = max(decided["collective_bandwidth_best"], decided["collective_bandwidth"])
    return ctx.comm.allgather_object(decided)[0]
