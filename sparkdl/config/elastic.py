"""The options of spot-safe runs (launch.min_workers, max_workers, grow_workers,
replacement_wait_s; driver/elastic.py) and the rules a run must meet to change its world size."""
from __future__ import annotations

from typing import Any

from sparkdl.errors import ConfigError

# Strategies whose checkpoint carries to another world size (executor/reshape.py): replicated state,
# DiLoCo's global model and outer optimizer, sharded data parallel's shards re-split.
RESHAPEABLE = ("data_parallel", "sharded", "embeddings")


def _whole(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"launch.{name} must be a whole number of workers >= 0 (0: num_workers), got {value!r}")
    return value


def check_worker_range(num_workers: int, min_workers: Any, max_workers: Any, grow_workers: Any,
                       replacement_wait_s: Any) -> None:
    """min_workers <= num_workers <= max_workers (0 means num_workers), a bool grow_workers and a
    positive replacement wait."""
    low, high = _whole("min_workers", min_workers) or num_workers, _whole("max_workers", max_workers) or num_workers
    if low > num_workers:
        raise ConfigError(f"launch.min_workers={low} exceeds launch.num_workers={num_workers}: a run starts with "
                          "num_workers and may shrink down to min_workers",
                          hint=f"set min_workers between 1 and {num_workers}")
    if high < num_workers:
        raise ConfigError(f"launch.max_workers={high} is below launch.num_workers={num_workers}",
                          hint=f"set max_workers >= {num_workers} (or 0: num_workers)")
    if not isinstance(grow_workers, bool):
        raise ConfigError(f"launch.grow_workers must be true or false, got {grow_workers!r}")
    if not isinstance(replacement_wait_s, (int, float)) or isinstance(replacement_wait_s, bool) \
            or not 0 <= replacement_wait_s < float("inf"):
        raise ConfigError(f"launch.replacement_wait_s must be a number of seconds >= 0, got {replacement_wait_s!r}",
                          hint="how long a fit that lost hosts waits for replacements before going on with fewer")


def worker_range(launch: Any) -> tuple[int, int]:
    """(min, max) world sizes of the run: num_workers for an unset bound."""
    return launch.min_workers or launch.num_workers, launch.max_workers or launch.num_workers


def is_elastic(launch: Any) -> bool:
    """The run may change its world size: it may shrink, or grow back."""
    low, high = worker_range(launch)
    return low < launch.num_workers or (launch.grow_workers and high > low) or high > launch.num_workers


def check_resume_run(train: Any) -> None:
    """train.resume_run: an earlier fit's run id (sparkdl.run_id, FitResult.run_id) under checkpoint_dir."""
    run = train.resume_run
    if run is None:
        return
    if not isinstance(run, str) or not run or any(c in run for c in "/\\?#"):
        raise ConfigError(f"train.resume_run must be the run id of an earlier fit (its MLflow tag sparkdl.run_id), "
                          f"got {run!r}")
    if not train.checkpoint_dir:
        raise ConfigError(f"train.resume_run={run!r} continues that run's checkpoints, but train.checkpoint_dir "
                          "is not set", hint="set checkpoint_dir to the directory the earlier fit wrote under")


def check_elastic(launch: Any, train: Any) -> None:
    """An elastic run resumes from checkpoints on every host, with a strategy whose state re-shards."""
    check_resume_run(train)
    if not is_elastic(launch):
        if launch.grow_workers:
            raise ConfigError("launch.grow_workers=True, but the run cannot change size: max_workers and min_workers "
                              "are num_workers", hint="set min_workers below num_workers (a run that shrank grows "
                                                      "back to max_workers), or max_workers above it")
        return
    bounds = f"min_workers={launch.min_workers}, max_workers={launch.max_workers}"
    if not train.checkpoint_dir:
        raise ConfigError(f"launch.{bounds} need train.checkpoint_dir: a run that changes its workers continues "
                          "from its latest checkpoint", hint="set checkpoint_dir to storage every host reaches "
                                                             "(a shared mount or an object store)")
    strategy = train.implied_strategy
    if strategy not in (*RESHAPEABLE, "auto"):
        raise ConfigError(f"strategy={strategy!r} cannot change its world size mid-run ({bounds}): its checkpoint "
                          f"holds per-rank {'pipeline stages' if strategy == 'hybrid' else 'subnets'} that are not "
                          "re-cut for another number of workers",
                          hint="use strategy='data_parallel' (with sync='diloco' on slow links) or 'sharded', "
                               "or set min_workers=max_workers=num_workers")
    if train.islands:
        raise ConfigError(f"train.islands with launch.{bounds}: islands are groups of the hosts the run started on",
                          hint="drop islands, or keep the workers fixed")
    if launch.emulate_speed:
        raise ConfigError(f"launch.emulate_speed lists one speed per worker, which a run that changes its workers "
                          f"({bounds}) cannot keep", hint="drop emulate_speed")
