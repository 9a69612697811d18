"""Data parallel's exposed allreduce as it happens (planner/overlap.py, cost.data_parallel; issue 53
part 1): hand-made timelines, the planner's buckets against grad_overlap.py's, and the model fed
with bucket ready times measured by hooks on a real backward and a real overlapped allreduce on a
2-rank gloo world. Timing agreement is benchmarks/overlap.py's (no timed assertions here)."""
from __future__ import annotations

import time
from typing import Any

import pytest

from sparkdl.planner import cost, overlap
from sparkdl.planner.overlap import Bucket

MBIT = 1e6 / 8


def test_one_bucket_is_all_exposed() -> None:
    # Its last gradient is backward's last: nothing is left to hide behind.
    line = overlap.timeline([Bucket(1000.0, 5.0)], [2.0], 5.0)
    assert line.exposed_s == pytest.approx(2.0)
    assert line.hidden_s == pytest.approx(0.0)


def test_many_small_buckets_on_a_fast_link_expose_only_the_last() -> None:
    ready = [1.0, 2.0, 3.0, 4.0, 5.0]
    transfers = [0.1, 0.1, 0.1, 0.1, 0.3]
    assert overlap.exposed_s(ready, transfers, 5.0) == pytest.approx(0.3)


def test_a_slow_link_is_transfer_bound() -> None:
    # Every transfer queues behind the one before: the link, not backward, sets the end.
    ready = [1.0, 2.0, 3.0, 4.0, 5.0]
    transfers = [2.0] * 5
    starts, ends = overlap.simulate(ready, transfers, 5.0)
    assert starts == pytest.approx([1.0, 3.0, 5.0, 7.0, 9.0])
    assert overlap.exposed_s(ready, transfers, 5.0) == pytest.approx(1.0 + 10.0 - 5.0)


def test_without_overlap_everything_is_exposed() -> None:
    buckets = [Bucket(1.0, 1.0), Bucket(1.0, 3.0), Bucket(1.0, 5.0)]
    assert overlap.timeline(buckets, [0.5, 0.5, 0.5], 5.0, overlapped=False).exposed_s == pytest.approx(1.5)


def test_layer_buckets_close_at_the_thresholds_and_interpolate_within_a_layer() -> None:
    # backward order: a 3-byte layer over 3 s, an activation (0 bytes, 1 s), a 6-byte layer over 2 s
    buckets = overlap.layer_buckets([3.0, 0.0, 6.0], [3.0, 1.0, 2.0], first_bucket_bytes=2, bucket_bytes=4)
    assert [b.nbytes for b in buckets] == [2.0, 4.0, 3.0]
    assert [b.ready_s for b in buckets] == pytest.approx([2.0, 4.0 + 2 * 3 / 6, 6.0])
    assert overlap.bucket_sizes(9.0, 2, 4) == [2.0, 4.0, 3.0]


def test_bucket_sizes_match_the_strategy() -> None:
    from sparkdl.strategies import data_parallel

    assert overlap.FIRST_BUCKET_BYTES == data_parallel.FIRST_BUCKET_BYTES
    assert overlap.BUCKET_BYTES == data_parallel.BUCKET_BYTES == data_parallel.DataParallel.bucket_bytes
    assert data_parallel.DataParallel.first_bucket_bytes == overlap.FIRST_BUCKET_BYTES


def test_measured_buckets_are_grad_overlaps_buckets() -> None:
    from torch import nn

    from sparkdl.strategies.grad_overlap import plan_buckets

    model = fixed_model()
    params = list(model.parameters())
    sizes = [p.numel() * p.element_size() for p in params]
    planned = plan_buckets(params, FIRST, REST)
    measured = overlap.measured_buckets(sizes, [0.0] * len(sizes), FIRST, REST)
    assert [b.nbytes for b in measured] == [sum(sizes[i] for i in bucket) for bucket in planned]
    assert isinstance(model, nn.Sequential)


def issue_workload(flops: float) -> cost.Workload:
    """issue 53's case: 804 KiB of fp32 gradients over 4 layers, two ranks."""
    per_layer = 804 * 1024 // 4 // 4
    layers = tuple(cost.LayerCost(params=per_layer, flops=2.0 * per_layer, out_bytes=512.0, saved_bytes=512.0)
                   for _ in range(4))
    return cost.Workload(layers=layers, world=2, rows=64, flops_per_s=flops, optimizer_bytes_per_param=16)


