"""The multi-host bed's CPU capacities (tests/support/cpu_capacity.py): a busy process in a group at
0.25 core gets about a quarter of a core, a process it starts later is in the group too, groups go
away with their leftovers, and a noisy neighbour's schedule follows from its seed. Needs root and a
cgroup hierarchy with the cpu controller (v2 cpu.max or v1 cpu.cfs_quota_us); elsewhere the
kernel-facing tests skip and say why."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import cpu_capacity

REASON = cpu_capacity.why_not()
needs_cgroups = pytest.mark.skipif(REASON is not None, reason=str(REASON))
BUSY = "import time\nend = time.monotonic() + 30\nwhile time.monotonic() < end: pass"
# Busy for 30 s after starting a busy child 0.2 s in: the child is made after the parent was moved.
PARENT = ("import subprocess, sys, time\ntime.sleep(0.2)\n"
          f"child = subprocess.Popen([sys.executable, '-c', {BUSY!r}])\n"
          "print(child.pid, flush=True)\n" + BUSY)


@needs_cgroups
def test_a_busy_process_at_a_quarter_core_gets_a_quarter_and_its_later_children_join_it() -> None:
    groups = cpu_capacity.CpuGroups(f"sdlcputest{os.getpid()}")
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        groups.set("host", 0.25)
        assert groups.get("host") == pytest.approx(0.25)
        assert groups.add("host", [parent.pid]) == [parent.pid]
        child = int(parent.stdout.readline())  # started after the move
        assert set(groups.pids("host")) == {parent.pid, child}
        time.sleep(0.3)  # past the children's start
        before, started = cpu_capacity.cpu_seconds(parent.pid) + cpu_capacity.cpu_seconds(child), time.monotonic()
        time.sleep(1.2)
        used = cpu_capacity.cpu_seconds(parent.pid) + cpu_capacity.cpu_seconds(child) - before
        share = used / (time.monotonic() - started)
        # Two busy processes share a quarter core (quota over 100 ms periods: 12 of them measured).
        # On a loaded machine the group may get less than its quota, never much more.
        assert 0.12 <= share <= 0.3, share
        groups.set("host", None)  # unlimited again
        assert groups.get("host") is None
    finally:
        parent.kill()
        parent.wait()
        groups.remove()
    assert not groups.parent.exists()


@needs_cgroups
def test_removing_the_groups_moves_live_processes_out_first() -> None:
    groups = cpu_capacity.CpuGroups(f"sdlcputest{os.getpid()}b")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        groups.set("host", 2)  # two cores
        assert groups.get("host") == pytest.approx(2.0)
        groups.add("host", [sleeper.pid])
        groups.remove()
        assert not groups.parent.exists() and sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()
        groups.remove()


def test_a_noisy_neighbours_schedule_follows_from_its_seed() -> None:
    first = cpu_capacity.planned_changes(7, 0.2, 1.0, 2.0, 60.0)
    assert first == cpu_capacity.planned_changes(7, 0.2, 1.0, 2.0, 60.0)
    assert first != cpu_capacity.planned_changes(8, 0.2, 1.0, 2.0, 60.0)
    assert first[0][0] == 0.0 and all(0.2 <= c <= 1.0 for _, c in first)
    times = [t for t, _ in first]
    assert times == sorted(times) and times[-1] < 60.0 and 15 <= len(first) <= 50  # ~30 at a 2 s mean
    with pytest.raises(ValueError):
        cpu_capacity.planned_changes(7, 0.0, 1.0, 2.0, 60.0)


@needs_cgroups
def test_a_noisy_neighbour_applies_its_schedule_and_restores_the_capacity() -> None:
    groups = cpu_capacity.CpuGroups(f"sdlcputest{os.getpid()}c")
    try:
        groups.set("host", 0.5)
        neighbour = cpu_capacity.NoisyNeighbour(groups, "host", seed=3, low=0.1, high=0.9, mean_interval_s=0.1).start()
        time.sleep(0.8)
        neighbour.stop()
        applied = neighbour.schedule
        assert len(applied) >= 3, applied
        # The capacities applied are the seeded plan's, in order, each near its planned time.
        assert [c for _, _, c in applied] == [c for _, c in neighbour.plan[: len(applied)]]
        assert all(abs(t - p) < 0.5 for (t, _, _), (p, _) in zip(applied, neighbour.plan)), (applied, neighbour.plan)
        assert groups.get("host") == pytest.approx(0.5)  # what it had before
        assert 0.1 <= neighbour.mean_capacity() <= 0.9
    finally:
        groups.remove()


def test_why_not_says_why_when_no_hierarchy_offers_cpu(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "cgroup.controllers").write_text("memory pids\n")  # a cgroup2 mount without cpu, as here
    monkeypatch.setattr(cpu_capacity, "_mounts", lambda: [(str(tmp_path), "cgroup2", {"rw"})])
    reason = cpu_capacity.why_not()
    assert reason is not None and "offers no cpu controller" in reason and "memory pids" in reason, reason
    monkeypatch.setattr(cpu_capacity, "_mounts", lambda: [])
    assert "no cgroup hierarchy with the cpu controller is mounted" in str(cpu_capacity.why_not())


def test_the_mean_capacity_over_a_window_weighs_each_change_by_its_time() -> None:
    changes = [(0.0, 1.0), (2.0, 0.5), (4.0, 0.25)]
    assert cpu_capacity.mean_cores(changes) == pytest.approx(0.75)  # to the last change
    assert cpu_capacity.mean_cores(changes, 0.0, 6.0) == pytest.approx(3.5 / 6)
    assert cpu_capacity.mean_cores(changes, 1.0, 3.0) == pytest.approx(0.75)
    assert cpu_capacity.mean_cores(changes, 5.0, 8.0) == pytest.approx(0.25)
