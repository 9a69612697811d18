"""Each job attempt's world in the MLflow run (driver/monitor.py calls `started` on rank 0's start
message). A retried or resized run starts several attempts, and their world differs: other hosts
after a loss, another size after an elastic change. MLflow refuses a param logged again with
another value, so only the first attempt's world is params (`world.*`, the world the run started
with); every attempt's is metrics over the attempt number (`world_size`, `world_num_hosts`) and one
tag (`sparkdl.attempt.<n>.world`), `sparkdl.attempts` counting them.
"""
from __future__ import annotations

from typing import Any, Mapping


def world_params(message: Mapping[str, Any]) -> dict[str, Any]:
    """The `world.*` params of a start message (the first attempt's)."""
    hosts = [str(h) for h in message.get("hosts", [])]
    return {"world.size": message.get("world_size"), "world.hosts": ", ".join(hosts),
            "world.num_hosts": len(hosts), "world.device": message.get("device"),
            "world.gpus_rank0": ", ".join(message.get("gpus", [])) or "none",
            "world.steps_per_epoch": message.get("steps_per_epoch")}


def world_line(message: Mapping[str, Any]) -> str:
    """One attempt's world in words: "3 workers on a, b, c (cpu, 12 steps an epoch)"."""
    hosts = ", ".join(str(h) for h in message.get("hosts", [])) or "unknown hosts"
    return (f"{message.get('world_size')} workers on {hosts} ({message.get('device')}, "
            f"{message.get('steps_per_epoch')} steps an epoch)")


class AttemptWorlds:
    """Counts a run's attempts as their ranks start, and logs each one's world (see the module)."""

    def __init__(self, tracker: Any) -> None:
        self.tracker = tracker
        self.count = 0
        self._threads_logged = False

    def started(self, message: Mapping[str, Any]) -> None:
        self.count += 1
        if self.count == 1:
            self.tracker.log_params(world_params(message))
        hosts = {str(h) for h in message.get("hosts", [])}
        self.tracker.log_metric_points([({"world_size": float(message.get("world_size") or 0),
                                          "world_num_hosts": float(len(hosts))}, self.count - 1)])
        self.tracker.set_tags({f"sparkdl.attempt.{self.count}.world": world_line(message),
                               "sparkdl.attempts": self.count})

    def threads(self, record: Mapping[str, Any]) -> None:
        """`world.threads_per_rank`: the torch threads each rank trains with (executor/threads.py),
        a param from the first epoch record that carries them."""
        threads = record.get("torch_threads_by_rank")
        if threads and not self._threads_logged:
            self._threads_logged = True
            self.tracker.log_params({"world.threads_per_rank": ", ".join(str(int(t)) for t in threads)})
