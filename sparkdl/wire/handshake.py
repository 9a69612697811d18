"""Proof of a run's secret on every connection to the driver, and frames no other host can forge,
alter or replay. Stdlib only: imported on both sides of the driver channel and the model receiver.

The secret never crosses the network (a host on the path of an earlier connection could reuse it):
the driver opens each connection with a fresh random challenge and the peer answers with
HMAC(secret, purpose, challenge, rank). Every frame after that carries an HMAC-SHA256 tag under a
key derived from the secret and this connection's challenge, over the direction and the frame's
sequence number: a frame copied from another connection, from earlier in this one, altered, or
injected into the stream fails its tag and closes the connection.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import struct

CHALLENGE_BYTES = 32
TAG_BYTES = 32
TO_DRIVER, TO_PEER = b"peer->driver", b"driver->peer"
_SEQUENCE = struct.Struct(">Q")


def new_challenge() -> bytes:
    return secrets.token_bytes(CHALLENGE_BYTES)


def proof(secret: str, purpose: str, challenge: bytes, rank: int) -> str:
    """What a peer that holds the secret answers to `challenge` (hex); bound to the purpose (the
    channel or the model receiver) and the rank, so no answer serves another connection."""
    message = b"sparkdl-hello\0" + purpose.encode() + b"\0" + challenge + b"\0" + str(rank).encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def proof_holds(secret: str, purpose: str, challenge: bytes, rank: int, given: object) -> bool:
    return isinstance(given, str) and hmac.compare_digest(given.encode(), proof(secret, purpose, challenge, rank).encode())


class FrameSeal:
    """The tags of one direction of one connection: each frame's tag covers its sequence number, so
    the receiver's seal (built alike) accepts the frames only once and in order."""

    def __init__(self, secret: str, challenge: bytes, direction: bytes) -> None:
        self._key = hmac.new(secret.encode(), b"sparkdl-frames\0" + challenge, hashlib.sha256).digest()
        self._direction, self._sequence = direction, 0

    def _tag(self, body: bytes | memoryview) -> bytes:
        mac = hmac.new(self._key, self._direction + _SEQUENCE.pack(self._sequence), hashlib.sha256)
        mac.update(body)
        return mac.digest()

    def seal(self, body: bytes) -> bytes:
        """The next frame's tag (prefixed to its body)."""
        tag = self._tag(body)
        self._sequence += 1
        return tag

    def opens(self, tag: bytes, body: bytes) -> bool:
        """Whether `tag` is the next frame's tag over `body` (and then expect the one after)."""
        if not hmac.compare_digest(tag, self._tag(body)):
            return False
        self._sequence += 1
        return True


class StreamTag:
    """An HMAC over a raw byte stream that follows the hello (a model part), sent after it."""

    def __init__(self, secret: str, challenge: bytes) -> None:
        key = hmac.new(secret.encode(), b"sparkdl-stream\0" + challenge, hashlib.sha256).digest()
        self._mac = hmac.new(key, digestmod=hashlib.sha256)

    def update(self, data: bytes | memoryview) -> None:
        self._mac.update(data)

    def digest(self) -> bytes:
        return self._mac.digest()

    def matches(self, tag: bytes) -> bool:
        return hmac.compare_digest(tag, self._mac.digest())
