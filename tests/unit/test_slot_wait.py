"""The slot wait's budget: launch.slot_wait_s, or unset Spark's own barrier-scheduling check budget."""
from __future__ import annotations

import pytest

from sparkdl.driver.job import slot_wait_seconds, spark_seconds


@pytest.mark.parametrize("text, seconds", [("15s", 15.0), ("2min", 120.0), ("500ms", 0.5), ("1h", 3600.0),
                                           ("30", 30.0), (" 7 s ", 7.0), ("soon", 15.0), (None, 15.0)])
def test_spark_time_settings_read_as_spark_reads_them(text, seconds) -> None:  # type: ignore[no-untyped-def]
    assert spark_seconds(text, 15.0) == pytest.approx(seconds)


class _Facts:
    def __init__(self, conf: dict[str, str]) -> None:
        self._conf = conf

    def conf(self, key: str, default: str | None = None) -> str | None:
        return self._conf.get(key, default)


@pytest.mark.parametrize("conf, wait_s, budget", [
    ({}, None, 600.0),  # Spark's defaults: 15 s x 40
    ({"spark.scheduler.barrier.maxConcurrentTasksCheck.interval": "5s",
      "spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures": "6"}, None, 30.0),
    ({"spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures": "many"}, None, 600.0),
    ({}, 42.0, 42.0),  # the user's own setting wins
])
def test_an_unset_slot_wait_follows_spark_barrier_check(monkeypatch, conf, wait_s, budget) -> None:  # type: ignore[no-untyped-def]
    import sparkdl.driver.job as job

    monkeypatch.setattr(job, "facts", lambda spark: _Facts(conf))
    assert slot_wait_seconds(object(), wait_s) == pytest.approx(budget)


class _Cluster(_Facts):
    def __init__(self, master: str, executors: int, conf: dict[str, str] | None = None) -> None:
        super().__init__(conf or {})
        self._master, self._executors = master, executors

    def master(self) -> str:
        return self._master

    def executors(self) -> tuple[str, ...]:
        return tuple(f"127.0.0.1:{4000 + i}" for i in range(self._executors))


@pytest.mark.parametrize("cluster, final", [
    (_Cluster("local-cluster[2,2,1024]", 2), True),  # every executor up: more slots cannot come
    (_Cluster("local-cluster[2,2,1024]", 1), False),  # one still registering: wait for it
    (_Cluster("spark://m:7077", 2), False),  # a standalone master may still get workers
    (_Cluster("spark://m:7077", 2, {"spark.executor.instances": "2"}), True),
    (_Cluster("yarn", 3, {"spark.executor.instances": "2", "spark.dynamicAllocation.enabled": "true"}), False),
])
def test_a_cluster_whose_executors_all_registered_is_not_waited_for(monkeypatch, cluster, final) -> None:  # type: ignore[no-untyped-def]
    import sparkdl.driver.job as job

    monkeypatch.setattr(job, "facts", lambda spark: cluster)
    assert job.executors_final(object()) is final


def test_a_shortfall_on_a_complete_cluster_is_refused_at_once(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import sparkdl.driver.job as job
    from sparkdl.errors import InsufficientSlotsError

    cluster = _Cluster("local-cluster[2,1,1024]", 2)
    monkeypatch.setattr(job, "facts", lambda spark: cluster)
    monkeypatch.setattr(job, "concurrent_slots", lambda spark, profile, wanted: 2)
    with pytest.raises(InsufficientSlotsError, match="can run only 2 tasks") as refused:
        job.ensure_slots(object(), 4, None)
    assert "after waiting" not in str(refused.value)  # refused at once, not after Spark's 10-minute budget
