"""sparkdl.compat on a real SparkSession (local-cluster: two executors): code written for PySpark's
TorchDistributor, Databricks' HorovodRunner and horovod.spark.run runs unchanged, each rank in a
fresh child process with the torchrun (Horovod) variables and no process group."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from sparkdl.compat import TorchDistributor
from sparkdl.errors import ConfigError, RankFunctionError

SUPPORT = Path(__file__).resolve().parent.parent / "support"
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def ddp_step(lr: float, seed: int = 0) -> dict:
    """A TorchDistributor-style function: env:// rendezvous, DDP, one optimizer step; rank 0 returns a dict."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    env = {k: os.environ.get(k) for k in TORCHRUN_VARIABLES}
    had_group = dist.is_initialized()
    dist.init_process_group("gloo", init_method="env://")
    torch.manual_seed(seed)
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    x = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4) / 32 + dist.get_rank()
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    print(f"ddp rank {dist.get_rank()} loss {loss.item():.6f}")
    weight = [float(v) for v in model.module.weight.detach().flatten()]
    dist.destroy_process_group()
    return {"env": env, "had_group": had_group, "weight": weight, "pid": os.getpid()}


def expected_weight(lr: float, seed: int = 0) -> list[float]:
    """The same step in one process: DDP averages the two ranks' gradients."""
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 1)
    grads = []
    for rank in range(2):
        model.zero_grad()
        x = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4) / 32 + rank
        model(x).pow(2).mean().backward()
        grads.append(model.weight.grad.clone())
    with torch.no_grad():
        return [float(v) for v in (model.weight - lr * (grads[0] + grads[1]) / 2).flatten()]


@pytest.mark.parametrize("local_mode", [True, False])
def test_a_ddp_function_runs_through_run_with_the_torchrun_variables(spark, local_mode, capfd) -> None:  # type: ignore[no-untyped-def]
    result = TorchDistributor(num_processes=2, local_mode=local_mode, use_gpu=False, tracking=False).run(ddp_step, 0.5)
    assert result["had_group"] is False  # no process group before the function builds its own
    env = result["env"]
    assert env["RANK"] == "0" and env["WORLD_SIZE"] == "2" and env["MASTER_PORT"].isdigit()
    # local mode: one torchrun node of two processes; on the cluster one node per task (as PySpark's)
    assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"]) == (("0", "2", "0") if local_mode else
                                                                                ("0", "1", "0"))
    assert result["pid"] != os.getpid()
    assert result["weight"] == pytest.approx(expected_weight(0.5), abs=1e-6)
    captured = capfd.readouterr()
    err = captured.out + captured.err
    for rank in (0, 1):  # every rank's output reaches the driver, prefixed with its rank
        assert f"[rank {rank}] ddp rank {rank} loss" in err, err[-3000:]


def test_a_script_with_argparse_arguments_runs_on_every_rank(spark, capfd) -> None:  # type: ignore[no-untyped-def]
    script = str(SUPPORT / "compat_script.py")
    assert TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, tracking=False).run(
        script, "--lr=0.25", "--steps", "3") is None
    captured = capfd.readouterr()
    err = captured.out + captured.err
    for rank in (0, 1):
        assert f"[rank {rank}] script rank={rank} world=2 lr=0.25 steps=3 local_rank=0 sum=3" in err, err[-3000:]
    with pytest.raises(ConfigError, match="keyword arguments"):
        TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(script, lr=1)


def fails_on_rank_one() -> None:
    import torch.distributed as dist

    if int(os.environ["RANK"]) == 1:
        raise ValueError("rank one cannot go on")
    dist.init_process_group("gloo")  # rank 0 waits for rank 1 until its task is cancelled
    dist.barrier()


@pytest.mark.parametrize("local_mode", [True, False])
def test_a_failing_function_raises_the_ranks_own_exception_with_its_traceback(spark, local_mode) -> None:  # type: ignore[no-untyped-def]
    distributor = TorchDistributor(num_processes=2, local_mode=local_mode, use_gpu=False, tracking=False,
                                   peer_failure_delay_s=0)
    with pytest.raises(RankFunctionError) as caught:
        distributor.run(fails_on_rank_one)
    error = caught.value
    assert error.rank == 1 and error.exception_type == "ValueError"
    assert error.exception_message == "rank one cannot go on"
    assert "fails_on_rank_one" in error.rank_traceback and 'raise ValueError("rank one cannot go on")' in str(error)


