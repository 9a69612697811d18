"""The planner's cost model (ALGORITHMS.md, "Planner cost model"): step time, bytes sent per rank per
step and memory per rank of each candidate layout. Pure functions over plain numbers; standard
library only, so the planner's decisions are unit-tested in milliseconds.

Units: seconds, bytes, FLOPs. `rows` is the batch of one rank (batch_size); every strategy consumes
W x rows rows per step. With gradient accumulation a step is one micro-batch, and the gradient
synchronisation (not the pipeline's boundary traffic) is paid once per `accumulate` steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from sparkdl.planner.overlap import BUCKET_BYTES, Bucket, Timeline, bucket_sizes, layer_buckets, timeline


@dataclass(frozen=True)
class LayerCost:
    params: int  # trainable: what gradients, optimizer state and synchronisation carry
    flops: float  # forward FLOPs per row
    out_bytes: float  # per row: what crosses a stage boundary after this layer
    saved_bytes: float  # per row: activations kept for backward
    kind: str = ""
    in_features: int = 0  # Linear layers: for IST's subnet sizes
    out_features: int = 0
    overhead_s: float = 0.0  # per forward + backward call, whatever the rows (launch, Python, small kernels)
    frozen_params: int = 0  # held but never trained or sent (a PEFT adapter's base): weights only
    # The share of the layer's forward + backward spent in backward: measured on the driver where
    # profiled (planner/profile.py), else backward's 2 of the 3 forward-sized products.
    backward_share: float = 2.0 / 3.0


@dataclass(frozen=True)
class Network:
    latency_s: float
    bandwidth_Bps: float  # bytes per second between two ranks
    # A collective's own effective latency per ring hop and bandwidth, when measured: a backend's
    # allreduce pays for chunking, copies and the reduction on top of the links (0: the link's).
    collective_latency_s: float = 0.0
    collective_bandwidth_Bps: float = 0.0
    # How much longer a collective takes while the rank computes beside it (measured: a background
    # allreduce shares the host's CPU with backward; 1: not slowed). Prices overlap (planner/overlap.py).
    busy_slowdown: float = 1.0

    @property
    def ring(self) -> tuple[float, float]:
        """(latency, bandwidth) of one ring hop of a collective."""
        return (max(self.latency_s, self.collective_latency_s),
                min(self.bandwidth_Bps, self.collective_bandwidth_Bps or self.bandwidth_Bps))


@dataclass(frozen=True)
class Workload:
    layers: tuple[LayerCost, ...]
    world: int
    rows: int  # per rank per step
    flops_per_s: float  # one rank's sustained FLOP/s on this model's work
    optimizer_bytes_per_param: int  # parameter + gradient + optimizer state
    input_bytes_per_row: float = 0.0
    param_bytes: int = 4
    step_overhead_s: float = 0.0  # per step, beyond the layers: loss, optimizer update, zero_grad
    accumulate: int = 1  # train.accumulate_steps: gradients are synchronised once per this many steps

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers)

    @property
    def frozen_bytes(self) -> float:
        return float(sum(layer.frozen_params for layer in self.layers) * self.param_bytes)

    @property
    def flops_per_row(self) -> float:
        return sum(layer.flops for layer in self.layers)


@dataclass(frozen=True)
class Estimate:
    step_s: float
    compute_s: float
    comm_s: float
    bytes_per_step: float  # sent by one rank, per step (averaged over a sync period)
    memory_bytes: float  # per rank, the largest rank


def compute_s(flops_per_row: float, rows: float, flops_per_s: float, overhead_s: float = 0.0) -> float:
    """Forward + backward ~ 3 x forward FLOPs, plus the layers' fixed per-call cost."""
    return overhead_s + 3.0 * rows * flops_per_row / flops_per_s


def layers_compute_s(layers: Sequence[LayerCost], rows: float, flops_per_s: float) -> float:
    return compute_s(sum(l.flops for l in layers), rows, flops_per_s, sum(l.overhead_s for l in layers))


def allreduce_s(nbytes: float, world: int, net: Network) -> float:
    """Ring allreduce: 2(W-1) latencies and 2(W-1)/W of the buffer over the slowest link."""
    if world <= 1:
        return 0.0
    latency, bandwidth = net.ring
    return 2 * (world - 1) * latency + 2 * (world - 1) / world * nbytes / bandwidth


def allreduce_bytes(nbytes: float, world: int) -> float:
    return 2 * (world - 1) / world * nbytes if world > 1 else 0.0


def backward_layers_s(work: Workload) -> list[float]:
    """Each layer's backward time for one rank's rows, in BACKWARD order (the last layer first)."""
    return [layers_compute_s([layer], work.rows, work.flops_per_s) * layer.backward_share
            for layer in reversed(work.layers)]


