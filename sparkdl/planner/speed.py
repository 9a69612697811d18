"""One rank's compute speed: the FLOP/s of a float32 matrix product (driver or executor side, torch only)."""
from __future__ import annotations

import statistics
import time

MATMUL_SIZE = 512


def matmul_flops(threads: int | None = None, size: int = MATMUL_SIZE, repeats: int = 5) -> float:
    """FLOP/s of a float32 (size x size) @ (size x size) product with this many torch threads."""
    import torch

    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b  # warm-up
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - started)
        return 2.0 * size ** 3 / statistics.median(times)
    finally:
        torch.set_num_threads(previous)
