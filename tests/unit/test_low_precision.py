"""16-bit averages with fp32 sums (strategies/low_precision.py) on real gloo worlds of 3 processes on
127.0.0.1, against the exact fp32 mean and against a plain fp16 allreduce."""
from __future__ import annotations

import socket
from typing import Any

import pytest
import torch

from gloo_world import rank_context
from sparkdl.strategies import low_precision

pytestmark = pytest.mark.timeout(120)
WORLD = 3
NUMEL = 10_001  # not a multiple of the world: uneven chunks


def deltas(rank: int) -> torch.Tensor:
    """DiLoCo-like pseudo-gradients: small (lr x steps x gradient), spread over decades."""
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randn(NUMEL, generator=generator) * torch.logspace(-7, -3, NUMEL)


def rank_main(rank: int, port: int, wire: str, out: Any) -> None:
    from sparkdl.comm.base import WorldInfo
    from sparkdl.comm.torch_dist import TorchDistCommunicator

    world = WorldInfo(rank=rank, size=WORLD, local_rank=rank, local_size=WORLD, hosts=("127.0.0.1",) * WORLD,
                      master_addr="127.0.0.1", master_port=port)
    comm = TorchDistCommunicator(world, timeout_s=60)
    try:
        mine = deltas(rank)
        before = comm.bytes_sent
        averaged = low_precision.average(comm, mine, wire)
        sent = comm.bytes_sent - before
        naive = mine.to(torch.float16)
        comm.allreduce(naive, op="avg")
        # numpy arrays travel by value: a tensor would be shared memory this process takes with it
        out.put((rank, averaged.numpy(), naive.to(torch.float32).numpy(), sent))
    finally:
        comm.close()


def run_world(wire: str) -> dict[int, tuple[torch.Tensor, torch.Tensor, Any]]:
    with socket.socket() as spare:
        spare.bind(("127.0.0.1", 0))
        port = spare.getsockname()[1]
    context = rank_context()  # forked from a server that imported torch once (tests/support/gloo_world.py)
    out = context.Queue()
    ranks = [context.Process(target=rank_main, args=(r, port, wire, out)) for r in range(WORLD)]
    for process in ranks:
        process.start()
    results = {}
    for _ in ranks:
        rank, averaged, naive, sent = out.get(timeout=90)
        results[rank] = (torch.from_numpy(averaged), torch.from_numpy(naive), sent)
    for process in ranks:
        process.join(30)
    return results


@pytest.mark.parametrize("wire", ["fp16", "bf16"])
def test_a_16_bit_average_with_fp32_sums_is_the_same_on_every_rank_and_close_to_the_exact_mean(wire: str) -> None:
    results = run_world(wire)
    exact = sum(deltas(r) for r in range(WORLD)) / WORLD
    first = results[0][0]
    for rank in range(1, WORLD):
        assert torch.equal(results[rank][0], first), rank  # replicas stepping on it stay identical
    error = (first - exact).abs().max() / exact.abs().max()
    bound = {"fp16": 2e-3, "bf16": 1.6e-2}[wire]  # a few roundings at 11 (8) significant bits
    assert error < bound, (wire, float(error))
    if wire == "fp16":
        # The plain fp16 allreduce loses the small deltas to subnormals (and rounds every partial sum).
        small = exact.abs() < 1e-6
        naive_error = ((results[0][1] - exact)[small]).abs().mean()
        ours = ((first - exact)[small]).abs().mean()
        assert ours < naive_error / 10, (float(ours), float(naive_error))
    # The 16-bit chunks of a ring (2 (W-1) of them, of N/W values, fp16 with a bf16 scale per 128).
    sent, width = results[0][2], 2
    assert 2 * (WORLD - 1) * (NUMEL // WORLD) * width <= sent <= low_precision.wire_bytes(NUMEL, WORLD, wire) + 8, sent


def test_one_rank_returns_its_values_and_a_bad_wire_dtype_is_named() -> None:
    class Alone:
        size, rank, ops = 1, 0, frozenset()

    values = deltas(0)
    assert torch.equal(low_precision.average(Alone(), values, "fp16"), values)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="int3"):
        low_precision.average(Alone(), values, "int3")  # type: ignore[arg-type]
