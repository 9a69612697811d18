"""One rank's compute speed: the FLOP/s of a float32 matrix product (driver or executor side, torch only)."""
from __future__ import annotations

import statistics
import time

MATMUL_SIZE = 512


def matmul_rates(threads: int | None = None, size: int = MATMUL_SIZE, repeats: int = 5) -> list[float]:
    """FLOP/s of each of `repeats` float32 (size x size) @ (size x size) products with this many torch
    threads (after one warm-up): their spread shows how much a shared host disturbed the measurement."""
    import torch

    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b  # warm-up
        rates = []
        for _ in range(repeats):
            started = time.perf_counter()
            a @ b
            rates.append(2.0 * size ** 3 / max(time.perf_counter() - started, 1e-12))
        return rates
    finally:
        torch.set_num_threads(previous)


def matmul_flops(threads: int | None = None, size: int = MATMUL_SIZE, repeats: int = 5) -> float:
    """The median of matmul_rates: one rank's sustained FLOP/s."""
    return statistics.median(matmul_rates(threads, size, repeats))
