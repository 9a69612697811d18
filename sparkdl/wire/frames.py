"""Driver channel: executors on other hosts cannot reach the driver's MLflow store (DESIGN.md), so
rank 0 streams metrics and output lines (and any rank its error) to the driver over TCP. Stdlib only:
imported on both sides, it must not pull in pyspark or torch. A frame is a 4-byte big-endian length
+ a UTF-8 JSON object. The driver opens each connection with a challenge that only a holder of the
per-run secret can answer (wire/handshake.py), and every later frame carries a tag over its
sequence number: a stray or hostile peer cannot inject, alter or replay messages, even one that saw
an earlier connection. The driver's first sealed frame is its welcome, once the hello held. A
request gets one reply frame back (rank 0 waits for the driver's verdict after each epoch);
replies are only ever sent for requests."""
from __future__ import annotations

import json
import logging
import struct
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from sparkdl.wire.handshake import TAG_BYTES, FrameSeal, proof, proof_holds

log = logging.getLogger("sparkdl")
MAX_FRAME_BYTES = 1 << 20
# A real hello is ~130 bytes ({"hello":2,"rank":r,"proof":<64 hex>}, plus "bytes" to the model
# receiver); a peer that has not proved the secret yet gets no more than this (wire/admission.py).
MAX_HELLO_BYTES = 4 << 10
FRAME_HEADER = struct.Struct(">I")


@dataclass(frozen=True)
class ChannelAddress:
    """Where executors connect; picklable so it travels inside the TrainSpec."""

    host: str
    port: int
    # per run, secrets.token_hex(32): only this run's tasks can talk to the driver; never in a repr
    # (a TrainSpec printed in a log or an error text would hand it out)
    secret: str = field(repr=False)


class FrameError(Exception):
    """A frame that breaks the protocol; the connection carrying it is closed."""


PURPOSE = "channel"  # what a hello proves the secret for (handshake.proof)


def frame_body(obj: dict[str, Any]) -> bytes:
    """The JSON of a frame; default=str so a stray non-JSON value never raises in training code."""
    return json.dumps(obj, default=str, separators=(",", ":")).encode("utf-8")


def pack_frame(body: bytes, seal: FrameSeal | None = None) -> bytes:
    """Length-prefixed body, preceded by its tag on a sealed connection (the length counts the tag)."""
    tag = seal.seal(body) if seal is not None else b""
    return FRAME_HEADER.pack(len(tag) + len(body)) + tag + body


def encode_frame(obj: dict[str, Any], seal: FrameSeal | None = None) -> bytes:
    return pack_frame(frame_body(obj), seal)


def frame_fits(body: bytes, sealed: bool = True) -> bool:
    """Whether a frame of this body stays within MAX_FRAME_BYTES (the receiver refuses larger ones)."""
    return 0 < len(body) and len(body) + (TAG_BYTES if sealed else 0) <= MAX_FRAME_BYTES


def read_frame(stream: BinaryIO, max_bytes: int, seal: FrameSeal | None = None) -> dict[str, Any] | None:
    """One decoded frame from a buffered stream (socket.makefile("rb")), None on a clean EOF between
    frames; FrameError when the peer breaks the protocol or (with `seal`) a tag does not hold."""
    header = stream.read(FRAME_HEADER.size)
    if not header:
        return None
    (size,) = FRAME_HEADER.unpack(header) if len(header) == FRAME_HEADER.size else (-1,)
    if size > max_bytes:
        raise FrameError(f"frame of {size} bytes exceeds max_frame_bytes={max_bytes}")
    body = stream.read(size) if size > 0 else b""
    if size < 0 or len(body) < size:
        raise FrameError("connection closed in the middle of a frame")
    if seal is not None:
        tag, body = body[:TAG_BYTES], body[TAG_BYTES:]
        if len(tag) < TAG_BYTES or not seal.opens(tag, body):
            raise FrameError("frame fails its authentication tag (forged, altered, replayed or out of order)")
    return decode_body(body)


def decode_body(body: bytes) -> dict[str, Any]:
    """A frame's JSON object; FrameError when it is not one."""
    try:
        obj = json.loads(body.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError is a ValueError too
        raise FrameError("frame is not UTF-8 JSON") from None
    if not isinstance(obj, dict):
        raise FrameError("frame is not a JSON object")
    return obj


def check_hello(hello: dict[str, Any] | None, secret: str, purpose: str, challenge: bytes) -> int:
    """The rank of a hello that proves the secret for this connection's challenge; FrameError else."""
    if hello is None:
        raise FrameError("closed before sending a hello")
    if hello.get("hello") != 2:
        raise FrameError("first frame is not a hello")
    rank = hello.get("rank")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise FrameError(f"bad rank {rank!r} in the hello")
    if not proof_holds(secret, purpose, challenge, rank, hello.get("proof")):
        raise FrameError("wrong secret (the hello's proof does not answer this connection's challenge)")
    return rank


def challenge_of(frame: dict[str, Any] | None) -> bytes:
    """The challenge the driver opened a connection with; FrameError if that first frame is not one."""
    text = (frame or {}).get("challenge")
    try:
        challenge = bytes.fromhex(text) if isinstance(text, str) else b""
    except ValueError:
        challenge = b""
    if len(challenge) < 16:
        raise FrameError("the driver's first frame is not a challenge (a sparkdl of another version on the driver?)")
    return challenge


def welcome_frame(seal: FrameSeal) -> bytes:
    """The driver's first sealed frame to a peer: its hello held and the driver admitted the
    connection as a rank's (wire/admission.py); the peer sends nothing more before it."""
    return encode_frame({"welcome": 1}, seal)


def is_welcome(frame: dict[str, Any]) -> bool:
    return frame.get("welcome") == 1


def hello_frame(secret: str, purpose: str, challenge: bytes, rank: int, **fields: Any) -> bytes:
    """A peer's answer to the challenge: its rank and the proof that it holds the run's secret."""
    return encode_frame({**fields, "hello": 2, "rank": rank, "proof": proof(secret, purpose, challenge, rank)})
