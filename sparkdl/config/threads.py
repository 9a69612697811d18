"""launch.threads_per_worker: torch intra-op threads per rank, "auto" (the default, unset) or a
count. The rule that turns "auto" into a count runs in the task (sparkdl/executor/threads.py);
this module only checks and normalises what the user wrote. Standard library and errors only.
"""
from __future__ import annotations

from typing import Any

from sparkdl.errors import ConfigError

OPTION = "launch.threads_per_worker"
AUTO = "auto"


def threads_option(value: Any) -> int | None:
    """The option as the rule takes it: a count >= 1, or None for "auto" (None and "auto" alike).
    Anything else is a ConfigError naming the option."""
    if value is None or value == AUTO:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ConfigError(f"{OPTION} must be a whole number of threads >= 1 or {AUTO!r}, got {value!r}",
                      hint=f'leave it unset (or "{AUTO}") for the CPUs Spark gives each task (spark.task.cpus '
                           f"or the stage's ResourceProfile), or set e.g. {OPTION} = 4")