def test_bad_options_are_refused_before_anything_runs(spark) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="num_processes"):  # PySpark's exception types too
        TorchDistributor(num_processes=0)
    # use_gpu=True (PySpark's default) on a CPU cluster: PySpark's own words (its tests match "unset"), and the fix
    with pytest.raises(RuntimeError, match="'spark.task.resource.gpu.amount' was unset(.|\n)*use_gpu=False"):
        TorchDistributor(num_processes=2, local_mode=False)
    with pytest.raises(ConfigError, match="launch and tracking options only"):
        TorchDistributor(num_processes=2, use_gpu=False, epochs=3)
    with pytest.raises(ConfigError, match="local_mode=False"):
        TorchDistributor(num_processes=2, use_gpu=False)._train_on_dataframe(ddp_step, spark.range(4))
    with pytest.raises(ConfigError, match="partitions"):
        TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)._train_on_dataframe(
            ddp_step, spark.range(0, 8, 1, 3))
    with pytest.raises(ConfigError, match="deepspeed"):
        from sparkdl.compat import DeepspeedTorchDistributor

        DeepspeedTorchDistributor(numGpus=2)


def partition_rows(num_samples: int) -> dict:
    """Rows through PySpark's own partition data loader, and through sparkdl's fast path."""
    from pyspark.ml.torch.distributor import _get_spark_partition_data_loader

    loader = _get_spark_partition_data_loader(num_samples, batch_size=4, num_workers=0)
    rows = [[float(v) for v in row] for batch in loader for row in zip(*[c.flatten().tolist() if c.dim() == 1 else
                                                                         c.tolist() for c in batch])]
    out = {"pyspark": rows, "rank": int(os.environ["RANK"])}
    try:
        from sparkdl.compat import partition_batches

        out["sparkdl"] = [[float(v) for v in row] for batch in partition_batches(4, num_samples=num_samples)
                          for row in zip(*[c.tolist() for c in batch])]
    except ImportError:
        pass
    return out


def test_train_on_dataframe_feeds_each_rank_its_partition_as_pysparks_torch_distributor_does(spark) -> None:  # type: ignore[no-untyped-def]
    from pyspark.ml.torch.distributor import TorchDistributor as PySparkTorchDistributor
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # PySpark's own launcher pickles by reference
    df = spark.createDataFrame([(float(i), float(i * i), i % 3) for i in range(22)], ["a", "b", "label"]
                               ).repartition(2).sortWithinPartitions("a").cache()
    per_rank = df.rdd.glom().map(len).collect()
    num_samples = max(per_rank) + 3  # past the end: the loader wraps round to the first row
    ours = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, tracking=False)._train_on_dataframe(
        partition_rows, df, num_samples)
    theirs = PySparkTorchDistributor(num_processes=2, local_mode=False, use_gpu=False)._train_on_dataframe(
        partition_rows, df, num_samples)
    assert ours["rank"] == 0 and len(ours["pyspark"]) == num_samples
    assert ours["pyspark"] == theirs["pyspark"]  # same rows, same order, same wrap-around
    assert ours["sparkdl"] == ours["pyspark"]  # the fast path gives the very same rows
    first = df.rdd.glom().collect()[0]
    assert ours["pyspark"][:len(first)] == [[r.a, r.b, float(r.label)] for r in first]


def test_the_same_ddp_function_ends_with_the_same_weights_as_under_pysparks_torch_distributor(spark) -> None:  # type: ignore[no-untyped-def]
    from pyspark.ml.torch.distributor import TorchDistributor as PySparkTorchDistributor
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ours = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, tracking=False).run(ddp_step, 0.3, seed=5)
    theirs = PySparkTorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(ddp_step, 0.3, seed=5)
    assert ours["weight"] == theirs["weight"]


def logs_to_mlflow() -> str:
    import mlflow
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        mlflow.log_metric("compat_loss", 0.25)
    dist.destroy_process_group()
    return "done"


