"""The network emulator on real gloo ranks: every operation is delayed by the formula, and bytes are
still counted by the real communicator."""
from __future__ import annotations

import time
from typing import Any

import pytest

from gloo_world import run_world


def _emulated_rank(comm: Any) -> dict[str, float]:
    import torch

    from sparkdl.comm.emulated import EmulatedNetwork

    slow = EmulatedNetwork(comm, latency_s=0.01, bandwidth_Bps=1e6)  # 10 ms, 1 MB/s
    started = time.perf_counter()
    slow.allreduce(torch.ones(25_000))  # 100 kB: 2(W-1)/W x 100 kB = 100 kB sent with W = 2
    elapsed = time.perf_counter() - started
    before = slow.emulated_s
    work = slow.send(torch.ones(2_500), 1 - comm.rank, 5) if comm.rank == 0 else None
    if comm.rank == 1:
        buffer = torch.zeros(2_500)
        slow.recv(buffer, 0, 5)
    else:
        work.wait()
    return {"allreduce_s": elapsed, "emulated_allreduce_s": before, "emulated_send_s": slow.emulated_s - before,
            "bytes": slow.bytes_sent}


def test_every_operation_takes_latency_plus_bytes_over_bandwidth() -> None:
    results = run_world(2, _emulated_rank)
    for rank, result in enumerate(results):
        # allreduce with W = 2: 2 (W - 1) = 2 latencies + 100,000 bytes / 1 MB/s, minus what the real
        # allreduce already took (how long that is depends on the machine's load: not asserted)
        assert 0.0 <= result["emulated_allreduce_s"] <= 0.12 + 1e-9
        assert result["allreduce_s"] >= 0.12
        # a message: the sender pays one latency + 10 kB / 1 MB/s; the receiver nothing
        assert result["emulated_send_s"] == pytest.approx(0.01 + 0.01 if rank == 0 else 0.0)
    assert results[0]["bytes"] == 100_000 + 10_000 and results[1]["bytes"] == 100_000
