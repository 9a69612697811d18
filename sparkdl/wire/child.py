"""ChildCall: what a compat rank runs in a fresh child process (sparkdl.compat), carried in the TrainSpec.

A function written for TorchDistributor, HorovodRunner or horovod.spark.run builds its own process
group, so it runs in a child interpreter of the rank's task with the torchrun (or Horovod) variables
set and no process group yet. Standard library only: the driver, the task and the child import it.
"""
from __future__ import annotations

from dataclasses import dataclass

RESULT_TENSOR = "result"  # a large return value's name in the tensor file it travels as (executor/child_rank.py)
FRAMEWORKS = ("torch", "horovod")  # which rank variables the child gets: torchrun's, or Horovod's too


@dataclass(frozen=True)
class ChildCall:
    """A pickled function call, or a script with its arguments, for every rank's child process."""

    framework: str = "torch"
    function: bytes = b""  # cloudpickle of (fn, args, kwargs); empty for a script
    script: str = ""  # a Python file run as `python script *script_args` (TorchDistributor.run("f.py", ...))
    script_args: tuple[str, ...] = ()
    use_gpu: bool = False  # False: CUDA_VISIBLE_DEVICES="" in the child, as TorchDistributor(use_gpu=False) does
    # The DataFrame's schema (Spark's JSON): each rank's partition is written as PySpark's TorchDistributor
    # writes it (an Arrow stream file and the schema file, named by SPARK_PARTITION_ARROW_DATA_FILE /
    # SPARK_DATAFRAME_SCHEMA_FILE), so pyspark's _get_spark_partition_data_loader works in the function.
    partition_schema: str = ""
    processes_per_task: int = 1  # children per Spark task (a torchrun node): the task's GPUs with use_gpu
    env: tuple[tuple[str, str], ...] = ()  # extra variables for every rank (horovod.spark.run's env=)
    rank0_env: tuple[tuple[str, str], ...] = ()  # extra variables for rank 0 only (its MLflow run)
    results: str = "rank0"  # "rank0": rank 0's return value; "all": one value per rank (horovod.spark.run)
    name: str = "TorchDistributor"  # the peer API that launched it, for messages and MLflow

    def __post_init__(self) -> None:
        if self.framework not in FRAMEWORKS:
            raise ValueError(f"framework must be one of {FRAMEWORKS}, got {self.framework!r}")
        if bool(self.function) == bool(self.script):
            raise ValueError("a ChildCall runs either a pickled function or a script")
        if self.processes_per_task < 1 or (self.framework == "horovod" and self.processes_per_task != 1):
            raise ValueError("processes_per_task must be >= 1 (1 under Horovod)")
        if self.results not in ("rank0", "all"):
            raise ValueError(f"results must be 'rank0' or 'all', got {self.results!r}")


def torchrun_variables(rank: int, world_size: int, local_rank: int, local_world_size: int, group_rank: int,
                       group_world_size: int, master_addr: str, master_port: int, run_id: str) -> dict[str, str]:
    """What `torchrun` sets for a worker (torch.distributed.run), so that init_process_group("env://"),
    Lightning (its TorchElasticEnvironment) and accelerate find their rank as under torchrun. A
    "group" is torchrun's node: one Spark task (TorchDistributor runs one torchrun node per task), or
    the driver in local mode."""
    values = {"RANK": rank, "WORLD_SIZE": world_size, "LOCAL_RANK": local_rank, "LOCAL_WORLD_SIZE": local_world_size,
              "GROUP_RANK": group_rank, "GROUP_WORLD_SIZE": group_world_size, "NODE_RANK": group_rank,
              "ROLE_RANK": rank, "ROLE_WORLD_SIZE": world_size, "ROLE_NAME": "default",
              "MASTER_ADDR": master_addr, "MASTER_PORT": master_port, "TORCHELASTIC_RUN_ID": run_id,
              "TORCHELASTIC_RESTART_COUNT": 0, "TORCHELASTIC_MAX_RESTARTS": 0}
    if local_world_size > 1:
        values["OMP_NUM_THREADS"] = 1  # torchrun's default for several processes per node (a set value wins)
    return {k: str(v) for k, v in values.items()}