def test_a_compat_run_is_tracked_and_rank_zeros_mlflow_calls_land_in_its_run(spark, mlflow_server) -> None:  # type: ignore[no-untyped-def]
    from mlflow.tracking import MlflowClient

    assert TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, tracking_uri=mlflow_server.uri,
                            experiment="sparkdl-compat").run(logs_to_mlflow) == "done"
    client = MlflowClient(mlflow_server.uri)
    (run,) = client.search_runs([client.get_experiment_by_name("sparkdl-compat").experiment_id])
    assert run.data.params["compat.distributor"] == "TorchDistributor"
    assert run.data.params["compat.num_processes"] == "2" and run.data.params["compat.use_gpu"] == "False"
    assert run.data.metrics["compat_loss"] == 0.25 and run.info.status == "FINISHED"


def lightning_fit() -> dict:
    import lightning as L
    import torch

    class Regressor(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(3, 1)

        def training_step(self, batch, _):  # type: ignore[no-untyped-def]
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    x = torch.randn(64, 3)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    trainer = L.Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy="ddp", max_epochs=2,
                        enable_progress_bar=False, enable_model_summary=False, logger=False,
                        enable_checkpointing=False)
    model = Regressor()
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
    return {"world": trainer.world_size, "rank": trainer.global_rank, "env": type(trainer.strategy.cluster_environment).__name__,
            "weight": [float(v) for v in model.layer.weight.detach().flatten()]}


def test_a_lightning_trainer_with_ddp_trains_inside_the_torch_distributor_layer(spark) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("lightning")
    result = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, tracking=False).run(lightning_fit)
    assert result["world"] == 2 and result["rank"] == 0
    assert result["env"] == "TorchElasticEnvironment"  # Lightning found torchrun's variables
    assert len(result["weight"]) == 3


def horovod_main(scale: float = 1.0) -> tuple:
    import horovod.torch as hvd
    import torch

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)
    out = (hvd.rank(), hvd.size(), float(total.item()) * scale)
    hvd.shutdown()
    return out


@pytest.mark.horovod
@pytest.mark.parametrize("np_", [2, -2])
def test_horovod_runner_runs_main_on_the_cluster_and_on_the_driver(spark, np_) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("horovod.torch")
    import sparkdl

    assert sparkdl.HorovodRunner(np=np_, tracking=False).run(horovod_main, scale=2.0) == (0, 2, 6.0)


@pytest.mark.horovod
def test_horovod_spark_run_returns_every_ranks_value(spark) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("horovod.torch")
    from sparkdl.compat import horovod

    assert horovod.run(horovod_main, args=(0.5,), num_proc=2, tracking=False) == [(0, 2, 1.5), (1, 2, 1.5)]


def returns_a_large_value(megabytes: int) -> dict:
    import numpy as np

    rank = int(os.environ["RANK"])
    return {"rank": rank, "data": np.arange(megabytes * (1 << 20) // 8, dtype=np.int64) + rank}


def test_a_large_return_value_travels_outside_the_result_rows(spark) -> None:  # type: ignore[no-untyped-def]
    from sparkdl.compat import horovod  # noqa: F401 - the import alone must not need Horovod
    from sparkdl.executor.child_rank import LARGE_RESULT_BYTES

    megabytes = LARGE_RESULT_BYTES // (1 << 20) + 8
    # model_transfer="channel": the driver's receiver or an error (no silent fall back to the rows)
    result = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, tracking=False,
                              model_transfer="channel").run(returns_a_large_value, megabytes)
    assert result["rank"] == 0 and result["data"].nbytes == megabytes << 20
    assert int(result["data"][-1]) == (megabytes << 20) // 8 - 1


def prints_its_rank(ctx) -> int:  # type: ignore[no-untyped-def]
    print(f"custom loop on rank {ctx.rank}")
    return ctx.rank


def test_sparkdl_run_shows_every_ranks_output_when_asked_and_rank_zeros_by_default(spark, capfd) -> None:  # type: ignore[no-untyped-def]
    import sparkdl

    assert sparkdl.run(prints_its_rank, num_workers=2, rank_output="all") == 0
    err = capfd.readouterr().err
    assert "[rank 0] custom loop on rank 0" in err and "[rank 1] custom loop on rank 1" in err
    assert sparkdl.run(prints_its_rank, num_workers=2) == 0
    err = capfd.readouterr().err
    assert "[rank 0] custom loop on rank 0" in err and "[rank 1]" not in err
