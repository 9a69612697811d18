"""Threads of a rank (sparkdl/executor/threads.py): the task's CPUs as Spark allots them, never more
than the process may run on (affinity, cgroup quota), launch.threads_per_worker honoured, bad values
refused naming the option; the cgroup readers on fake v1 and v2 trees."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sparkdl.config import LaunchConfig, RunConfig
from sparkdl.errors import ConfigError
from sparkdl.executor.threads import (CpuFacts, cfs_cores, cgroup_cpu_limit, cpu_max_cores, rank_threads, task_cpus,
                                      threads_for_rank)


def test_task_cpus_1_on_a_16_core_host_is_one_thread() -> None:
    # The old rule (host cores / ranks on the host) gave a lone rank all 16.
    assert rank_threads(None, CpuFacts(task_cpus=1, usable_cpus=16, ranks_on_executor=1, ranks_on_host=1)) == 1


def test_task_cpus_4_is_four_threads() -> None:
    # 16-core node, 4 executors of 4 cores, one rank each: 4 by Spark's allotment, not by the division.
    assert rank_threads("auto", CpuFacts(task_cpus=4, usable_cpus=16, ranks_on_executor=1, ranks_on_host=4)) == 4
    # spark.task.cpus=4 with 3 ranks on that host: still 4 each (the old rule said 16 // 3 = 5).
    assert rank_threads(None, CpuFacts(task_cpus=4, usable_cpus=16, ranks_on_executor=1, ranks_on_host=3)) == 4


def test_a_quota_of_a_fifth_of_a_core_runs_one_thread() -> None:
    assert rank_threads(None, CpuFacts(task_cpus=1, usable_cpus=0.2)) == 1
    assert rank_threads(None, CpuFacts(task_cpus=2, usable_cpus=0.2)) == 1  # the executor declares more than it has
    assert rank_threads(None, CpuFacts(task_cpus=None, usable_cpus=0.2, ranks_on_host=2)) == 1


def test_the_cap_is_shared_by_the_ranks_of_one_executor() -> None:
    # An executor claiming 8 cores in a container of 4, two tasks of 4 CPUs: 2 threads each, not 4.
    assert rank_threads(None, CpuFacts(task_cpus=4, usable_cpus=4, ranks_on_executor=2, ranks_on_host=2)) == 2
    assert rank_threads(None, CpuFacts(task_cpus=4, usable_cpus=3.5)) == 3  # whole cores only


def test_without_a_spark_figure_the_host_is_shared() -> None:
    assert rank_threads(None, CpuFacts(task_cpus=None, usable_cpus=16, ranks_on_host=4)) == 4
    assert rank_threads(None, CpuFacts(task_cpus=None, usable_cpus=None, ranks_on_host=4)) == 1


def test_an_explicit_count_is_honoured() -> None:
    assert rank_threads(3, CpuFacts(task_cpus=1, usable_cpus=16)) == 3
    assert rank_threads(8, CpuFacts(task_cpus=1, usable_cpus=0.2)) == 8  # the user's call, as given


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "many", "4", float("nan")])
def test_a_bad_count_is_refused_naming_the_option(bad: Any) -> None:
    with pytest.raises(ConfigError, match="launch.threads_per_worker"):
        rank_threads(bad, CpuFacts(task_cpus=1, usable_cpus=16))
    with pytest.raises(ConfigError, match="launch.threads_per_worker"):
        LaunchConfig(threads_per_worker=bad).validate()


def test_auto_is_the_unset_default_everywhere() -> None:
    assert LaunchConfig(threads_per_worker="auto").threads_per_worker is None
    assert LaunchConfig(threads_per_worker="auto") == LaunchConfig()
    assert RunConfig().with_overrides(["launch.threads_per_worker=auto"]).launch.threads_per_worker is None
    LaunchConfig(threads_per_worker=4).validate()


class Context:
    """A task context as PySpark's: cpus() is spark.task.cpus or the stage's ResourceProfile's."""

    def __init__(self, cpus: Any) -> None:
        self._cpus = cpus

    def cpus(self) -> Any:
        return self._cpus


def test_task_cpus_come_from_the_task_context() -> None:
    assert task_cpus(Context(3)) == 3
    assert task_cpus(Context(None)) is None  # a context that does not say
    assert task_cpus(object()) is None  # PySpark < 3.3: no cpus()
    assert task_cpus() is None  # on the driver: no task


