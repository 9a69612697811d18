"""How many steps a candidate needs to reach data parallel's loss, as a multiple k of data parallel's
steps (ALGORITHMS.md, "Choosing by time to loss, not time per step"). Standard library only: the
planner's choice (planner/plan.py) compares time_to_loss(c) = k(c) x steps x step_time(c).

The rule, stated once here and shown by `explain()`:
- Exact strategies (data parallel, sharded, hybrid): k = 1. Their update equals synchronous training.
- DiLoCo and its forms (streamed fragments, quantized outer gradients, islands), M replicas syncing
  every H inner steps, N trainable parameters:

      k = 1 + (K_FIT - 1) x log2(M) / log2(M_FIT) x sqrt(max(H, H_FIT) / H_FIT) x (N_FIT / N) ** N_EXPONENT
            x (LOW_BITS_FACTOR when the outer gradient travels in fewer than 8 bits)

  Source: this project's own measurement (benchmarks/slow_links.py): a 0.46M-parameter GPT with M=4
  replicas and H=104-192 needed k ~ 2.3 times data parallel's steps to reach its final loss. The fit
  is anchored at the lower end of that H range (H_FIT=104), so over the measured range k is at least
  what was measured: conservative. The shape follows the DiLoCo scaling-law paper (Charles et al.
  2025): the gap to data parallel shrinks as the model grows (35M -> 2.4B; a gentle exponent, again
  conservative), grows with replicas (M=1 matches data parallel: k=1) and with H. Islands count
  their islands as replicas (data parallel inside each). Streaming (fragments, overlap tau) costs
  under 0.2 % of loss up to tau 10 and 16/8-bit transport nothing in every published run
  (ALGORITHMS.md, Streaming DiLoCo): no factor; below 8 bits (error feedback, more noise) the excess
  is raised by LOW_BITS_FACTOR. A shorter H than the fit's does not lower k: on the multi-host bed
  (benchmarks/planner_accuracy_bed.py, issue 53) M=2 replicas at H=10 needed k = 1.67-2.0 (a small
  GPT; an MLP had not reached the loss at k = 2), where sqrt(H / H_FIT) would have priced 1.2-1.3.
- IST over W ranks: k = 1 + IST_PER_RANK x (W - 1). docs/benchmarks.md ("IST and DiLoCo") measured
  IST at W=2, R=30 matching data parallel's accuracy after whole epochs, but the bed's 48-step runs
  needed twice data parallel's steps to its loss (k = 2 at W = 2): the conservative figure is kept;
  each rank trains 1/W of every hidden layer per round, so k grows with W.

k is a prior, not a measurement of this run: re-estimating it from the run's validation curve is
planner work still to do (ALGORITHMS.md).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

K_FIT = 2.3  # measured: steps to data parallel's final loss / data parallel's steps
N_FIT = 0.46e6  # parameters of the measured GPT
M_FIT = 4  # its replicas
H_FIT = 104  # the measured H range's lower end (104-192): k is at least the measured one above it
N_EXPONENT = 0.2  # the gap shrinks slowly with model size (conservative: the paper's shrinks faster)
LOW_BITS_FACTOR = 1.25  # outer gradients below 8 bits: error feedback, more noise
IST_PER_RANK = 1.0  # IST: k = 1 + this x (W - 1) (the bed measured k = 2 at W = 2, R = 30)
APPROXIMATE = ("diloco", "islands", "ist")
WIRE_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "int8": 8, "int4": 4}


def diloco_steps_factor(params: float, replicas: int, every: int, bits: float = 32.0) -> float:
    """k for DiLoCo with `replicas` replicas syncing every `every` steps over `params` parameters."""
    if replicas <= 1 or every <= 1:
        return 1.0  # one replica, or a sync every step: synchronous training
    size = (N_FIT / params) ** N_EXPONENT if params > 0 else 1.0
    excess = (K_FIT - 1) * math.log2(replicas) / math.log2(M_FIT) * math.sqrt(max(every, H_FIT) / H_FIT) * size
    if bits < 8:
        excess *= LOW_BITS_FACTOR
    return 1.0 + excess


def rounds_factor(params: float, replicas: int, wire: str = "fp32") -> Callable[[int], float]:
    """k as a function of H for a DiLoCo candidate whose H is still to choose (planner/uneven.py
    diloco_rounds): the same rule, the outer gradient travelling as `wire`."""
    bits = WIRE_BITS.get(wire, 32)
    return lambda every: diloco_steps_factor(params, replicas, every, bits)


def ist_steps_factor(world: int) -> float:
    """k for IST over `world` ranks (each trains a 1/world subnet of the hidden layers per round)."""
    return 1.0 + IST_PER_RANK * max(world - 1, 0)


def steps_factor(strategy: str, options: dict[str, Any], params: float, world: int) -> tuple[float, str]:
    """(k, how it was reached) for one candidate: 1 for exact strategies."""
    if strategy == "ist":
        k = ist_steps_factor(world)
        return k, f"IST over {world} ranks: 1 + {IST_PER_RANK:g} x (W-1)"
    if strategy not in ("diloco", "islands"):
        return 1.0, ""
    islands = options.get("islands")
    replicas = len(islands) if isinstance(islands, (list, tuple)) and islands else world
    every = int(options.get("sync_every", H_FIT))
    wire = str(options.get("sync_dtype", "fp32"))
    bits = WIRE_BITS.get(wire, 32)
    k = diloco_steps_factor(params, replicas, every, bits)
    return k, (f"DiLoCo, N={_count(params)} params, M={replicas} replicas, H={every}"
               + (f", {wire} (< 8 bits)" if bits < 8 else "")
               + f": fit to k={K_FIT:g} at N={_count(N_FIT)}, M={M_FIT}, H={H_FIT}")


def with_steps_factors(candidates: Sequence[Any], params: float, world: int) -> list[Any]:
    """The candidates (planner/plan.py Candidate) with their k and its rule filled in."""
    out = []
    for c in candidates:
        k, rule = steps_factor(c.strategy, dict(c.options), params, world)
        out.append(dataclasses.replace(c, steps_factor=k, steps_rule=rule))
    return out


def _count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"
