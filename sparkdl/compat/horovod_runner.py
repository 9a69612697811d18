"""sparkdl.HorovodRunner: Databricks' sparkdl.HorovodRunner (Databricks Runtime ML up to 15.4 LTS) on sparkdl.

`HorovodRunner(np=2).run(main, **kwargs)`: np > 0 runs `main(**kwargs)` on np barrier tasks, np < 0 on
-np processes of the driver; each process calls hvd.init() itself (gloo; Horovod's rendezvous is
started for it) and rank 0's return value comes back.
"""
from __future__ import annotations

from typing import Any, Callable

from sparkdl.compat.launcher import compat_options, pickled_call, run_on_cluster, run_on_driver
from sparkdl.errors import CompatValueError, ConfigError
from sparkdl.wire.child import ChildCall

VERBOSITY = ("all", "log_callback_only")


class HorovodRunner:
    name = "HorovodRunner"

    def __init__(self, np: int, driver_log_verbosity: str = "all", **sparkdl_options: Any) -> None:
        if not isinstance(np, int) or isinstance(np, bool) or np == 0:
            raise CompatValueError(f"HorovodRunner: np must be a non-zero integer, got {np!r}",
                              hint="np=2 runs 2 processes on the cluster's tasks; np=-2 runs 2 on the driver")
        if driver_log_verbosity not in VERBOSITY:
            raise ConfigError(f"HorovodRunner: driver_log_verbosity must be 'all' or 'log_callback_only', got "
                              f"{driver_log_verbosity!r}")
        self.num_processor = abs(np)
        self.np, self.local = np, np < 0
        output = "all" if driver_log_verbosity == "all" else "rank0"
        self._options = compat_options(self.name, self.num_processor,
                                       {"rank_output": output, **sparkdl_options, "backend": "horovod"})
        if not self.local:
            from sparkdl.compat.torch_distributor import active_session

            self.spark = active_session()

    def run(self, main: Callable[..., Any], **kwargs: Any) -> Any:
        """`main(**kwargs)` on every process; rank 0's return value."""
        if not callable(main):
            raise ConfigError(f"HorovodRunner.run: main must be a function, got {type(main).__name__}")
        call = horovod_call(self.name, main, (), kwargs, results="rank0",
                            spark=None if self.local else self.spark)  # local mode: the driver's own children
        params = {"compat.np": self.np, "compat.backend": "horovod"}
        if self.local:
            return run_on_driver(call, self.num_processor, self._options, params)
        return run_on_cluster(self.spark, call, self.num_processor, self._options, params)


def horovod_call(peer: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                 results: str, env: dict[str, str] | None = None, spark: Any = None) -> ChildCall:
    """A ChildCall on the Horovod framework, after checking Horovod imports here (the ranks need it too)."""
    import importlib.util

    if importlib.util.find_spec("horovod") is None:
        from sparkdl.comm.horovod import INSTALL_HINT

        raise ConfigError(f"{peer} needs Horovod, which is not installed here", hint=f"install it with: {INSTALL_HINT}")
    function = pickled_call(fn, args, kwargs, "the function or its arguments", spark=spark)
    return ChildCall(framework="horovod", function=function, use_gpu=True, results=results, name=peer,
                     env=tuple((str(k), str(v)) for k, v in (env or {}).items()))