def gradient_timeline(work: Workload, net: Network, overlapped: bool) -> Timeline:
    """Data parallel's gradient buckets on the link in one synchronising step (planner/overlap.py):
    overlapped, grad_overlap.py's buckets, each ready when backward has produced its gradients;
    else average_gradients' buckets (BUCKET_BYTES each), all after backward."""
    backward = backward_layers_s(work)
    grads = [layer.params * work.param_bytes for layer in reversed(work.layers)]
    if overlapped:
        buckets = layer_buckets(grads, backward)
    else:
        buckets = [Bucket(size, sum(backward)) for size in
                   bucket_sizes(sum(grads), BUCKET_BYTES, BUCKET_BYTES)]
    transfers = [allreduce_s(bucket.nbytes, work.world, net) for bucket in buckets]
    return timeline(buckets, transfers, sum(backward), overlapped, net.busy_slowdown)



def overlap_note(work: Workload, net: Network, overlap: float = 0.0) -> str:
    """For explain(): how data parallel's gradient buckets meet backward, e.g. "2 gradient buckets,
    1.06 s on the link, 1.05 s of it exposed (the last bucket: 0.62 s, ready as backward ends)"."""
    line = gradient_timeline(work, net, overlap > 0)
    if not line.buckets or work.world <= 1:
        return ""
    on_link = sum(e - s for s, e in zip(line.starts, line.ends))
    how = "overlapped with backward" if overlap > 0 else "after backward"
    return (f"{len(line.buckets)} gradient bucket{'s' if len(line.buckets) > 1 else ''} {how}, "
            f"{on_link * 1e3:.2f} ms on the link, {line.exposed_s * 1e3:.2f} ms of it exposed "
            f"(the last bucket alone {(line.ends[-1] - line.starts[-1]) * 1e3:.2f} ms)")

def data_parallel(work: Workload, net: Network, overlap: float = 0.0) -> Estimate:
    """T = C(B/W) + exposed allreduce. `overlap` > 0 when gradient buckets are reduced during
    backward (train.overlap_grads on torch): each bucket's allreduce then starts once backward has
    produced it and the link is free, and only what runs past backward's end is exposed (the last
    bucket always); 0 when every bucket is averaged after backward (planner/overlap.py)."""
    compute = layers_compute_s(work.layers, work.rows, work.flops_per_s) + work.step_overhead_s
    grad_bytes = work.params * work.param_bytes
    exposed = gradient_timeline(work, net, overlap > 0).exposed_s / work.accumulate
    memory = work.params * work.optimizer_bytes_per_param + work.frozen_bytes \
        + work.rows * sum(l.saved_bytes for l in work.layers)
    return Estimate(compute + exposed, compute, exposed, allreduce_bytes(grad_bytes, work.world) / work.accumulate,
                    memory)


@dataclass(frozen=True)
class OuterWire:
    """How DiLoCo's outer sync travels: bits per value on the wire (block scales included; a ring
    whose partial sums travel encoded), the fragments P it is cut into and the inner steps tau each
    fragment's sync overlaps."""

    bits: float = 32.0
    fragments: int = 1
    delay: int = 0
    residual_bytes_per_param: int = 0  # error feedback keeps one fp32 value per parameter


def outer_sync_s(values: float, replicas: int, net: Network, wire: OuterWire) -> tuple[float, float]:
    """(seconds, bytes one rank sends) to average `values` over `replicas` as `wire` says."""
    if replicas <= 1:
        return 0.0, 0.0
    encoded = values * wire.bits / 8
    return allreduce_s(encoded, replicas, net), allreduce_bytes(encoded, replicas)


def diloco(work: Workload, net: Network, every: int, wire: OuterWire = OuterWire()) -> Estimate:
    """T = C(B/W) + P x max(0, T_sync(P_frag) - tau x C) / H: each of the P fragments syncs once per
    H steps, overlapped with the tau inner steps that follow it (Streaming DiLoCo); tau = 0, P = 1
    is DiLoCo's T_AR / H. The global copy and outer momentum add 8 bytes per parameter, error
    feedback 4 more, a fragment in flight its fp32 mean."""
    compute = layers_compute_s(work.layers, work.rows, work.flops_per_s) + work.step_overhead_s
    rounds = every * work.accumulate  # sync_every counts optimizer steps
    fragment_s, fragment_bytes = outer_sync_s(work.params / wire.fragments, work.world, net, wire)
    exposed = max(0.0, fragment_s - wire.delay * compute * work.accumulate)
    comm = wire.fragments * exposed / rounds
    memory = work.params * (work.optimizer_bytes_per_param + 8 + wire.residual_bytes_per_param) \
        + (4 * work.params / wire.fragments if wire.delay else 0) + work.rows * sum(l.saved_bytes for l in work.layers) \
        + work.frozen_bytes
    return Estimate(compute + comm, compute, comm, wire.fragments * fragment_bytes / rounds, memory)


