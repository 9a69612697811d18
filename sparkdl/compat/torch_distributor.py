"""sparkdl.compat.TorchDistributor: PySpark's TorchDistributor (pyspark.ml.torch.distributor), run by sparkdl.

The same constructor and methods, the same rank environment (torchrun's variables, one torchrun node
per Spark task, CUDA_VISIBLE_DEVICES from the task's GPUs), the same partition files for
`_train_on_dataframe`; in addition every rank's output reaches the driver, a failure raises the
rank's own exception type, message and traceback, the run is tracked in MLflow, and sparkdl's launch
options apply (keyword arguments: timeout_s, slot_wait_s, tracking, experiment, ...).
"""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Callable

from sparkdl.compat.launcher import compat_options, pickled_call, run_on_cluster, run_on_driver
from sparkdl.errors import CompatRuntimeError, CompatValueError, ConfigError
from sparkdl.wire.child import ChildCall

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

TORCH_SSL_CONF = "pytorch.spark.distributor.ignoreSsl"


def active_session() -> SparkSession:
    from pyspark.sql import SparkSession

    try:
        return SparkSession.active()  # the thread's active session, else the default one (as PySpark's own)
    except Exception:  # noqa: BLE001 - pyspark raises its own error type (or an AssertionError) when none exists
        raise ConfigError("TorchDistributor needs an active SparkSession, and there is none",
                          hint="create one first: SparkSession.builder.getOrCreate()") from None


class TorchDistributor:
    """Runs a training function or script on `num_processes` processes: Spark barrier tasks
    (local_mode=False) or child processes of the driver (local_mode=True, the default, as in PySpark)."""

    name = "TorchDistributor"

    def __init__(self, num_processes: int = 1, local_mode: bool = True, use_gpu: bool = True,
                 _ssl_conf: str = TORCH_SSL_CONF, **sparkdl_options: Any) -> None:
        if not isinstance(num_processes, int) or isinstance(num_processes, bool) or num_processes <= 0:
            raise CompatValueError(f"{self.name}: num_processes must be a positive integer, got {num_processes!r}",
                              hint="the number of training processes, e.g. num_processes=2")
        self.spark = active_session()
        self.num_processes, self.local_mode, self.use_gpu, self.ssl_conf = num_processes, local_mode, use_gpu, _ssl_conf
        from sparkdl.spark.session import facts

        self._facts = facts(self.spark)
        self.processes_per_task = self._processes_per_task()
        self.num_tasks = num_processes // self.processes_per_task if not local_mode else 1
        self._options = compat_options(self.name, self.num_tasks, sparkdl_options)

    def _processes_per_task(self) -> int:
        """PySpark's rule: with use_gpu, a task runs one process per GPU it holds."""
        if not self.use_gpu:
            return 1 if not self.local_mode else self.num_processes
        conf = self._facts.conf
        if self.local_mode:
            gpus = int(float(conf("spark.driver.resource.gpu.amount", "0") or 0))
            if gpus < 1:
                raise CompatRuntimeError(f"{self.name}(use_gpu=True, local_mode=True) needs GPUs on the driver, but "
                                  "GPU resources were not configured properly on the driver "
                                  "(spark.driver.resource.gpu.amount is not set)",
                                  hint="TorchDistributor(..., use_gpu=False) trains on CPUs; or start Spark with "
                                       "spark.driver.resource.gpu.amount and a discovery script")
            self.num_processes = min(self.num_processes, gpus)
            return self.num_processes
        per_task = int(float(conf("spark.task.resource.gpu.amount", "0") or 0))
        if per_task < 1:
            raise CompatRuntimeError(f"{self.name}(use_gpu=True) needs GPUs in every task, but "
                              "'spark.task.resource.gpu.amount' was unset, so gpu usage is unavailable",
                              hint="TorchDistributor(..., use_gpu=False) trains on CPUs; or give tasks "
                                                 "GPUs (spark.task.resource.gpu.amount=1, conf/spark/gpu-cluster.conf)")
        if self.num_processes % per_task:
            raise CompatRuntimeError(f"{self.name} 'num_processes' value ({self.num_processes}) must be a multiple of "
                              f"'spark.task.resource.gpu.amount' ({per_task}) value",
                              hint=f"num_processes={self.num_processes - self.num_processes % per_task or per_task}")
        return per_task

    # -- the peer's methods --------------------------------------------------------------------
    def run(self, train_object: Callable[..., Any] | str, *args: Any, **kwargs: Any) -> Any:
        """`train_object(*args, **kwargs)` on every process, returning rank 0's value; or a Python
        file run as `python train_object *args` (arguments as strings, for argparse), returning None."""
        return self._launch(self._call(train_object, args, kwargs))

    def _train_on_dataframe(self, train_function: Callable[..., Any], spark_dataframe: DataFrame,
                            *args: Any, **kwargs: Any) -> Any:
        """As PySpark: rank r gets partition r of `spark_dataframe` (pyspark's
        _get_spark_partition_data_loader, or sparkdl.compat.partition_batches, inside the function)."""
        if self.local_mode:
            raise CompatValueError(f"{self.name}._train_on_dataframe needs local_mode=False: it feeds each Spark "
                              "task its partition", hint=f"{self.name}(num_processes=..., local_mode=False)")
        if not callable(train_function):
            raise ConfigError(f"{self.name}._train_on_dataframe: train_function must be callable, got "
                              f"{type(train_function).__name__}")
        partitions = self._facts.num_partitions(spark_dataframe)
        if partitions is not None and partitions != self.num_tasks:
            raise CompatValueError(f"{self.name}._train_on_dataframe feeds task r the DataFrame's partition r, but the "
                              f"DataFrame has {partitions} partitions for {self.num_tasks} tasks",
                              hint=f"spark_dataframe.repartition({self.num_tasks}) first, or "
                                   f"num_processes={partitions * self.processes_per_task}")
        schema = json.dumps(spark_dataframe.schema.jsonValue())
        call = self._call(train_function, args, kwargs, partition_schema=schema)
        return self._launch(call, spark_dataframe)

    # -- sparkdl's side ------------------------------------------------------------------------
    def _call(self, train_object: Callable[..., Any] | str, args: tuple[Any, ...], kwargs: dict[str, Any],
              **extra: Any) -> ChildCall:
        per_task = 1 if self.local_mode else self.processes_per_task
        if isinstance(train_object, str):
            if kwargs:
                raise ConfigError(f"{self.name}.run('{train_object}', ...): a file takes command-line arguments "
                                  f"only, not keyword arguments ({', '.join(kwargs)})",
                                  hint=f"pass them as strings: run('{train_object}', '--lr=0.01')")
            if self.local_mode and not os.path.isfile(train_object):
                raise ConfigError(f"{self.name}.run: no such file {train_object!r}",
                                  hint="give the path of a Python script the driver can read")
            return ChildCall(script=os.path.abspath(train_object) if self.local_mode else train_object,
                             script_args=tuple(str(a) for a in args), use_gpu=self.use_gpu,
                             processes_per_task=per_task, name=self.name, **extra)
        if not callable(train_object):
            raise ConfigError(f"{self.name}.run: train_object must be a function or a script path, got "
                              f"{type(train_object).__name__}")
        function = pickled_call(train_object, args, kwargs, "the training function or its arguments",
                                None if self.local_mode else self.spark)
        return ChildCall(function=function, use_gpu=self.use_gpu, processes_per_task=per_task, name=self.name, **extra)

    def _launch(self, call: ChildCall, df: DataFrame | None = None) -> Any:
        params = {"compat.num_processes": self.num_processes, "compat.local_mode": self.local_mode,
                  "compat.use_gpu": self.use_gpu, "compat.kind": "script" if call.script else "function"}
        if self.local_mode:
            return run_on_driver(call, self.num_processes, self._options, params)
        return run_on_cluster(self.spark, call, self.num_tasks, self._options, params, df)


