"""sparkdl.compat.horovod.run: horovod.spark.run's signature and result, on sparkdl.

`run(fn, args=(), kwargs={}, num_proc=None, ...)` runs fn(*args, **kwargs) on num_proc barrier tasks
(default: every task slot Spark has), each in a fresh process where hvd.init() finds Horovod's gloo
rendezvous, and returns every rank's value in rank order. MPI is not offered (gloo only).
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Mapping

from sparkdl.compat.horovod_runner import horovod_call
from sparkdl.compat.launcher import compat_options, run_on_cluster
from sparkdl.errors import ConfigError


def run(fn: Callable[..., Any], args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None,
        num_proc: int | None = None, start_timeout: float | None = None, use_mpi: bool | None = None,
        use_gloo: bool | None = None, extra_mpi_args: str | None = None, env: Mapping[str, str] | None = None,
        stdout: Any = None, stderr: Any = None, verbose: int = 1, nics: Any = None,
        prefix_output_with_timestamp: bool = False, executable: str | None = None, **sparkdl_options: Any) -> list[Any]:
    """horovod.spark.run on sparkdl: one value per rank, in rank order. `start_timeout` waits that
    long for the task slots (launch.slot_wait_s); `env` adds variables to every rank; every rank's
    output reaches the driver's log. Not carried over: MPI (`use_mpi`, `extra_mpi_args`), `nics`,
    `executable`, `stdout`/`stderr` streams (the driver's own streams get the lines)."""
    from sparkdl.compat.torch_distributor import active_session
    from sparkdl.spark.session import facts

    if use_mpi:
        raise ConfigError("sparkdl.compat.horovod.run runs Horovod over gloo only; use_mpi=True is not offered",
                          hint="drop use_mpi (gloo is what horovod.spark.run picks without MPI)")
    if use_gloo is False:
        raise ConfigError("sparkdl.compat.horovod.run runs Horovod over gloo: use_gloo=False leaves nothing to run on",
                          hint="drop use_gloo")
    if not callable(fn):
        raise ConfigError(f"horovod.run: fn must be a function, got {type(fn).__name__}")
    spark = active_session()
    if num_proc is None:
        num_proc = facts(spark).slots(None, 0)
        print(f"sparkdl: horovod.run on num_proc={num_proc} (the task slots Spark has)", file=sys.stderr)
    if not isinstance(num_proc, int) or isinstance(num_proc, bool) or num_proc < 1:
        raise ConfigError(f"horovod.run: num_proc must be a positive integer, got {num_proc!r}")
    options = dict(sparkdl_options)
    if start_timeout is not None:
        options.setdefault("slot_wait_s", float(start_timeout))
    compat = compat_options("horovod.spark.run", num_proc, {**options, "backend": "horovod"})
    call = horovod_call("horovod.spark.run", fn, tuple(args), dict(kwargs or {}), results="all",
                        env={str(k): str(v) for k, v in (env or {}).items()}, spark=spark)
    return run_on_cluster(spark, call, num_proc, compat, {"compat.num_proc": num_proc, "compat.backend": "horovod"})