def islands(work: Workload, inside: Network, across: Network, sizes: Sequence[int], every: int,
            wire: OuterWire = OuterWire()) -> Estimate:
    """Islands of `sizes` ranks: data parallel inside each (T_AR of the gradients over the largest
    island's links, every step), DiLoCo across: the smallest island's D members each average 1/D of
    every fragment with their counterparts in the other K islands (in parallel, over the links
    across), then share the chunks inside their island (D broadcasts)."""
    compute = layers_compute_s(work.layers, work.rows, work.flops_per_s) + work.step_overhead_s
    grad_bytes = work.params * work.param_bytes
    largest, shards = max(sizes), min(sizes)
    step_sync = allreduce_s(grad_bytes, largest, inside) / work.accumulate
    chunk = work.params / wire.fragments / shards
    cross_s, cross_bytes = outer_sync_s(chunk, len(sizes), across, wire)
    latency, bandwidth = inside.ring
    share_s = shards * (latency + 4 * chunk / bandwidth) if largest > 1 else 0.0
    rounds = every * work.accumulate
    exposed = max(0.0, cross_s + share_s - wire.delay * (compute + step_sync) * work.accumulate)
    comm = step_sync + wire.fragments * exposed / rounds
    sent = allreduce_bytes(grad_bytes, largest) / work.accumulate \
        + wire.fragments * (cross_bytes + (largest - 1) * 4 * chunk) / rounds
    memory = work.params * (work.optimizer_bytes_per_param + 8 + wire.residual_bytes_per_param) \
        + (4 * work.params / wire.fragments if wire.delay else 0) + work.rows * sum(l.saved_bytes for l in work.layers) \
        + work.frozen_bytes
    return Estimate(compute + comm, compute, comm, sent, memory)


def sharded(work: Workload, net: Network) -> Estimate:
    """Sharded data parallel (strategies/sharded.py), per top-level layer l of P_l bytes: two
    all-gathers ((W-1)/W P_l each, W-1 hops) and the gradients' reduction (an allreduce on gloo:
    2(W-1)/W P_l), none overlapped with compute: T = C(B/W) + C_fwd(all layers but the last, the
    recomputation) + sum_l (2 T_AG(P_l) + T_AR(P_l)). Bytes: 2x data parallel's. Memory: 1/W of
    the parameters, gradients and optimizer state, two fp32 buffers of the largest layer, every
    layer's input for the batch and the largest layer's own activations."""
    forward_again = layers_compute_s(work.layers[:-1], work.rows, work.flops_per_s) / 3.0  # forward ~ 1/3
    compute = layers_compute_s(work.layers, work.rows, work.flops_per_s) + work.step_overhead_s + forward_again
    if work.world <= 1:
        gather_s, gather_bytes = 0.0, 0.0
    else:
        latency, bandwidth = net.ring
        gather_s = sum((work.world - 1) * latency + (work.world - 1) / work.world * l.params * work.param_bytes
                       / bandwidth for l in work.layers)
        gather_bytes = (work.world - 1) / work.world * work.params * work.param_bytes
    reduce_s = sum(allreduce_s(l.params * work.param_bytes, work.world, net) for l in work.layers)
    # The reduction runs every micro-batch (a rank keeps no full gradients to accumulate into).
    comm = 2 * gather_s + reduce_s
    sent = 2 * gather_bytes + allreduce_bytes(work.params * work.param_bytes, work.world)
    largest = max((l.params for l in work.layers), default=0)
    memory = ((work.params * work.optimizer_bytes_per_param + work.frozen_bytes) / max(work.world, 1) + 8 * largest
              + work.rows * (sum(l.out_bytes for l in work.layers[:-1])
                             + max((l.saved_bytes for l in work.layers), default=0.0)))
    return Estimate(compute + comm, compute, comm, sent, memory)


def stage_of_cuts(cuts: Sequence[int]) -> list[range]:
    return [range(cuts[k], cuts[k + 1]) for k in range(len(cuts) - 1)]