class DeepspeedTorchDistributor(TorchDistributor):
    """PySpark's DeepspeedTorchDistributor (pyspark.ml.deepspeed): a TorchDistributor whose scripts get
    `--deepspeed --deepspeed_config <file>` as PySpark's launcher passes them; DeepSpeed itself must be
    installed where the ranks run."""

    name = "DeepspeedTorchDistributor"

    def __init__(self, numGpus: int = 1, nnodes: int = 1, localMode: bool = True, useGpu: bool = True,
                 deepspeedConfig: str | dict[str, Any] | None = None, **sparkdl_options: Any) -> None:
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            raise ConfigError("DeepspeedTorchDistributor needs the 'deepspeed' package, which is not installed here",
                              hint="pip install deepspeed (on the driver and every executor), or use "
                                   "sparkdl.compat.TorchDistributor for plain torch.distributed / DDP code")
        self.deepspeed_config = deepspeedConfig
        super().__init__(num_processes=numGpus * nnodes, local_mode=localMode, use_gpu=useGpu, **sparkdl_options)

    def _call(self, train_object: Callable[..., Any] | str, args: tuple[Any, ...], kwargs: dict[str, Any],
              **extra: Any) -> ChildCall:
        if isinstance(train_object, str) and self.deepspeed_config is not None:
            path = self.deepspeed_config
            if isinstance(path, dict):
                import tempfile

                with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                    json.dump(path, f)
                path = f.name
            args = ("--deepspeed", "--deepspeed_config", str(path), *args)
        return super()._call(train_object, args, kwargs, **extra)
