"""Threads of a rank as Spark allots them, on the session's local-cluster[2,2,1024] (spark.task.cpus=1):
a fit's history and its MLflow run say each of two ranks on this one host ran 1 torch thread (two
2-core executors share the machine's cores), the calibration probe's ranks (what strategy="auto"
profiles compute with) ran the same, a lone rank gets its executor's cores, and
launch.threads_per_worker overrides it."""
from __future__ import annotations

import os

from typing import Any

from torch import nn

from sparkdl import TorchEstimator

PIXELS = [f"p{i}" for i in range(64)]


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))


def every_ranks_threads(ctx: Any) -> list[int]:
    import torch

    return [int(t) for t in ctx.comm.allgather_object(torch.get_num_threads())]


def test_a_fit_records_the_threads_spark_gave_each_rank(spark, digits_df, mlflow_server) -> None:  # type: ignore[no-untyped-def]
    from mlflow.tracking import MlflowClient

    from sparkdl.driver.probe import run_probe

    assert spark.conf.get("spark.task.cpus", "1") == "1"
    model = TorchEstimator(model=mlp, feature_cols=PIXELS, label_col="label", epochs=1, batch_size=64,
                           num_workers=2, strategy="data_parallel", progress=False, tracking_uri=mlflow_server.uri,
                           experiment="sparkdl-threads").fit(digits_df)
    assert model.history[0]["torch_threads_by_rank"] == [1, 1]
    params = MlflowClient(mlflow_server.uri).get_run(model.run_id).data.params
    assert params["world.threads_per_rank"] == "1, 1"
    # The calibration's ranks run under the same rule: the planner profiles with what training runs.
    assert run_probe(spark, 2, None)["threads"] == [1, 1]


def test_threads_per_worker_overrides_the_allotment(spark) -> None:  # type: ignore[no-untyped-def]
    import sparkdl

    assert sparkdl.run(every_ranks_threads, num_workers=2, threads_per_worker=2, progress=False) == [2, 2]
    # A lone rank gets its executor's cores (local-cluster[2,2,1024]: 2), capped by the machine's.
    lone = min(2, len(os.sched_getaffinity(0)))
    assert sparkdl.run(every_ranks_threads, num_workers=1, threads_per_worker="auto", progress=False) == [lone]
