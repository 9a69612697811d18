"""How each rank's part of the trained model reaches the driver, outside the JVMs.

Rows of the barrier job's result are pickled whole in the executor's and the driver's JVM heaps and
capped by spark.driver.maxResultSize, so the trained state never travels there (DESIGN.md). A rank
writes its part as a tensor file (model/tensor_files.py) straight from its tensors' memory, by one of:

- "channel": over an authenticated TCP connection to a receiver on the driver (beside the driver
  channel, same host), which writes it to a file on the driver's local disk as it arrives. What is
  in flight is bounded by the sockets' buffers and one piece on each side.
- "storage": to `<checkpoint_dir>/<run id>/model/rank-<r>.safetensors` (any pyarrow filesystem the
  driver reaches too: a shared mount, an object store); the driver reads it there.
- "rows": in the job's rows, as before: the fallback when the driver cannot be reached (Spark
  Connect clients behind NAT) or the channel is off; bounded by spark.driver.maxResultSize.

A rank that cannot reach the receiver falls back to rows by itself and says so. Only small records
(where each part went) stay in the job's rows. Stdlib + torch on the worker side; no pyspark.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, BinaryIO

from sparkdl.storage.private_dirs import hold_new_directory, open_private, private_root, release
from sparkdl.wire.admission import (Admission, AdmissionLimits, Pending, Refused, read_hello, send_hello,
                                    with_retries)
from sparkdl.wire.frames import (FRAME_HEADER, ChannelAddress, FrameError, challenge_of, check_hello, encode_frame,
                                 hello_frame, read_frame, welcome_frame)
from sparkdl.wire.handshake import TAG_BYTES, TO_PEER, FrameSeal, StreamTag, new_challenge

log = logging.getLogger("sparkdl")
PART_SUFFIX = ".safetensors"
CONNECT_TIMEOUT_S = 10.0
PURPOSE = "model"  # what a hello proves the secret for (handshake.proof)
RECEIVE_PIECE_BYTES = 4 << 20
TRANSFERS = ("auto", "channel", "storage", "rows")


@dataclass(frozen=True)
class ModelSink:
    """Where the ranks send their parts; travels inside the TrainSpec."""

    mode: str  # "channel" | "storage" | "rows"
    address: ChannelAddress | None = None  # channel: the driver's receiver
    storage_uri: str | None = None  # storage: the directory of this attempt's parts
    timeout_s: float = 600.0  # how long a rank waits for the driver to confirm its part
    fallback: bool = True  # a rank that cannot reach the receiver sends its part in the rows (not when asked for "channel")


def part_name(rank: int) -> str:
    return f"rank-{rank}{PART_SUFFIX}"


# -- executor side --------------------------------------------------------------------------------
def deliver(sink: ModelSink | None, rank: int, state: dict[str, Any]) -> dict[str, Any]:
    """Send this rank's part; returns the small record the driver reads from the job's rows:
    {"via": "channel"|"storage", ...}, or {"via": "rows", "payload": bytes} when it must ride there."""
    import time

    started = time.perf_counter()
    record = _deliver(sink, rank, state)
    record["seconds"] = round(time.perf_counter() - started, 4)
    return record


def _deliver(sink: ModelSink | None, rank: int, state: dict[str, Any]) -> dict[str, Any]:
    from sparkdl.model.tensor_files import tensor_pieces

    metadata = {"rank": str(rank), "format": "sparkdl-part-1"}
    if sink is not None and sink.mode == "channel" and sink.address is not None:
        try:
            sent = _send_over_socket(sink, rank, state, metadata)
            return {"via": "channel", "bytes": sent}
        except (OSError, FrameError) as exc:
            if not sink.fallback:
                raise OSError(f"rank {rank} could not send its part of the model to the driver at "
                              f"{sink.address.host}:{sink.address.port} (launch.model_transfer=\"channel\"): {exc}; "
                              "model_transfer=\"auto\" falls back to the job's rows") from None
            print(f"sparkdl: rank {rank} could not send its part of the model to the driver "
                  f"({sink.address.host}:{sink.address.port}: {exc}); it comes back in the job's rows instead, "
                  "bounded by spark.driver.maxResultSize", file=sys.stderr, flush=True)
    elif sink is not None and sink.mode == "storage" and sink.storage_uri:
        from sparkdl.storage.files import atomic_output, locate

        where = locate(sink.storage_uri).child(part_name(rank))
        with atomic_output(where) as stream:
            total, pieces = tensor_pieces(state, metadata)
            for piece in pieces:
                stream.write(piece)
        from sparkdl.storage.files import join

        return {"via": "storage", "bytes": total, "uri": join(sink.storage_uri, part_name(rank))}
    total, pieces = tensor_pieces(state, metadata)
    return {"via": "rows", "bytes": total, "payload": b"".join(pieces)}  # one copy: the views are the tensors


def _send_over_socket(sink: ModelSink, rank: int, state: dict[str, Any], metadata: dict[str, str]) -> int:
    from sparkdl.model.tensor_files import tensor_pieces

    address = sink.address
    assert address is not None
    total, pieces = tensor_pieces(state, metadata)
    sock, replies, challenge, seal = with_retries(lambda: _connect(address, rank, total, sink.timeout_s),
                                                  CONNECT_TIMEOUT_S)
    with sock, replies:
        tag = StreamTag(address.secret, challenge)  # the receiver keeps the part only if it holds
        for piece in pieces:
            sock.sendall(piece)
            tag.update(piece)
        sock.sendall(tag.digest())
        reply = read_frame(replies, 1 << 16, seal)
    if not reply or not reply.get("ok"):
        raise OSError(f"the driver refused the part: {(reply or {}).get('error', 'no reply')}")
    return total


def _connect(address: ChannelAddress, rank: int, total: int,
             timeout_s: float) -> tuple[socket.socket, BinaryIO, bytes, FrameSeal]:
    """A connection to the receiver that welcomed this rank's hello (announcing `total` bytes): the
    socket, the stream of the receiver's frames, the challenge and the seal of those frames. Refused
    when the receiver closes it before its challenge or its welcome (wire/admission.py)."""
    sock = socket.create_connection((address.host, address.port), CONNECT_TIMEOUT_S)
    replies: BinaryIO | None = None
    try:
        sock.settimeout(timeout_s)
        if not sock.recv(1, socket.MSG_PEEK):
            raise Refused("the driver closed the connection before its challenge")
        challenge = challenge_of(_raw_frame(sock))
        replies, seal = sock.makefile("rb"), FrameSeal(address.secret, challenge, TO_PEER)
        send_hello(sock, hello_frame(address.secret, PURPOSE, challenge, rank, bytes=total), replies, seal)
        return sock, replies, challenge, seal
    except BaseException:
        if replies is not None:
            replies.close()
        sock.close()
        raise


# -- driver side ----------------------------------------------------------------------------------
class PartReceiver:
    """The driver's end of "channel": one thread per rank's connection writes its part to
    `<directory>/rank-<r>.safetensors` (a temporary name until complete), then confirms."""

    def __init__(self, host: str, directory: str, timeout_s: float = 600.0,
                 limits: AdmissionLimits = AdmissionLimits()) -> None:
        os.makedirs(directory, exist_ok=True)
        self.directory, self._timeout = directory, timeout_s
        # what a connection may hold before its hello proves the secret (wire/admission.py)
        self._admission = Admission("model receiver", limits)
        try:
            family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
            self._server = socket.create_server((host, 0), family=family, backlog=128)
        except OSError:  # the address executors see need not be bindable here (NAT)
            self._server = socket.create_server(("", 0), backlog=128)
        self._server.settimeout(0.2)
        self.address = ChannelAddress(host, self._server.getsockname()[1], secrets.token_hex(32))
        log.debug("sparkdl model receiver: listening on %s:%d", host, self.address.port)
        self.errors: dict[int, str] = {}
        self._closing = threading.Event()
        self._threads: list[threading.Thread] = []
        self._open: set[socket.socket] = set()  # connections still receiving, cut by close()
        self._accepter = threading.Thread(target=self._accept_loop, daemon=True, name="sparkdl-part-receiver")
        self._accepter.start()

    @property
    def refused(self) -> int:
        """Connections refused: over the pending cap, no thread for them, or no valid hello in time."""
        return self._admission.refused

    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                conn, peer = self._server.accept()
            except (TimeoutError, BlockingIOError):
                continue
            except OSError:  # e.g. out of file descriptors: not a busy loop
                if self._closing.is_set():
                    return
                time.sleep(0.1)
                continue
            self._open.add(conn)  # before its thread runs: that thread's end discards it
            thread = self._admission.admit(conn, peer, self._receive, "sparkdl-part")
            if thread is None:
                self._open.discard(conn)
                continue
            self._threads = [t for t in self._threads if t.is_alive()]  # refused peers' threads are not kept
            self._threads.append(thread)

    def _receive(self, conn: socket.socket, peer: Any, pending: Pending) -> None:
        rank, temporary, challenge = -1, "", new_challenge()
        secret, limits = self.address.secret, self._admission.limits
        outbound = FrameSeal(secret, challenge, TO_PEER)  # the welcome, then the verdict on the part
        try:
            deadline = time.monotonic() + limits.hello_deadline_s  # for the whole hello, not per recv
            conn.settimeout(limits.hello_deadline_s)
            conn.sendall(encode_frame({"challenge": challenge.hex()}))
            try:
                hello = read_hello(conn, deadline, limits.max_hello_bytes)
                claimed = check_hello(hello, secret, PURPOSE, challenge)
                if not pending.authenticated():  # evicted while its hello sat unread: the rank tries again
                    raise FrameError("its place went to a newer connection")
                conn.sendall(welcome_frame(outbound))
            except (OSError, FrameError) as exc:
                if not self._closing.is_set():
                    self._admission.hello_failed(peer, pending, exc)
                return  # nothing to tell a peer that is no rank
            rank = claimed  # a rank now, no longer counted against the pending cap
            assert hello is not None  # check_hello refuses None
            size = int(hello["bytes"])
            if size < 0:
                raise ValueError(f"a part of {size} bytes")
            conn.settimeout(self._timeout)  # a rank whose host vanished (no FIN) must not hold us forever
            temporary = os.path.join(self.directory, f".{part_name(rank)}.{uuid.uuid4().hex[:8]}")
            tag = StreamTag(secret, challenge)
            _copy_exactly(conn, temporary, size, tag)
            if not tag.matches(_recv_exactly(conn, TAG_BYTES)):
                raise FrameError("the part fails its authentication tag (altered or not from this run)")
            os.replace(temporary, os.path.join(self.directory, part_name(rank)))
            conn.sendall(encode_frame({"ok": True, "bytes": size}, outbound))
        except (OSError, FrameError, KeyError, TypeError, ValueError) as exc:
            if rank >= 0:
                self.errors[rank] = str(exc)
            if temporary and os.path.exists(temporary):
                os.unlink(temporary)
            try:
                conn.sendall(encode_frame({"ok": False, "error": str(exc)[:500]}, outbound))
            except OSError:
                pass
        finally:
            pending.release()
            self._open.discard(conn)
            conn.close()

    def close(self) -> None:
        """Stop accepting; a part still arriving when the job is over (its rank failed) is cut."""
        self._closing.set()
        self._accepter.join(5.0)
        self._server.close()
        for conn in list(self._open):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in self._threads:
            thread.join(10.0)
        self._admission.flush()

    def __enter__(self) -> "PartReceiver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _raw_frame(conn: socket.socket) -> dict[str, Any]:
    """A challenge or a hello, read straight off the socket: a buffered reader would swallow the
    start of the part that follows it."""
    (size,) = FRAME_HEADER.unpack(_recv_exactly(conn, FRAME_HEADER.size))
    if size > 1 << 16:
        raise FrameError(f"a first frame of {size} bytes")
    try:
        frame = json.loads(_recv_exactly(conn, size).decode("utf-8"))
    except ValueError:
        raise FrameError("the first frame is not UTF-8 JSON") from None
    if not isinstance(frame, dict):
        raise FrameError("the first frame is not a JSON object")
    return frame


def _recv_exactly(conn: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise FrameError("connection closed in the middle of a frame")
        data += chunk
    return bytes(data)


def _copy_exactly(conn: socket.socket, path: str, size: int, tag: StreamTag) -> None:
    """`size` bytes from the connection into a new file (and `tag`), one piece buffered at a time
    (recv_into: no copy but the kernel's)."""
    buffer = bytearray(min(RECEIVE_PIECE_BYTES, max(size, 1)))
    view = memoryview(buffer)
    left = size
    with open_private(path, buffering=0) as out:  # 0600, exclusive, never through a planted link
        while left:
            got = conn.recv_into(view[: min(left, len(view))])
            if not got:
                raise OSError(f"the connection closed with {left} of {size} bytes still to come")
            tag.update(view[:got])
            written = 0
            while written < got:
                written += out.write(view[written:got])
            left -= got


PARTS_PREFIX = "parts-"


def parts_directory(run_id: str) -> str:
    """A new directory on the driver's disk for one attempt's parts:
    `<tempdir>/sparkdl-<uid>/models/parts-<run id>-<random>`, 0700 in this user's private root,
    held by a lock while this driver lives (storage/private_dirs.py); the directories of a driver
    that died (its lock released by the kernel) are swept first."""
    return hold_new_directory(private_root("models"), PARTS_PREFIX, f"{run_id}-").path


def remove_directory(directory: str) -> None:
    if not release(directory):  # a held one goes with its lock file; any other as it is
        shutil.rmtree(directory, ignore_errors=True)


def record_bytes(record: dict[str, Any]) -> bytes:
    """The small JSON record a rank leaves in the job's rows (its payload, if any, rides apart)."""
    return json.dumps({k: v for k, v in record.items() if k != "payload"}).encode()
