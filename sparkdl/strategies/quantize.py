"""Quantized outer gradients (Streaming DiLoCo, INTELLECT-1; ALGORITHMS.md): a codec turns a flat fp32
tensor into the bytes that go on the wire and back, and an error-feedback residual carries what a
round lost into the next one.

- "int8": symmetric integers -127..127, one scale per block of BLOCK values (its largest |value|).
- "int4": -7..7, two values packed per byte, the same block scales.
Scales travel as bf16 (fp32's range, so tiny pseudo-gradients keep a normal scale) and the values
are quantized against the rounded scale, so encoder and decoder agree exactly. Rounding is to
nearest: deterministic, so every rank decodes the same bytes to the same values.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 128
_SCALE_DTYPE = torch.bfloat16


def _blocks(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values zero-padded into rows of BLOCK, each row's bf16 scale, the scale to divide by)."""
    flat = values.detach().reshape(-1).to(torch.float32)
    padded = torch.zeros(-(-flat.numel() // BLOCK) * BLOCK, dtype=torch.float32)
    padded[: flat.numel()] = flat
    padded = padded.view(-1, BLOCK)
    scales = padded.abs().amax(dim=1).to(_SCALE_DTYPE)
    return padded, scales, scales.to(torch.float32).clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1)


@dataclass(frozen=True)
class Codec:
    name: str
    bits: int

    @property
    def levels(self) -> int:
        """The largest integer a value maps to (symmetric: -levels..levels)."""
        return (1 << (self.bits - 1)) - 1

    @property
    def error_feedback(self) -> bool:
        """Below 8 bits a round's quantization error is carried into the next (ALGORITHMS.md)."""
        return self.bits < 8

    def nbytes(self, numel: int) -> int:
        """Bytes on the wire for `numel` values: the packed integers and one bf16 scale per block."""
        blocks = -(-numel // BLOCK)
        return -(-numel * self.bits // 8) + 2 * blocks

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """A flat tensor -> uint8 bytes (nbytes(numel) of them)."""
        numel = values.numel()
        padded, scales, divisor = _blocks(values)
        levels = self.levels
        integers = torch.round(padded / divisor * levels).clamp_(-levels, levels).to(torch.int16).reshape(-1)
        integers = integers[:numel]
        if self.bits == 8:
            payload = integers.to(torch.int8).view(torch.uint8)
        else:
            payload = _pack_nibbles(integers)
        return torch.cat([payload, scales.view(torch.uint8)])

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        """Bytes from encode() -> the fp32 values they stand for."""
        blocks = -(-numel // BLOCK)
        body = -(-numel * self.bits // 8)
        scales = payload[body: body + 2 * blocks].clone().view(_SCALE_DTYPE).to(torch.float32)
        if self.bits == 8:
            integers = payload[:body].clone().view(torch.int8).to(torch.float32)
        else:
            integers = _unpack_nibbles(payload[:body], numel).to(torch.float32)
        padded = torch.zeros(blocks * BLOCK, dtype=torch.float32)
        padded[:numel] = integers
        return (padded.view(blocks, BLOCK) * (scales.unsqueeze(1) / self.levels)).reshape(-1)[:numel]


def _pack_nibbles(integers: torch.Tensor) -> torch.Tensor:
    """Integers in -7..7 -> bytes holding two of them (offset by 8), low nibble first."""
    shifted = (integers + 8).to(torch.uint8)
    if shifted.numel() % 2:
        shifted = torch.cat([shifted, torch.full((1,), 8, dtype=torch.uint8)])
    pairs = shifted.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def _unpack_nibbles(payload: torch.Tensor, numel: int) -> torch.Tensor:
    low = (payload & 0x0F).to(torch.int16) - 8
    high = (payload >> 4).to(torch.int16) - 8
    return torch.stack([low, high], dim=1).reshape(-1)[:numel]


@dataclass(frozen=True)
class BlockScaledHalf:
    """fp16 values with one bf16 scale per block: each block is divided by its largest |value| before
    the cast, so fp16's 5 exponent bits cover the block's decades instead of the whole tensor's
    (DiLoCo's deltas of a LayerNorm and of a large matrix differ by more than fp16's range, and a
    single scale pushed the small ones into subnormals: +0.9 % eval loss against fp32 DiLoCo)."""

    name: str = "fp16"
    bits: int = 16
    error_feedback: bool = False

    def nbytes(self, numel: int) -> int:
        return 2 * numel + 2 * -(-numel // BLOCK)

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        numel = values.numel()
        padded, scales, divisor = _blocks(values)
        halves = (padded / divisor).to(torch.float16).reshape(-1)[:numel]
        return torch.cat([halves.view(torch.uint8), scales.view(torch.uint8)])

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        blocks = -(-numel // BLOCK)
        halves = payload[: 2 * numel].clone().view(torch.float16).to(torch.float32)
        scales = payload[2 * numel: 2 * numel + 2 * blocks].clone().view(_SCALE_DTYPE).to(torch.float32)
        padded = torch.zeros(blocks * BLOCK, dtype=torch.float32)
        padded[:numel] = halves
        return (padded.view(blocks, BLOCK) * scales.unsqueeze(1)).reshape(-1)[:numel]


CODECS = {"int8": Codec("int8", 8), "int4": Codec("int4", 4)}
HALF = BlockScaledHalf()


def codec_for(name: str) -> Codec:
    if name not in CODECS:
        raise ValueError(f"quantized wire format {name!r}: one of {sorted(CODECS)}")
    return CODECS[name]


def quantize_with_feedback(codec: Codec, values: torch.Tensor, residual: torch.Tensor | None
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the bytes to send, the residual to keep): with error feedback the last round's error is
    added before quantizing and the new error kept; without, the residual stays None."""
    flat = values.detach().reshape(-1).to(torch.float32)
    if not codec.error_feedback:
        return codec.encode(flat), None
    corrected = flat + residual if residual is not None else flat
    payload = codec.encode(corrected)
    return payload, corrected - codec.decode(payload, corrected.numel())