def test_the_issues_804_kib_at_20_mbit_is_not_hidden() -> None:
    net = cost.Network(latency_s=1e-3, bandwidth_Bps=20 * MBIT)
    work = issue_workload(10.1e9)  # as profiled under load
    estimate = cost.data_parallel(work, net, overlap=1.0)
    whole = cost.allreduce_s(804 * 1024, 2, net)
    # One bucket (under 1 MiB): ready only when backward ends, so all of it is exposed (the old
    # max(0, T_AR - T_bwd) priced it 0 whenever backward took longer than the transfer).
    assert estimate.comm_s == pytest.approx(whole)
    assert estimate.step_s == pytest.approx(estimate.compute_s + whole)
    assert cost.data_parallel(work, net, overlap=0.0).comm_s == pytest.approx(whole)


def test_overlap_hides_all_but_the_last_bucket_when_the_link_keeps_up() -> None:
    # 8 layers of 2 MiB: the first bucket closes in the last layer, the rest (25 MiB) at backward's end.
    layers = tuple(cost.LayerCost(params=512 * 1024, flops=4e9, out_bytes=4.0, saved_bytes=4.0) for _ in range(8))
    work = cost.Workload(layers=layers, world=2, rows=64, flops_per_s=1e11, optimizer_bytes_per_param=16)
    fast = cost.Network(latency_s=1e-5, bandwidth_Bps=10e9)
    line = cost.gradient_timeline(work, fast, overlapped=True)
    assert [b.nbytes for b in line.buckets] == [1 << 20, 15 << 20]
    assert line.buckets[0].ready_s == pytest.approx(line.backward_s / 16)  # half way through the last layer
    assert line.exposed_s == pytest.approx(cost.allreduce_s(15 << 20, 2, fast))
    assert cost.data_parallel(work, fast, 1.0).comm_s < cost.data_parallel(work, fast, 0.0).comm_s


def test_measured_backward_shares_move_the_ready_times() -> None:
    layers = tuple(cost.LayerCost(params=1 << 20, flops=1e9, out_bytes=4.0, saved_bytes=4.0, backward_share=share)
                   for share in (0.9, 0.5))
    work = cost.Workload(layers=layers, world=2, rows=1, flops_per_s=3e9, optimizer_bytes_per_param=16)
    assert cost.backward_layers_s(work) == pytest.approx([0.5, 0.9])  # backward order: the last layer first


def test_the_profile_times_each_layers_backward() -> None:
    from sparkdl.planner.profile import profile_sequential

    profile = profile_sequential(fixed_model(), 64, rows=32, repeats=2)
    assert all(0 < layer.backward_seconds <= layer.seconds for layer in profile.layers)
    assert all(0 < layer.backward_share <= 1 for layer in profile.layers)


# The fixed model: six Linear layers with small buckets so several go out during backward.
FIRST, REST = 64 << 10, 192 << 10
BATCH = 64


def fixed_model() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    hidden = [m for _ in range(4) for m in (nn.Linear(256, 256), nn.ReLU())]
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), *hidden, nn.Linear(256, 10))


def batch() -> tuple[Any, Any]:
    import torch

    generator = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 64, generator=generator), torch.randint(0, 10, (BATCH,), generator=generator)


def test_measured_ready_times_follow_backward_order() -> None:
    import torch.nn.functional as F

    from sparkdl.planner.profile import gradient_times

    x, y = batch()
    times = gradient_times(fixed_model(), x, lambda out: F.cross_entropy(out, y), repeats=2)
    buckets = overlap.measured_buckets(times.param_bytes, times.ready_s, FIRST, REST)
    assert len(buckets) >= 3
    ready = [b.ready_s for b in buckets]
    assert ready == sorted(ready) and all(0 < r <= times.backward_s for r in ready)
    # The first layer's gradients (weight and bias) come last: the last bucket holds them.
    assert max(times.ready_s[:2]) == max(times.ready_s) == ready[-1]


class _Recording:
    """A communicator that notes when each bucket's allreduce starts (what OverlappedAveraging calls)."""

    def __init__(self, comm: Any) -> None:
        self.comm, self.launched = comm, []

    def allreduce_async(self, tensor: Any, op: str = "sum") -> Any:
        self.launched.append((time.perf_counter(), tensor.numel() * tensor.element_size()))
        return self.comm.allreduce_async(tensor, op=op)