def hybrid(work: Workload, net: Network, cuts: Sequence[int], microbatches: int, one_f_one_b: bool = True
           ) -> Estimate:
    """T = (m-1) max_k s_k + sum_k t_k + 2 sum_k c_k + max_k T_AR(stage k, D) + the per-step gather
    of the replica's features (first stage) and labels (last stage), where t_k is stage k's forward +
    backward of one micro-batch, c_k one message over boundary k, and s_k = t_k + c_k + c_{k-1}: a
    stage sends its output forward and its input's gradient backward (links are full duplex, so the
    two directions do not queue behind each other; ALGORITHMS.md's 2 c_k counts both on one link)."""
    stages = len(cuts) - 1
    replicas = work.world // stages
    replica_rows = stages * work.rows
    micro_rows = replica_rows / microbatches
    layers = [work.layers[r.start: r.stop] for r in stage_of_cuts(cuts)]
    t = [layers_compute_s(stage, micro_rows, work.flops_per_s) for stage in layers]
    c = [net.latency_s + micro_rows * stage[-1].out_bytes / net.bandwidth_Bps for stage in layers[:-1]] + [0.0]
    s = [t[k] + c[k] + (c[k - 1] if k > 0 else 0.0) for k in range(stages)]
    pipeline = (microbatches - 1) * max(s) + sum(t) + 2 * sum(c)
    stage_grad_bytes = [sum(l.params for l in stage) * work.param_bytes for stage in layers]
    sync = max(allreduce_s(nbytes, replicas, net) for nbytes in stage_grad_bytes) / work.accumulate
    gather = (stages - 1) * (net.latency_s + work.rows * (work.input_bytes_per_row + 8) / net.bandwidth_Bps)
    # The update outside the pipeline: the largest stage's share of the per-step overhead.
    update = work.step_overhead_s * max(sum(l.params for l in stage) for stage in layers) / max(work.params, 1)
    step = pipeline + sync + gather + update
    compute = sum(t) + (microbatches - 1) * max(t) + update
    boundary_bytes = [micro_rows * stage[-1].out_bytes * microbatches * 2 for stage in layers[:-1]] + [0.0]
    sent = max(b + allreduce_bytes(g, replicas) / work.accumulate for b, g in zip(boundary_bytes, stage_grad_bytes)) \
        + work.rows * (work.input_bytes_per_row + 8)
    memory = []
    for k, stage in enumerate(layers):
        in_flight = min(stages - k, microbatches) if one_f_one_b else microbatches
        memory.append(sum(l.params for l in stage) * work.optimizer_bytes_per_param
                      + sum(l.frozen_params for l in stage) * work.param_bytes
                      + in_flight * micro_rows * sum(l.saved_bytes for l in stage))
    return Estimate(step, compute, step - compute, sent, max(memory))


def ist_subnet_params(work: Workload) -> float:
    """d n1/W + sum n_l n_{l+1}/W^2 + n c/W (+ biases): the parameters one rank trains per round."""
    linears = [l for l in work.layers if l.kind == "Linear"]
    w = work.world
    total = 0.0
    for index, layer in enumerate(linears):
        inputs = layer.in_features / (w if index > 0 else 1)
        outputs = layer.out_features / (w if index < len(linears) - 1 else 1)
        total += inputs * outputs + outputs
    return total


def ist(work: Workload, net: Network, every: int, subnet: Sequence[LayerCost] | None = None,
        measured: tuple[float, float] = (0.0, 0.0)) -> Estimate:
    """T = C_sub(B/W) + T_sync / R; T_sync: one allgather of the subnets (W-1 messages of p_sub).
    `subnet`: the measured layers of one rank's subnet; without it, the full model's cost scaled by
    the subnet's share of the Linear parameters. `measured`: a round timed on the ranks (its step
    between syncs, its sync, seconds), which stands for both where there is one."""
    sub = ist_subnet_params(work)
    share = sub / max(work.params, 1)
    memory = work.params * work.param_bytes + sub * work.optimizer_bytes_per_param \
        + work.rows * sum(l.saved_bytes for l in work.layers) / work.world
    sent = (work.world - 1) * sub * work.param_bytes / every
    if measured[0] > 0:
        compute, sync = measured
        return Estimate(compute + sync / every, compute, sync / every, sent, memory)
    if subnet:
        compute = layers_compute_s(subnet, work.rows, work.flops_per_s) + work.step_overhead_s * share
    else:
        linear_params = sum(l.params for l in work.layers if l.kind == "Linear") or 1
        compute = (layers_compute_s(work.layers, work.rows, work.flops_per_s) + work.step_overhead_s) \
            * sub / linear_params
    latency, bandwidth = net.ring  # one allgather of the subnets
    sync = (work.world - 1) * (latency + sub * work.param_bytes / bandwidth) if work.world > 1 else 0.0
    return Estimate(compute + sync / every, compute, sync / every, sent, memory)
