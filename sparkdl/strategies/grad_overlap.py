"""Gradient averaging overlapped with backward, as DistributedDataParallel's reducer does it.

Parameters are put in buckets once, at setup, in reverse parameter order (roughly the order in which
backward finishes their gradients; the first bucket small, so communication starts early), as DDP's
reducer has them after its first step. A
post-accumulate-grad hook per parameter counts the bucket's gradients as they become final; bucket i
starts its asynchronous allreduce once it and every bucket before it are complete, so every rank
starts the same buffers in the same order whatever order its hooks fired in (a branch unused on
one rank only delays the buckets from that one on; their allreduces start at the end of backward,
its gradients as zeros). `finish()` starts what is left, waits, divides and copies the averages
back before the optimizer step. The hooks act only while armed (the last micro-batch of a window).
`average_gradients` is the same averaging after backward (overlap off, hybrid's stage groups); both
carry the weight total by one rule (`rides_exactly`, `summed_weight`).
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from sparkdl.comm.base import Communicator, PendingReduce

BUCKET_BYTES = 25 << 20
FIRST_BUCKET_BYTES = 1 << 20  # overlapped: the last layers' bucket goes out early (DDP's first bucket too)


def plan_buckets(params: list[nn.Parameter], first_bucket_bytes: int, bucket_bytes: int) -> list[list[int]]:
    """Indices into `params`, bucket by bucket in launch order, as DDP's reducer rebuilds its buckets
    after its first step (torch's compute_bucket_assignment_by_size on the gradients' ready order):
    reverse parameter order, one dtype a bucket, each dtype's first bucket closed at
    `first_bucket_bytes`, its later ones at `bucket_bytes`; buckets in the order they close, those
    never filled after them. The same on every rank (it depends on the parameters' shapes and dtypes
    only). Launch order is by closing, not opening: buckets go out strictly in order, and a bucket of a
    rare dtype opened early but filled only by the first layers would hold back every full one."""
    closed: list[list[int]] = []
    filling: dict[torch.dtype, list[int]] = {}  # dtype -> its open bucket (dicts keep opening order)
    size: dict[torch.dtype, int] = {}
    closed_of: dict[torch.dtype, int] = {}
    for index in reversed(range(len(params))):
        param = params[index]
        dtype = param.dtype
        filling.setdefault(dtype, []).append(index)
        size[dtype] = size.get(dtype, 0) + param.numel() * param.element_size()
        if size[dtype] >= (first_bucket_bytes if not closed_of.get(dtype) else bucket_bytes):
            closed.append(filling.pop(dtype))
            size[dtype] = 0
            closed_of[dtype] = closed_of.get(dtype, 0) + 1
    return closed + list(filling.values())


class OverlappedAveraging:
    def __init__(self, params: list[nn.Parameter], first_bucket_bytes: int, bucket_bytes: int) -> None:
        self._params = params
        self.buckets = plan_buckets(params, first_bucket_bytes, bucket_bytes)
        self._bucket_of = [0] * len(params)
        for number, indices in enumerate(self.buckets):
            for index in indices:
                self._bucket_of[index] = number
        self._group: Communicator | None = None
        self._weight: torch.Tensor | None = None  # this rank's weight total, riding in the carrier bucket
        self._total: torch.Tensor | None = None  # the group's total, summed apart (a low-precision first bucket)
        self._weighted = False
        self._missing: list[int] = []
        self._seen: list[bool] = []
        self._next = 0
        self._pending: list[PendingReduce] = []
        self.started_in_backward = 0  # buckets of the last armed step whose allreduce started during backward
        # The first bucket whose dtype holds the weight total exactly carries it (None: all low precision)
        self._carrier = next((number for number, indices in enumerate(self.buckets)
                              if rides_exactly(params[indices[0]].dtype)), None)
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._ready, index))
                       for index, p in enumerate(params)]

    @property
    def armed(self) -> bool:
        return self._group is not None

    def arm(self, group: Communicator, weight: torch.Tensor | None = None) -> None:
        """Average over `group` during the next backward. `weight`: this rank's weight total (its
        gradients are those of sum(w * l)); it rides in the first bucket when that bucket's dtype holds
        it exactly (else it is summed in fp32 now), the gradients are summed and divided by the group's
        total instead of averaged."""
        self._group, self._weight, self._total = group, weight, None
        self._weighted = weight is not None
        if weight is not None and self._carrier is None:
            self._total, self._weight = summed_weight(group, weight), None
        self._missing = [len(indices) for indices in self.buckets]
        self._seen = [False] * len(self._params)
        self._next = 0
        self._pending = []
        self.started_in_backward = 0

    def disarm(self) -> None:
        """Forget this step (a backward that failed); whatever was started is left to finish."""
        self._group, self._weight, self._total, self._weighted, self._pending = None, None, None, False, []

    def _ready(self, index: int, param: torch.Tensor) -> None:
        if self._group is None or self._seen[index]:
            return
        self._seen[index] = True
        number = self._bucket_of[index]
        self._missing[number] -= 1
        while self._next < len(self.buckets) and self._missing[self._next] == 0:
            self._launch(self._next)
            self.started_in_backward += 1

    def _launch(self, number: int) -> None:
        assert self._group is not None and number == self._next
        self._next += 1
        with torch.no_grad():
            pieces = []
            for index in self.buckets[number]:
                param = self._params[index]
                if param.grad is None:
                    # Every rank must contribute the same buffer layout, even for a branch unused this step.
                    param.grad = torch.zeros_like(param)
                pieces.append(param.grad.reshape(-1))
            if number == self._carrier and self._weight is not None:
                pieces.append(self._weight.detach().reshape(1).to(pieces[0].dtype))
            flat = torch.cat(pieces)
        self._pending.append(self._group.allreduce_async(flat, op="sum" if self._weighted else "avg"))

    def finish(self) -> None:
        """Start the buckets backward left (in their fixed order), wait for all, write the averages
        into the gradients."""
        if self._group is None:
            return
        while self._next < len(self.buckets):
            self._launch(self._next)
        weighted = self._weighted
        pending, self._pending = self._pending, []
        total = self._total
        self._group, self._weight, self._total, self._weighted = None, None, None, False
        flats = [work.wait() for work in pending]
        with torch.no_grad():
            if weighted and total is None:
                total = flats[self._carrier][-1].clone().to(torch.float32).clamp_min(torch.finfo(torch.float32).tiny)
            for number, flat in enumerate(flats):
                indices = self.buckets[number]
                if weighted:
                    flat.div_(total.to(flat.dtype))
                offset = 0
                for index in indices:
                    grad = self._params[index].grad
                    assert grad is not None
                    grad.copy_(flat[offset: offset + grad.numel()].view_as(grad))
                    offset += grad.numel()

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def describe(self) -> dict[str, Any]:
        return {"buckets": len(self.buckets),
                "bucket_bytes": [sum(self._params[i].numel() * self._params[i].element_size() for i in b)
                                 for b in self.buckets]}


EXACT_TOTAL_DTYPES = (torch.float32, torch.float64)  # hold a weight or token total exactly (to 2**24)


def rides_exactly(dtype: torch.dtype) -> bool:
    """Whether a bucket of `dtype` may carry the weight total: bf16 rounds counts above 256 and fp16
    above 2048, which would skew the loss normalisation of a low-precision model."""
    return dtype in EXACT_TOTAL_DTYPES


def summed_weight(group: Communicator, weight: torch.Tensor) -> torch.Tensor:
    """The group's weight total in fp32, in a collective of its own (only where no bucket holds it
    exactly: one more round of latency a step)."""
    total = group.allreduce(weight.detach().reshape(1).to(torch.float32).clone(), op="sum")
    return total[0].clamp_min(torch.finfo(torch.float32).tiny)


def average_gradients(comm: Communicator, params: list[nn.Parameter], bucket_bytes: int = BUCKET_BYTES,
                      weight: torch.Tensor | None = None) -> None:
    """Gradients averaged over the ranks; with `weight` (this rank's sum of row weights, its
    gradients those of sum(w * l)), summed and divided by the ranks' total weight instead: the
    gradient of the global weighted mean, with the total riding in the first bucket's allreduce
    rather than in a collective of its own (each costs a round of latency on slow or busy hosts)."""
    bucket: list[nn.Parameter] = []
    size = 0
    total: list[torch.Tensor] = []
    for param in params:
        if param.grad is None:
            # Every rank must contribute the same buffer layout, even for a branch unused this step.
            param.grad = torch.zeros_like(param)
        bucket.append(param)
        size += param.grad.numel() * param.grad.element_size()
        if size >= bucket_bytes:
            _reduce_bucket(comm, bucket, weight, total)
            bucket, size = [], 0
    if bucket:
        _reduce_bucket(comm, bucket, weight, total)


def _reduce_bucket(comm: Communicator, bucket: list[nn.Parameter], weight: torch.Tensor | None,
                   total: list[torch.Tensor]) -> None:
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for param in bucket:
        by_dtype.setdefault(param.grad.dtype, []).append(param)
    for dtype, params in by_dtype.items():
        grads = [p.grad for p in params]
        pieces = [g.reshape(-1) for g in grads]
        if weight is not None and not total and not rides_exactly(dtype):
            total.append(summed_weight(comm, weight))  # a low-precision bucket would round it
        carries = weight is not None and not total
        if carries:
            pieces.append(weight.detach().reshape(1).to(pieces[0].dtype))
        flat = torch.cat(pieces)
        comm.allreduce(flat, op="sum" if weight is not None else "avg")
        if carries:
            total.append(flat[-1].clone().to(torch.float32).clamp_min(torch.finfo(torch.float32).tiny))
        if weight is not None:
            flat.div_(total[0].to(flat.dtype))
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset: offset + grad.numel()].view_as(grad))
            offset += grad.numel()