def test_threads_for_rank_counts_ranks_per_executor(monkeypatch: pytest.MonkeyPatch) -> None:
    from sparkdl.executor import threads

    monkeypatch.setattr(threads, "usable_cpus", lambda: 4.0)  # each executor's container: 4 cores
    monkeypatch.setattr(threads, "_affinity", lambda: 16)  # on a 16-core host
    executors = ("10.0.0.1:1", "10.0.0.1:1", "10.0.0.1:2")
    assert threads_for_rank(None, Context(4), executors, rank=0, ranks_on_host=3) == 2  # shares its executor
    assert threads_for_rank(None, Context(4), executors, rank=2, ranks_on_host=3) == 4  # alone in its executor
    assert threads_for_rank(None, object(), (), rank=0, ranks_on_host=2) == 2  # no Spark figure: the host shared
    assert threads_for_rank(1, Context(4), executors, rank=2, ranks_on_host=3) == 1
    monkeypatch.setattr(threads, "_affinity", lambda: 4)  # all three on 4 cores: Spark's 12 task CPUs shared
    assert threads_for_rank(None, Context(4), executors, rank=2, ranks_on_host=3) == 1


def test_cgroup_file_formats() -> None:
    assert cpu_max_cores("20000 100000\n") == pytest.approx(0.2)
    assert cpu_max_cores("max 100000") is None
    assert cpu_max_cores("") is None and cpu_max_cores(None) is None
    assert cfs_cores("50000\n", "100000\n") == pytest.approx(0.5)
    assert cfs_cores("-1", "100000") is None
    assert cfs_cores(None, "100000") is None


def test_cgroup_v2_quota_on_a_parent_applies(tmp_path: Path) -> None:
    leaf = tmp_path / "pod" / "executor"
    leaf.mkdir(parents=True)
    (tmp_path / "pod" / "cpu.max").write_text("20000 100000\n")
    (leaf / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(tmp_path, "0::/pod/executor\n") == pytest.approx(0.2)
    # In a container the host's path is not under the mount: the mount's own file counts.
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(tmp_path, "0::/elsewhere/on/the/host\n") == pytest.approx(1.5)
    assert cgroup_cpu_limit(tmp_path / "absent", "0::/\n") is None


def test_cgroup_v1_cfs_quota(tmp_path: Path) -> None:
    cpu = tmp_path / "cpu,cpuacct" / "docker" / "abc"
    cpu.mkdir(parents=True)
    (cpu / "cpu.cfs_quota_us").write_text("20000\n")
    (cpu / "cpu.cfs_period_us").write_text("100000\n")
    membership = "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n"
    assert cgroup_cpu_limit(tmp_path, membership) == pytest.approx(0.2)
    (cpu / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(tmp_path, membership) is None


def test_this_machine_reads_without_error() -> None:
    from sparkdl.executor.threads import usable_cpus

    cpus = usable_cpus()
    assert cpus is None or cpus > 0


def test_a_rank_alone_on_an_executor_gets_its_cores_past_spark_task_cpus() -> None:
    # 16-core node, 4 executors of 4 cores, spark.task.cpus=1, one rank per executor: 4 threads by rule
    facts = CpuFacts(task_cpus=1, usable_cpus=16, ranks_on_executor=1, ranks_on_host=4, executor_cores=4, host_cpus=16)
    assert rank_threads(None, facts) == 4
    # spark.task.cpus=2 and two ranks in one 4-core executor: 2 each, not the host's 16 / 4
    assert rank_threads(None, CpuFacts(task_cpus=2, usable_cpus=16, ranks_on_executor=2, ranks_on_host=2,
                                       executor_cores=4, host_cpus=16)) == 2
    # a task that asked for more than its share of the executor keeps what Spark gave it
    assert rank_threads(None, CpuFacts(task_cpus=4, usable_cpus=16, ranks_on_executor=2, executor_cores=4)) == 4


def test_local_masters_share_their_cores_and_one_machine_is_never_oversubscribed() -> None:
    # local[8] with 2 ranks in the driver's one executor: 4 each (spark.task.cpus is 1 there)
    assert rank_threads(None, CpuFacts(task_cpus=1, usable_cpus=8, ranks_on_executor=2, ranks_on_host=2,
                                       executor_cores=8, host_cpus=8)) == 4
    # local-cluster[2,2,1024] on a 2-core machine: two executors of 2 cores, one rank each, one host
    assert rank_threads(None, CpuFacts(task_cpus=1, usable_cpus=2, ranks_on_executor=1, ranks_on_host=2,
                                       executor_cores=2, host_cpus=2)) == 1
    # a container capped at 0.2 cores in a 4-core executor: 1
    assert rank_threads(None, CpuFacts(task_cpus=1, usable_cpus=0.2, executor_cores=4, host_cpus=16)) == 1


def test_executor_cores_from_the_master_or_the_conf() -> None:
    import os

    from sparkdl.spark.session import executor_cores

    assert executor_cores("local[3]", None) == 3
    assert executor_cores("local", None) == 1
    assert executor_cores("local[*]", None) == (os.cpu_count() or 1)
    assert executor_cores("local-cluster[2,4,1024]", None) == 4
    assert executor_cores("spark://h:7077", "6") == 6
    assert executor_cores("yarn", None) is None and executor_cores("yarn", "x") is None
