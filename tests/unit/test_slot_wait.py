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
