"""The rendezvous through the driver channel: ranks learn rank 0's port without waiting for Spark's
polled barrier, and still through the allGather when the channel is down. Spark's barrier and the
channel are played by threads: the allGather returns a second after the last rank arrived, as
Spark's Thread.sleep(1000) loop does."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

from sparkdl.driver.monitor import RunMonitor
from sparkdl.executor.rendezvous import rendezvous_through_driver

SPARK_POLL_S = 1.0


class Barrier:
    """allGather of `size` tasks: every message, a second after the last arrived."""

    def __init__(self, size: int) -> None:
        self.messages: dict[int, str] = {}
        self.all_in = threading.Barrier(size)

    def gather(self, rank: int, message: str) -> list[str]:
        self.messages[rank] = message
        self.all_in.wait()
        time.sleep(SPARK_POLL_S)
        return [self.messages[r] for r in sorted(self.messages)]


class Context:
    def __init__(self, rank: int, barrier: Barrier, hosts: list[str]) -> None:
        self.rank, self.barrier, self.hosts = rank, barrier, hosts

    def partitionId(self) -> int:
        return self.rank

    def stageId(self) -> int:
        return 7

    def stageAttemptNumber(self) -> int:
        return 0

    def allGather(self, message: str = "") -> list[str]:
        return self.barrier.gather(self.rank, message)

    def getTaskInfos(self) -> list[Any]:
        return [SimpleNamespace(address=f"{h}:4040{i}") for i, h in enumerate(self.hosts)]

    def resources(self) -> dict[str, Any]:
        return {}


class Channel:
    """A driver channel in-process: messages go straight to a RunMonitor, requests get its reply."""

    def __init__(self, monitor: RunMonitor, down: bool = False) -> None:
        self.monitor, self.failed, self.lock = monitor, down, threading.Lock()

    def send(self, kind: str, **fields: Any) -> None:
        with self.lock:
            self.monitor.on_message({"kind": kind, **fields})

    def request(self, kind: str, timeout: float, **fields: Any) -> dict[str, Any] | None:
        replies: list[dict[str, Any]] = []
        with self.lock:
            self.monitor.on_message({"kind": kind, **fields, "reply": replies.append})
        return replies[0] if replies else None


def _ranks(channels: list[Any], port: int = 4321) -> tuple[list[Any], list[float]]:
    barrier = Barrier(len(channels))
    hosts = ["10.0.0.1", "10.0.0.2", "10.0.0.2"][: len(channels)]
    worlds: list[Any] = [None] * len(channels)
    seconds = [0.0] * len(channels)
    gatherings: list[threading.Thread] = []

    def rank_main(rank: int) -> None:
        time.sleep(0.05 * rank)  # rank 0 is not the last to arrive
        started = time.perf_counter()
        world, gathering = rendezvous_through_driver(Context(rank, barrier, hosts), port if rank == 0 else 0,
                                                     channels[rank], poll_s=0.001)
        seconds[rank] = time.perf_counter() - started
        worlds[rank] = world
        gatherings.append(gathering)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(len(channels))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    for g in list(gatherings):
        g.join(10)
        assert not g.is_alive()  # Spark's barrier completed on every rank
    return worlds, seconds


def test_ranks_learn_the_port_from_the_driver_before_spark_barrier_returns() -> None:
    monitor = RunMonitor(tracker=None, progress=False)
    worlds, seconds = _ranks([Channel(monitor) for _ in range(3)])
    assert [w.master_port for w in worlds] == [4321] * 3 and all(w.master_addr == "10.0.0.1" for w in worlds)
    assert [w.local_rank for w in worlds] == [0, 0, 1] and worlds[2].size == 3
    assert max(seconds) < SPARK_POLL_S / 2  # none waited for the barrier's poll


def test_a_rank_whose_channel_is_down_takes_the_port_from_the_allgather() -> None:
    monitor = RunMonitor(tracker=None, progress=False)
    worlds, seconds = _ranks([Channel(monitor), Channel(monitor, down=True), None])
    assert [w.master_port for w in worlds] == [4321] * 3
    assert seconds[0] < SPARK_POLL_S / 2 and min(seconds[1:]) >= SPARK_POLL_S * 0.9


def test_ports_of_another_stage_attempt_are_not_used() -> None:
    monitor = RunMonitor(tracker=None, progress=False)
    monitor.on_message({"kind": "rendezvous", "key": "7.1", "port": 999})  # a later attempt's rank 0
    replies: list[dict[str, Any]] = []
    monitor.on_message({"kind": "rendezvous", "key": "7.0", "reply": replies.append})
    assert replies == [{"port": 0}]


def test_a_custom_loops_own_spark_barrier_waits_for_the_rendezvous_allgather() -> None:
    from sparkdl.executor.rendezvous import spark_barriers_after

    calls: list[tuple[str, bool]] = []

    class Task:
        def barrier(self) -> None:
            calls.append(("barrier", gathering.is_alive()))

        def allGather(self, message: str = "") -> list[str]:
            calls.append(("allGather", gathering.is_alive()))
            return [message]

    gathering = threading.Thread(target=time.sleep, args=(0.3,))
    gathering.start()
    task = Task()
    with spark_barriers_after(task, gathering):
        task.barrier()  # would overlap the rendezvous's allGather: waits for it first
        assert task.allGather("x") == ["x"]
    assert calls == [("barrier", False), ("allGather", False)]
    assert "barrier" not in vars(task) and "allGather" not in vars(task)  # the class's own methods again
