"""Uneven hosts you can reproduce (issue 43, item 1): the multi-host bed's worker hosts get CPU
capacities of their own (a cgroup per host, tests/support/cpu_capacity.py), the last at a third of
the others'. A data-parallel fit with one rank per host names that host's rank as the slow one, at
about the capacity ratio, in its epoch records and on the driver's stderr; the host's executor and
Python workers, started after its capacity was set, run inside its group.

The session's bed (tests/spark/conftest.py), after test_multihost's and test_multihost_elastic's
scenarios. Needs root and a cgroup hierarchy with the cpu controller; elsewhere it skips and says why.

Run alone: `.venv/bin/python -m pytest tests/spark/test_multihost_uneven.py -v` (as root)."""
from __future__ import annotations

import json
import re
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

SUPPORT = Path(__file__).resolve().parents[1] / "support"
sys.path.insert(0, str(SUPPORT))

import multihost  # noqa: E402

pytestmark = [pytest.mark.bed, pytest.mark.skipif(multihost.why_not() is not None, reason=str(multihost.why_not())),
              pytest.mark.skipif(multihost.why_not() is None and multihost.cpu_why_not() is not None,
                                 reason=str(multihost.cpu_why_not()))]
DRIVER = SUPPORT / "bed_uneven.py"
FAST, SLOW = 0.6, 0.2  # cores: the last host has a third of the others' capacity


def commands(pids: list[int]) -> list[str]:
    found = []
    for pid in pids:
        try:
            found.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            pass
    return found


@pytest.fixture(scope="module")
def uneven_run(bed: multihost.Bed) -> dict[str, Any]:
    fast, slow = bed.workers[:-1], bed.workers[-1]
    for host in fast:
        bed.set_cpu(host, FAST)
    bed.set_cpu(slow, SLOW)
    seen: set[str] = set()
    stop = threading.Event()

    def watch() -> None:  # what runs in the slow host's group while the fit runs
        while not stop.wait(0.5):
            seen.update(commands(bed.cpu_pids(slow)))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    out = bed.shared / "results-uneven.json"
    before = bed.cpu_throttled(slow)
    try:
        done = bed.run_on(bed.driver, [sys.executable, str(DRIVER), bed.master_url, str(out),
                                       "--workers", str(len(bed.workers))], timeout=600)
    finally:
        stop.set()
        watcher.join(5)
        after = bed.cpu_throttled(slow)
        throttled = {k: round(after[k] - before.get(k, 0), 3) for k in after}
        for host in bed.workers:
            bed.set_cpu(host, None)
    print(done.stderr[-4000:])
    assert out.exists(), f"the driver wrote no results (rc {done.returncode}):\n{done.stderr[-4000:]}"
    result = json.loads(out.read_text())
    assert "error" not in result, f"{result.get('message')}\n{result.get('trace')}"
    return {**result, "stderr": done.stderr, "slow_host": slow.address, "in_slow_group": sorted(seen),
            "fast_hosts": [h.address for h in fast],
            "slow_host_throttled": throttled}


def test_the_rank_on_the_host_with_a_third_of_the_cpu_is_named_at_about_that_ratio(uneven_run) -> None:  # type: ignore[no-untyped-def]
    last = uneven_run["history"][-1]
    for record in uneven_run["history"]:
        print(f"[bed] uneven hosts (fit {uneven_run['fit_s']} s): {json.dumps(record)}")
    print(f"[bed] the slow host's group was held back: {uneven_run['slow_host_throttled']}")
    (slow,) = last["slow_ranks"]
    assert slow["host"] == uneven_run["slow_host"], (slow, uneven_run["slow_host"])
    speeds = last["rows_per_compute_s_by_rank"]
    fast_speeds = [s for r, s in enumerate(speeds) if r != slow["rank"]]
    ratio = min(fast_speeds) / speeds[slow["rank"]]
    # Capacity ratio 3; the fast hosts share this machine's cores with the rest of the suite and
    # may get less than their quota (the ratio lower), the slow one never more than its quota.
    assert 2.0 <= ratio <= 4.5, (ratio, speeds)
    assert 2.0 <= slow["slower"] <= 4.5, slow
    assert last["wait_fraction"] > 0.25, last  # two ranks of three wait for the third at every step
    line = re.search(rf"sparkdl: rank {slow['rank']} on host {re.escape(slow['host'])} computes (\d+\.\d)x slower "
                     r"than the median; (\d+)% of step time is spent waiting for it", uneven_run["stderr"])
    assert line, uneven_run["stderr"][-3000:]


def test_the_slow_hosts_executor_and_python_workers_started_later_run_in_its_group(uneven_run) -> None:  # type: ignore[no-untyped-def]
    seen = uneven_run["in_slow_group"]
    assert any("org.apache.spark.deploy.worker.Worker" in c for c in seen), seen
    assert any("CoarseGrainedExecutorBackend" in c for c in seen), seen  # started by the Worker after the move
    assert any("python" in c.split(" ", 1)[0] for c in seen), seen  # Spark's Python workers under the executor
