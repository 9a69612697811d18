"""Overlapped data parallel against DDP's reducer (issue 53 part 6): the same buckets in the same
launch order as DDP's after its first step, and an overlapped step's collectives are its buckets'
allreduces and nothing more (a collective per step costs a round trip on a slow link)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gloo_world import run_world
from sparkdl.strategies.grad_overlap import plan_buckets

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from language_model import gpt  # noqa: E402 - the issue's small GPT (137,216 parameters)

COUNTED = ("allreduce", "allreduce_async", "broadcast", "allgather", "allgather_object", "barrier", "send")


def ddp_buckets(params: list[nn.Parameter], first: int, rest: int) -> list[list[int]]:
    """DDP's rebuilt buckets (torch's own assignment over the gradients in backward's order, taken
    as reverse parameter order), as indices into `params`."""
    ready = list(reversed(params))
    buckets, _ = dist._compute_bucket_assignment_by_size(ready, [first, rest], [False] * len(ready),
                                                         list(range(len(ready))))
    return [[len(params) - 1 - i for i in bucket] for bucket in buckets]


def _mixed() -> list[nn.Parameter]:
    shapes = ((100, torch.float32), (3, torch.float16), (10, torch.float32), (200, torch.float32),
              (5, torch.float16), (60, torch.float32))
    return [nn.Parameter(torch.zeros(n, dtype=dtype)) for n, dtype in shapes]


@pytest.mark.parametrize("params, first, rest", [
    (list(gpt().parameters()), 1 << 20, 25 << 20),  # DDP's defaults: one bucket
    (list(gpt().parameters()), 16 << 10, 64 << 10),  # several
    ([nn.Parameter(torch.zeros(n)) for n in (100, 10, 10, 50, 5, 300, 7)], 50, 250),
    (_mixed(), 50, 250),  # each dtype's first bucket small; a half-filled float16 one last
], ids=["gpt-defaults", "gpt-small-buckets", "vectors", "mixed-dtypes"])
def test_buckets_are_ddps(params: list[nn.Parameter], first: int, rest: int) -> None:
    assert plan_buckets(params, first, rest) == ddp_buckets(params, first, rest)


def test_a_rare_dtype_bucket_does_not_hold_back_full_ones() -> None:
    # Launch is strictly in bucket order: the float16 bucket, opened by the last parameter but
    # completed only by the first one's gradient, goes after the float32 buckets that filled.
    assert plan_buckets(_mixed(), 50, 250) == [[5], [3], [2, 0], [4, 1]]


def _count_collectives(comm: Any) -> dict[str, int]:
    counts = {name: 0 for name in COUNTED}
    for name in COUNTED:
        method = getattr(comm, name)

        def counted(*args: Any, _name: str = name, _method: Any = method, **kwargs: Any) -> Any:
            counts[_name] += 1
            return _method(*args, **kwargs)

        setattr(comm, name, counted)
    return counts


def _gpt_steps(comm: Any, first: int, rest: int) -> dict[str, Any]:
    from sparkdl.config import TrainConfig
    from sparkdl.model.objectives import LOSSES
    from sparkdl.strategies.data_parallel import DataParallel

    torch.manual_seed(0)
    strategy = DataParallel(comm, None, TrainConfig(overlap_grads=True))
    strategy.first_bucket_bytes, strategy.bucket_bytes = first, rest
    strategy.setup(gpt(), lambda params: torch.optim.AdamW(params, lr=1e-3), LOSSES["cross_entropy"])
    counts = _count_collectives(comm)  # after setup's broadcasts
    generator = torch.Generator().manual_seed(comm.rank)
    per_step = []
    for _ in range(3):
        tokens = torch.randint(0, 256, (4, 65), generator=generator)
        before = dict(counts)
        # Weights of ones, as a fit's token batches carry: the weight total rides in the first bucket.
        strategy.train_step(tokens[:, :-1], tokens[:, 1:], torch.ones(4))
        per_step.append({name: counts[name] - before[name] for name in COUNTED})
    return {"per_step": per_step, "buckets": len(strategy._overlap.buckets)}


@pytest.mark.parametrize("first, rest", [(1 << 20, 25 << 20), (16 << 10, 64 << 10)], ids=["defaults", "several"])
def test_an_overlapped_step_runs_only_its_buckets_allreduces(first: int, rest: int) -> None:
    for rank in run_world(2, _gpt_steps, first, rest, timeout=120):
        expected = {name: 0 for name in COUNTED}
        expected["allreduce_async"] = rank["buckets"]
        assert rank["buckets"] == len(ddp_buckets(list(gpt().parameters()), first, rest))
        assert rank["per_step"] == [expected] * 3


def _weighted_mixed(comm: Any, overlapped: bool) -> dict[str, Any]:
    """A bf16 layer that backward reaches first and an fp32 one: the weight totals 1 + 513 = 514,
    which bf16 holds as 512. Returns the fp32 gradient after averaging and the collectives run."""
    from sparkdl.strategies.grad_overlap import average_gradients
    from sparkdl.strategies.grad_overlap import OverlappedAveraging

    low = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    high = nn.Parameter(torch.ones(4, dtype=torch.float32))
    params = [high, low]  # backward order is reversed: the bf16 bucket is ready (and launched) first
    weight = torch.tensor(1.0 if comm.rank == 0 else 513.0)
    counts = _count_collectives(comm)
    overlap = OverlappedAveraging(params, 1 << 20, 25 << 20) if overlapped else None
    if overlap is not None:
        overlap.arm(comm, weight)
    loss = (high * 514.0).sum() + (low.float() * 514.0).sum()
    loss.backward()
    if overlap is not None:
        overlap.finish()
        overlap.remove()
    else:
        average_gradients(comm, [low, high], weight=weight)
    return {"high": high.grad.tolist(), "low": low.grad.float().tolist(), "counts": dict(counts)}


@pytest.mark.parametrize("overlapped", [True, False], ids=["overlapped", "after_backward"])
def test_the_weight_total_never_travels_in_a_low_precision_bucket(overlapped: bool) -> None:
    for rank in run_world(2, _weighted_mixed, overlapped, timeout=120):
        # each rank's fp32 gradient is 514 a value: summed 1028, over the exact total 514 = 2.0
        # (over bf16's 512 it would be 2.0078)
        assert rank["high"] == [2.0] * 4
        assert rank["low"] == [2.0] * 4