def _overlapped_step(comm: Any) -> dict[str, Any]:
    """On each rank: a real backward with grad_overlap.py's buckets and the real gloo allreduce."""
    import torch.nn.functional as F

    from sparkdl.strategies.grad_overlap import OverlappedAveraging

    model = fixed_model()
    params = list(model.parameters())
    stamps = [0.0] * len(params)
    # Registered before the strategy's own hooks, so a gradient is stamped before its bucket launches.
    hooks = [p.register_post_accumulate_grad_hook(lambda _p, i=i: stamps.__setitem__(i, time.perf_counter()))
             for i, p in enumerate(params)]
    averaging = OverlappedAveraging(params, FIRST, REST)
    x, y = batch()
    group = _Recording(comm)
    result: dict[str, Any] = {}
    for _ in range(3):  # the last step counts; the first warm up kernels and the link
        comm.barrier()
        group.launched = []
        loss = F.cross_entropy(model(x), y)
        averaging.arm(group)  # type: ignore[arg-type]
        started = time.perf_counter()
        loss.backward()
        backward_end = time.perf_counter()
        averaging.finish()
        finished = time.perf_counter()
        result = {"ready": [s - started for s in stamps], "bytes": [p.numel() * 4 for p in params],
                  "launched": [(t - started, n) for t, n in group.launched], "backward_s": backward_end - started,
                  "exposed_s": finished - backward_end, "in_backward": averaging.started_in_backward}
        for p in params:
            p.grad = None
    for hook in hooks:
        hook.remove()
    averaging.remove()
    return result


def test_the_overlap_model_against_a_real_overlapped_allreduce() -> None:
    from gloo_world import run_world

    for rank in run_world(2, _overlapped_step):
        buckets = overlap.measured_buckets(rank["bytes"], rank["ready"], FIRST, REST)
        launched = rank["launched"]
        # Every bucket started during backward, in the model's order, as soon as it was ready.
        assert rank["in_backward"] == len(buckets) == len(launched)
        assert [n for _, n in launched] == [int(b.nbytes) for b in buckets]
        assert all(t >= b.ready_s for (t, _), b in zip(launched, buckets))
        assert [t for t, _ in launched] == sorted(t for t, _ in launched)
        # The last bucket is ready with backward's last gradient: only backward's own tail (the
        # engine's wind-down after the hook) is left to hide it, so finish() waits for it.
        assert buckets[-1].ready_s == max(rank["ready"]) <= rank["backward_s"]
        assert rank["exposed_s"] > 0
        # The model fed with these ready times: what a transfer longer than that tail leaves exposed.
        tail = rank["backward_s"] - buckets[-1].ready_s
        transfers = [0.0] * (len(buckets) - 1) + [tail + 1e-3]
        assert overlap.exposed_s([b.ready_s for b in buckets], transfers, rank["backward_s"]) == pytest.approx(1e-3)


def test_the_overlap_note_says_what_is_exposed() -> None:
    net = cost.Network(latency_s=1e-3, bandwidth_Bps=20 * MBIT)
    note = cost.overlap_note(issue_workload(10.1e9), net, 1.0)
    whole = cost.allreduce_s(804 * 1024, 2, net) * 1e3
    assert note.startswith("1 gradient bucket overlapped with backward")
    assert f"{whole:.2f} ms on the link, {whole:.2f} ms of it exposed" in note


def test_a_transfer_beside_backward_runs_slower_until_backward_ends() -> None:
    # Ready at 1 s, 2 s of transfer, backward ends at 3 s: at half speed for 2 s (1 s of work done),
    # the remaining 1 s after backward.
    assert overlap.exposed_s([1.0], [2.0], 3.0, busy_slowdown=2.0) == pytest.approx(1.0)
    assert overlap.exposed_s([1.0], [0.5], 3.0, busy_slowdown=2.0) == pytest.approx(0.0)  # done at 2 s
    assert overlap.exposed_s([1.0], [2.0], 3.0) == pytest.approx(0.0)
    # Through the cost model: the network's measured slowdown moves the first bucket past backward.
    layers = tuple(cost.LayerCost(params=512 * 1024, flops=4e9, out_bytes=4.0, saved_bytes=4.0) for _ in range(8))
    work = cost.Workload(layers=layers, world=2, rows=1, flops_per_s=1e11, optimizer_bytes_per_param=16)
    quiet = cost.Network(latency_s=1e-3, bandwidth_Bps=100 * MBIT)  # the first bucket: 86 ms of 640 ms
    busy = cost.Network(latency_s=1e-3, bandwidth_Bps=100 * MBIT, busy_slowdown=10.0)
    assert cost.data_parallel(work, busy, 1.0).comm_s > cost.data_parallel(work, quiet, 1.0).comm_s
