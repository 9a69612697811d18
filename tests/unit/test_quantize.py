"""Quantized outer gradients (strategies/quantize.py, low_precision.py): the codecs alone, then int8
and int4 averages on real gloo worlds of 3 processes, against the exact fp32 mean."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from gloo_world import run_world
from sparkdl.strategies import low_precision
from sparkdl.strategies.quantize import BLOCK, codec_for, quantize_with_feedback

pytestmark = pytest.mark.timeout(120)
WORLD = 3
NUMEL = 10_001  # not a multiple of the world nor of a block


def deltas(rank: int, round_number: int = 0) -> torch.Tensor:
    """DiLoCo-like pseudo-gradients: small (lr x steps x gradient), spread over decades."""
    generator = torch.Generator().manual_seed(100 + 17 * round_number + rank)
    return torch.randn(NUMEL, generator=generator) * torch.logspace(-7, -3, NUMEL)


@pytest.mark.parametrize("name,bits,bound", [("int8", 8, 1 / 254), ("int4", 4, 1 / 14)])
def test_a_round_trip_is_within_half_a_level_of_each_blocks_scale(name: str, bits: int, bound: float) -> None:
    codec = codec_for(name)
    values = deltas(0)
    payload = codec.encode(values)
    assert payload.dtype == torch.uint8 and payload.numel() == codec.nbytes(NUMEL)
    assert codec.nbytes(NUMEL) == -(-NUMEL * bits // 8) + 2 * -(-NUMEL // BLOCK)  # values + one bf16 scale a block
    back = codec.decode(payload, NUMEL)
    blocks = torch.nn.functional.pad(values, (0, -NUMEL % BLOCK)).view(-1, BLOCK).abs().amax(1)
    per_value_scale = blocks.repeat_interleave(BLOCK)[:NUMEL]
    assert torch.all((back - values).abs() <= per_value_scale * bound * 1.01 + 1e-30)
    # The largest value of each block is represented exactly up to the bf16 scale's rounding.
    assert torch.allclose(back.abs().max(), values.abs().max(), rtol=4e-3)
    assert torch.equal(codec.decode(codec.encode(torch.zeros(5)), 5), torch.zeros(5))


def test_int4_packs_two_values_a_byte_and_keeps_every_level() -> None:
    codec = codec_for("int4")
    levels = torch.arange(-7, 8, dtype=torch.float32)  # 15 values: an odd count pads a nibble
    back = codec.decode(codec.encode(levels), levels.numel())
    assert torch.equal(back, levels)
    assert codec.nbytes(15) == 8 + 2


def test_error_feedback_carries_every_rounds_loss_into_the_next() -> None:
    """sum of what was sent + the last residual == sum of what was meant, to fp32 rounding: nothing
    is lost over rounds, however coarse one round's quantization is."""
    codec = codec_for("int4")
    residual = None
    meant, sent = torch.zeros(NUMEL), torch.zeros(NUMEL)
    for round_number in range(12):
        delta = deltas(0, round_number)
        meant += delta
        payload, residual = quantize_with_feedback(codec, delta, residual)
        sent += codec.decode(payload, NUMEL)
    assert residual is not None
    np.testing.assert_allclose((sent + residual).numpy(), meant.numpy(), rtol=1e-5, atol=1e-9)
    # Without feedback the loss accumulates: the same rounds sent plainly drift further.
    plain = sum(codec.decode(codec.encode(deltas(0, r)), NUMEL) for r in range(12))
    assert (plain - meant).abs().mean() > 3 * (sent - meant).abs().mean()
    assert quantize_with_feedback(codec_for("int8"), deltas(0), None)[1] is None  # 8 bits: no residual


def _average_rounds(comm: Any, wire: str, rounds: int) -> dict[str, Any]:
    residual = None
    total = torch.zeros(NUMEL)
    sent = []
    for round_number in range(rounds):
        before = comm.bytes_sent
        mean, residual = low_precision.average_with_feedback(comm, deltas(comm.rank, round_number), wire, residual)
        sent.append(comm.bytes_sent - before)
        total += mean
        first = mean.numpy().copy() if round_number == 0 else first
    return {"first": first, "total": total.numpy(), "sent": sent,
            "residual": None if residual is None else residual.numpy()}


@pytest.mark.parametrize("wire,bound", [("int8", 1.2e-2), ("int4", 0.16)])
def test_quantized_averages_are_identical_on_every_rank_close_to_the_mean_and_sent_quantized(
        wire: str, bound: float) -> None:
    rounds = 6
    results = run_world(WORLD, _average_rounds, wire, rounds)
    exact = sum(deltas(r) for r in range(WORLD)) / WORLD
    for rank in range(1, WORLD):
        np.testing.assert_array_equal(results[rank]["first"], results[0]["first"])  # replicas stay identical
    error = np.abs(results[0]["first"] - exact.numpy()).max() / float(exact.abs().max())
    assert error < bound, (wire, error)
    codec = codec_for(wire)
    # A ring of encoded chunks: 2 (W-1) chunks of about N/W values, partial sums re-encoded per hop.
    expected = 2 * (WORLD - 1) * codec.nbytes(-(-NUMEL // WORLD))
    assert 2 * (WORLD - 1) * codec.nbytes(NUMEL // WORLD) <= results[0]["sent"][0] <= expected
    assert results[0]["sent"][0] <= low_precision.wire_bytes(NUMEL, WORLD, wire)
    if wire == "int4":
        # Over rounds error feedback keeps the running sum on the exact one: what each rank still
        # owes is its residual, so sum of means + mean of residuals == sum of exact means.
        exact_total = sum(deltas(r, k) for r in range(WORLD) for k in range(rounds)) / WORLD
        owed = sum(result["residual"] for result in results) / WORLD
        np.testing.assert_allclose(results[0]["total"] + owed, exact_total.numpy(), rtol=1e-5, atol=1e-9)
    fp32 = low_precision.wire_bytes(NUMEL, WORLD, "fp32")
    assert results[0]["sent"][0] < fp32 / (3.5 if wire == "int8" else 3.5)
