"""The planner's DiLoCo-family candidates beyond plain DiLoCo: how the run's own outer sync travels
(sync_dtype, fragments, overlap), a streamed and quantized variant when the user left those open, and
islands when the measured links form them. Each comes back as (strategy, options, estimate); the
caller adds memory and backend feasibility as for every candidate.
"""
from __future__ import annotations

from typing import Any

from sparkdl.config import TrainConfig
from sparkdl.planner import cost
from sparkdl.planner.islands import IslandLinks

STREAMING_H = 50  # the streamed variant's sync_every (a multiple of every fragment count tried)
STREAMING_WIRE = "int8"  # INTELLECT-1's all-reduce; 4 bits are the user's call (error feedback, more noise)
STREAMING_DELAY = 1


def outer_wire(wire: str, fragments: int, delay: int) -> cost.OuterWire:
    from sparkdl.strategies.low_precision import wire_bits
    from sparkdl.strategies.quantize import CODECS

    feedback = wire in CODECS and CODECS[wire].error_feedback
    return cost.OuterWire(bits=wire_bits(wire), fragments=fragments, delay=delay,
                          residual_bytes_per_param=4 if feedback else 0)


def user_wire(train: TrainConfig) -> cost.OuterWire:
    return outer_wire(train.sync_dtype, train.fragments, train.fragment_sync_delay)


def streaming_options(train: TrainConfig, layers: int, overlap: bool, every: int | None = None
                      ) -> dict[str, Any] | None:
    """The streamed, quantized variant's options, unless the user already shaped the outer sync
    (then the DiLoCo candidates use theirs) or the model has a single layer. `every`: its H, from
    streamed_rounds on the measured calibration (STREAMING_H when not given)."""
    shaped = train.sync_dtype != "fp32" or train.fragments > 1 or train.fragment_sync_delay
    if shaped or layers < 2:
        return None
    fragments = 5 if layers >= 5 else 2
    delay = STREAMING_DELAY if overlap else 0
    every = every or STREAMING_H
    every = max(every, fragments * (delay + 1))  # torchft: tau < H / P
    every = -(-every // fragments) * fragments  # and P divides H
    return {"sync_every": every, "fragments": fragments, "fragment_sync_delay": delay,
            "sync_dtype": STREAMING_WIRE}


def streamed_rounds(work: cost.Workload, net: cost.Network, train: TrainConfig, layers: int, overlap: bool,
                    run_steps: int | None = None) -> int:
    """The streamed variant's H by planner/uneven.py's rule: its fragments' exposed sync time (each
    overlapped with tau inner steps) against one inner step's compute."""
    from sparkdl.planner.steps_to_loss import rounds_factor
    from sparkdl.planner.uneven import diloco_rounds

    options = streaming_options(train, layers, overlap)
    if options is None:
        return STREAMING_H
    fragments, delay = options["fragments"], options["fragment_sync_delay"]
    wire = outer_wire(options["sync_dtype"], fragments, delay)
    compute = cost.data_parallel(work, net).compute_s
    fragment_s = cost.outer_sync_s(work.params / fragments, work.world, net, wire)[0]
    exposed = max(0.0, fragment_s - delay * compute * work.accumulate)
    return diloco_rounds(compute * work.accumulate, fragments * exposed, fragments, run_steps,
                         rounds_factor(work.params, work.world, options["sync_dtype"]))


def streaming_candidate(work: cost.Workload, net: cost.Network, options: dict[str, Any]
                        ) -> tuple[str, dict[str, Any], cost.Estimate]:
    wire = outer_wire(options["sync_dtype"], options["fragments"], options["fragment_sync_delay"])
    return ("diloco", {"strategy": "data_parallel", "sync": "diloco", **options},
            cost.diloco(work, net, options["sync_every"], wire))


def island_candidate(work: cost.Workload, links: IslandLinks, train: TrainConfig, streamed: dict[str, Any] | None
                     ) -> tuple[str, dict[str, Any], cost.Estimate]:
    """Data parallel inside the islands, DiLoCo across them (streamed and quantized as the user set,
    or as the streamed variant), priced on the links inside and across."""
    every = streamed["sync_every"] if streamed else max(train.sync_every, STREAMING_H)
    wire = outer_wire(streamed["sync_dtype"], streamed["fragments"], streamed["fragment_sync_delay"]) if streamed \
        else user_wire(train)
    inside = cost.Network(latency_s=links.inside[0], bandwidth_Bps=links.inside[1])
    across = cost.Network(latency_s=links.across[0], bandwidth_Bps=links.across[1])
    options = {"strategy": "data_parallel", "sync": "diloco", "sync_every": every, **(streamed or {}),
               "islands": links.islands}
    return "islands", options, cost.islands(work, inside, across, links.sizes, every, wire)
