"""Averages over ranks with few bits on the wire and fp32 sums: what every published low-precision
outer synchronisation does (DiLoCo at 16 bits, INTELLECT-1's int8 all-reduce, Streaming DiLoCo's
4-bit outer gradients, ALGORITHMS.md): reduce what was quantized, accumulate in fp32. An allreduce
in fp16 instead sums fp16 values (each hop rounds the partial sum), and small values (DiLoCo's
deltas are lr x steps x gradients) fall into fp16's subnormals.

- 16 bits: "fp16" divides each block of 128 values by its largest |value| (a bf16 scale per block)
  before the cast, so fp16's narrow range covers each block's own decades; "bf16" has fp32's range
  and is cast as it is.
- "int8": block-scaled integers (strategies/quantize.py); partial sums are re-quantized per hop.
- "int4": block-scaled 4-bit integers with an error-feedback residual per rank: whatever a rank's
  encodings lost (its own delta, the partial sums it passes on, the finished chunk it owns) is added
  to its next delta, so over rounds the ranks' residuals together hold exactly what the sums lost
  (each chunk is encoded once per rank per round, so every error is someone's residual).
- Over send/recv (gloo) every format uses a ring: a reduce-scatter whose partial sums travel
  encoded and are added in fp32 on arrival, then a ring allgather of the finished encoded chunks:
  2(W-1)/W x the encoded bytes per rank, half an allgather's (W-1) x at W = 4. Without send/recv
  (Horovod, subgroups): an allgather of every rank's encoded values + a local fp32 sum.
- Every rank ends with the same values (the owner of a chunk decodes its own encoded copy too), so
  replicas that step on the result stay identical.
"""
from __future__ import annotations

from typing import Callable

import torch

from sparkdl.comm.base import SEND_RECV, Communicator
from sparkdl.strategies.quantize import CODECS, HALF, Codec, quantize_with_feedback

WIRE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
WIRE_FORMATS = ("fp32", *WIRE_DTYPES, *CODECS)
_RING_TAG = 41

Encode = Callable[[torch.Tensor], torch.Tensor]
Decode = Callable[[torch.Tensor, int], torch.Tensor]


def average(comm: Communicator, values: torch.Tensor, wire: str) -> torch.Tensor:
    """The mean over ranks of the fp32 tensor `values` (flat), sent as `wire` ("fp16", "bf16", "int8")."""
    if wire == "int4":
        raise ValueError("int4 keeps a residual: use average_with_feedback")
    return average_with_feedback(comm, values, wire, None)[0]


