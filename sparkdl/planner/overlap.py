"""How much of data parallel's gradient averaging backward really hides (issue 53, part 1).

strategies/grad_overlap.py puts the gradients in buckets in backward order (the first closed at
FIRST_BUCKET_BYTES, the others at BUCKET_BYTES) and starts a bucket's allreduce once backward has
produced its last gradient. The link carries one transfer at a time, in that order, so:

    ready_i  = when backward has produced bucket i's last gradient
    start_i  = max(ready_i, end_{i-1});  end_i = start_i + transfer_i
    exposed  = max(0, end_last - backward)

The last bucket holds the first layers' gradients, which backward produces last: it never hides,
and a slow link queues every earlier bucket behind its predecessors (transfer-bound). Without
overlap (train.overlap_grads false, Horovod's own averaging, an emulated network) every bucket
starts after backward: everything is exposed.

Standard library only, like planner/cost.py: times in seconds, sizes in bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

# strategies/data_parallel.py's bucket sizes (a unit test keeps the two equal; this module
# cannot import torch code).
FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20


@dataclass(frozen=True)
class Bucket:
    nbytes: float
    ready_s: float  # since backward started: when its last gradient was produced


@dataclass(frozen=True)
class Timeline:
    """One simulated step's communication: each bucket's start and end on the link."""

    backward_s: float
    buckets: tuple[Bucket, ...]
    starts: tuple[float, ...]
    ends: tuple[float, ...]

    @property
    def exposed_s(self) -> float:
        """What the step waits for after backward: the last transfer's end past backward's."""
        return max(0.0, (self.ends[-1] if self.ends else 0.0) - self.backward_s)

    @property
    def hidden_s(self) -> float:
        return sum(e - s for s, e in zip(self.starts, self.ends)) - self.exposed_s


def simulate(ready_s: Sequence[float], transfer_s: Sequence[float], backward_s: float,
             busy_slowdown: float = 1.0) -> tuple[list[float], list[float]]:
    """(starts, ends) of transfers that wait for their bucket and for the link (one at a time, in
    the order given: the buckets' fixed launch order, which is their ready order). `busy_slowdown`:
    how much longer a transfer takes while backward computes beside it on the same host (gloo's
    thread copies and reduces on the CPU backward is using; 1: not slowed)."""
    starts, ends = [], []
    link_free = 0.0
    for ready, transfer in zip(ready_s, transfer_s):
        start = max(ready, link_free, 0.0)
        link_free = _finish(start, transfer, backward_s, max(busy_slowdown, 1.0))
        starts.append(start)
        ends.append(link_free)
    return starts, ends


def _finish(start: float, transfer: float, backward_s: float, slowdown: float) -> float:
    """When a transfer of `transfer` idle seconds started at `start` ends: at 1/slowdown speed
    until backward ends, at full speed after."""
    busy = max(0.0, backward_s - start)
    if transfer * slowdown <= busy:
        return start + transfer * slowdown
    return start + busy + (transfer - busy / slowdown)


def exposed_s(ready_s: Sequence[float], transfer_s: Sequence[float], backward_s: float,
              busy_slowdown: float = 1.0) -> float:
    """The simulated wait after backward (the module docstring's rule)."""
    ends = simulate(ready_s, transfer_s, backward_s, busy_slowdown)[1]
    return max(0.0, (ends[-1] if ends else 0.0) - backward_s)


def bucket_sizes(grad_bytes: float, first_bucket_bytes: float = FIRST_BUCKET_BYTES,
                 bucket_bytes: float = BUCKET_BYTES) -> list[float]:
    """The buckets' sizes in launch order, the gradient bytes cut as a stream (a tensor never
    straddles two buckets in grad_overlap.py, so real buckets run over by up to one tensor)."""
    sizes: list[float] = []
    left = float(grad_bytes)
    while left > 0:
        size = min(left, first_bucket_bytes if not sizes else bucket_bytes)
        sizes.append(size)
        left -= size
    return sizes


def layer_buckets(layer_bytes: Sequence[float], layer_backward_s: Sequence[float],
                  first_bucket_bytes: float = FIRST_BUCKET_BYTES, bucket_bytes: float = BUCKET_BYTES
                  ) -> list[Bucket]:
    """Buckets with their ready times, from each layer's gradient bytes and backward time, both in
    BACKWARD order (the last layer first). Within a layer its gradients are taken to arrive evenly
    over its backward (a block's tensors finish one after another), so a bucket that closes a
    fraction f into a layer's bytes is ready f into its backward. A layer without gradients (an
    activation, a frozen base) only adds time."""
    buckets: list[Bucket] = []
    clock = 0.0
    filled, threshold = 0.0, float(first_bucket_bytes)
    for nbytes, seconds in zip(layer_bytes, layer_backward_s):
        taken = 0.0
        while nbytes - taken >= threshold - filled > 0:
            taken += threshold - filled
            buckets.append(Bucket(threshold, clock + seconds * taken / nbytes))
            filled, threshold = 0.0, float(bucket_bytes)
        filled += nbytes - taken
        clock += seconds
    if filled > 0:
        buckets.append(Bucket(filled, clock))
    return buckets


def timeline(buckets: Sequence[Bucket], transfer_s: Sequence[float], backward_s: float,
             overlapped: bool = True, busy_slowdown: float = 1.0) -> Timeline:
    """Simulate `buckets` (launch order); not overlapped: every one waits for backward's end."""
    ready = [b.ready_s if overlapped else backward_s for b in buckets]
    starts, ends = simulate(ready, transfer_s, backward_s, busy_slowdown)
    return Timeline(backward_s, tuple(buckets), tuple(starts), tuple(ends))


def measured_buckets(param_bytes: Sequence[float], param_ready_s: Sequence[float],
                     first_bucket_bytes: float = FIRST_BUCKET_BYTES, bucket_bytes: float = BUCKET_BYTES
                     ) -> list[Bucket]:
    """Buckets as grad_overlap.plan_buckets makes them (one dtype), from each parameter's bytes and
    the measured time its gradient was produced, both in the model's parameter order: reverse
    order, a bucket closed once it holds its threshold, ready when its last gradient is (and not
    before the bucket ahead of it: launches keep their order)."""
    buckets: list[Bucket] = []
    size, ready = 0.0, 0.0
    for index in reversed(range(len(param_bytes))):
        size += param_bytes[index]
        ready = max(ready, param_ready_s[index])
        if size >= (first_bucket_bytes if not buckets else bucket_bytes):
            buckets.append(Bucket(size, ready))
            size = 0.0
    if size > 0:
        buckets.append(Bucket(size, ready))
    return buckets