def average_with_feedback(comm: Communicator, values: torch.Tensor, wire: str, residual: torch.Tensor | None
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the mean over ranks of `values` sent as `wire`, this rank's residual for the next round)."""
    if wire not in WIRE_FORMATS:
        raise ValueError(f"wire format {wire!r}: one of {list(WIRE_FORMATS)}")
    values = values.detach().reshape(-1).to(torch.float32)
    if comm.size == 1:
        return values.clone(), residual
    if wire == "fp32":
        total = values.clone()
        comm.allreduce(total, op="avg")
        return total, residual
    if wire in WIRE_DTYPES:
        return _average_16_bit(comm, values, WIRE_DTYPES[wire]), residual
    codec = CODECS[wire]
    if SEND_RECV in comm.ops:
        if not codec.error_feedback:
            return _ring_sum(comm, values, codec.encode, codec.decode, codec.nbytes).div_(comm.size), residual
        corrected = values + residual if residual is not None else values
        lost = torch.empty_like(corrected)
        total = _ring_sum(comm, corrected, codec.encode, codec.decode, codec.nbytes, lost)
        return total.div_(comm.size), lost
    payload, residual = quantize_with_feedback(codec, values, residual)
    total = torch.zeros_like(values)
    for part in comm.allgather(payload):
        total += codec.decode(part, values.numel())
    return total.div_(comm.size), residual


def _average_16_bit(comm: Communicator, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float16:
        encode, decode, nbytes = HALF.encode, HALF.decode, HALF.nbytes
    else:
        def encode(chunk: torch.Tensor) -> torch.Tensor:
            return chunk.to(dtype).view(torch.uint8)

        def decode(raw: torch.Tensor, numel: int) -> torch.Tensor:
            return raw.view(dtype).to(torch.float32)

        def nbytes(numel: int) -> int:
            return 2 * numel
    if SEND_RECV in comm.ops:
        total = _ring_sum(comm, values, encode, decode, nbytes)
    else:
        total = torch.zeros_like(values)
        for part in comm.allgather(encode(values)):
            total += decode(part, values.numel())
    return total.div_(comm.size)


def _ring_sum(comm: Communicator, values: torch.Tensor, encode: Encode, decode: Decode,
              nbytes: Callable[[int], int], lost: torch.Tensor | None = None) -> torch.Tensor:
    """The sum over ranks of `values` (fp32), chunks travelling encoded, sums in fp32. With `lost`
    (shaped as values) each chunk this rank encodes leaves there what its encoding lost."""
    size, rank = comm.size, comm.rank
    right, left = (rank + 1) % size, (rank - 1) % size
    sums = list(torch.tensor_split(values.clone(), size))  # views into one fp32 buffer
    losses = list(torch.tensor_split(lost, size)) if lost is not None else None

    def encode_chunk(index: int) -> torch.Tensor:
        raw = encode(sums[index])
        if losses is not None:
            losses[index].copy_(sums[index] - decode(raw, sums[index].numel()))
        return raw

    # Reduce-scatter: at step s a rank passes on chunk (rank - s) and adds chunk (rank - s - 1).
    for step in range(size - 1):
        outgoing = encode_chunk((rank - step) % size)
        target = sums[(rank - step - 1) % size]
        incoming = torch.empty(nbytes(target.numel()), dtype=torch.uint8)
        receiving = comm.irecv(incoming, left, _RING_TAG)
        sending = comm.send(outgoing, right, _RING_TAG)
        receiving.wait()
        target += decode(incoming, target.numel())
        sending.wait()
    # Rank r now holds the finished chunk (r + 1); everyone takes its encoded copy.
    finished = [torch.empty(nbytes(chunk.numel()), dtype=torch.uint8) for chunk in sums]
    owned = (rank + 1) % size
    finished[owned].copy_(encode_chunk(owned))
    for step in range(size - 1):
        outgoing = finished[(owned - step) % size]
        incoming = finished[(owned - step - 1) % size]
        receiving = comm.irecv(incoming, left, _RING_TAG + 1)
        sending = comm.send(outgoing, right, _RING_TAG + 1)
        receiving.wait()
        sending.wait()
    return torch.cat([decode(raw, chunk.numel()) for raw, chunk in zip(finished, sums)])


def wire_bytes(numel: int, size: int, wire: str, send_recv: bool = True) -> int:
    """Bytes one rank sends to average `numel` values over `size` ranks."""
    if size <= 1:
        return 0
    if wire == "fp32":
        return 2 * (size - 1) * numel * 4 // size
    encoded = _encoded_bytes(wire)
    if send_recv:
        return 2 * (size - 1) * encoded(-(-numel // size))
    return (size - 1) * encoded(numel)  # allgather of every rank's encoded values


def wire_bits(wire: str) -> float:
    """Bits per value on the wire, block scales included (the planner's price of a format)."""
    return 8 * _encoded_bytes(wire)(1 << 20) / (1 << 20)


def _encoded_bytes(wire: str) -> Callable[[int], int]:
    if wire == "fp32":
        return lambda numel: 4 * numel
    if wire == "fp16":
        return HALF.nbytes
    if wire in WIRE_DTYPES:
        return lambda numel: 2 * numel
    codec: Codec = CODECS[wire]
    return codec.nbytes
