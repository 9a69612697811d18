"""Executor side of the driver channel (wire/frames.py holds the protocol and the driver's
server): a client whose sends never block or break training. Stdlib only, like the protocol."""
from __future__ import annotations

import itertools
import logging
import queue
import socket
import threading
import time
from contextlib import suppress
from typing import Any

from sparkdl.wire.admission import Refused, send_hello, with_retries
from sparkdl.wire.frames import (MAX_FRAME_BYTES, PURPOSE, ChannelAddress, FrameError, challenge_of, frame_body,
                                 frame_fits, hello_frame, pack_frame, read_frame)
from sparkdl.wire.handshake import TO_DRIVER, TO_PEER, FrameSeal

log = logging.getLogger("sparkdl")
_STOP = object()  # queue sentinel of the sender thread


class _Urgent:
    """A frame's body whose sender waits until it is written (send_now) or, with an rid, answered (request)."""

    def __init__(self, body: bytes, rid: int | None = None, deadline: float = 0.0) -> None:
        self.body, self.ok, self.done = body, False, threading.Event()
        self.rid, self.deadline, self.reply = rid, deadline, None


class _Replies:
    """Reply frames from the client socket, by a deadline. Bytes stay buffered until read_frame has a
    whole frame, so a timeout mid-frame loses nothing (a makefile() stream is dead after a timeout)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock, self._buf, self._pos, self._deadline = sock, bytearray(), 0, 0.0
        self.seal: FrameSeal | None = None  # of the driver's frames, from its welcome on

    def read(self, n: int) -> bytes:  # all of BinaryIO that read_frame uses; the frame starts at _buf[0]
        while len(self._buf) < self._pos + n:
            self._sock.settimeout(max(1e-3, self._deadline - time.monotonic()))  # TimeoutError once due
            if not (chunk := self._sock.recv(max(1 << 16, self._pos + n - len(self._buf)))):
                break  # EOF: read_frame sees the short read
            self._buf += chunk
        self._pos += n
        return bytes(self._buf[self._pos - n:self._pos])

    def challenge(self, deadline: float) -> bytes:
        """The challenge the driver opens the connection with (TimeoutError when it sends none by deadline)."""
        self._deadline, self._pos = deadline, 0
        frame = read_frame(self, MAX_FRAME_BYTES)  # type: ignore[arg-type]
        del self._buf[:self._pos]
        if frame is None:  # no place for us now (wire/admission.py): _run tries again
            raise Refused("the driver closed the connection before its challenge")
        return challenge_of(frame)

    def welcome(self, hello: bytes, seal: FrameSeal, deadline: float) -> None:
        """Send the hello and read the driver's welcome, its first frame under `seal` (then the seal of
        the replies), by deadline; Refused on a close before it (_run tries again)."""
        self._deadline, self._pos, self.seal = deadline, 0, seal
        send_hello(self._sock, hello, self, seal)  # type: ignore[arg-type]
        del self._buf[:self._pos]

    def reply_to(self, rid: int, deadline: float) -> dict[str, Any] | None:
        """The reply to request rid, skipping late replies to earlier (timed-out) requests; None: due."""
        self._deadline, sock_timeout = deadline, self._sock.gettimeout()
        try:
            while True:
                self._pos = 0
                frame = read_frame(self, MAX_FRAME_BYTES, self.seal)  # type: ignore[arg-type]
                del self._buf[:self._pos]
                if frame is None:
                    raise ConnectionError("the driver closed the connection")
                if frame.pop("reply", None) == rid:
                    return frame
        except TimeoutError:
            return None  # its reply, if it comes, is skipped by a later request: the ids differ
        finally:
            self._sock.settimeout(sock_timeout)  # the sender's own, for sendall


class ChannelClient:
    """Executor side: sends never block or break training. A daemon thread owns the socket and
    connects on the first message; if the driver is unreachable it warns once and drops messages
    from then on (the run history returned with the task result still has the metrics)."""

    def __init__(self, address: ChannelAddress, rank: int, *, connect_timeout: float = 10.0,
                 queue_size: int = 10000) -> None:
        self._address, self._rank, self._timeout = address, rank, connect_timeout
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._failed = self._closed = False
        self.dropped, self._ids = 0, itertools.count(1)  # _ids: request ids, for matching replies
        self._thread: threading.Thread | None = None  # started by the first message

    @property
    def failed(self) -> bool:
        """The driver could not be reached (or stopped reading): nothing sent arrives any more."""
        return self._failed

    def _drop(self) -> None:
        with self._lock:
            self.dropped += 1

    def _enqueue(self, kind: str, fields: dict[str, Any], wait: float | None,
                 rid: int | None = None) -> _Urgent | None:
        """Queue the message (wrapped as _Urgent when wait is set); None when it was dropped."""
        if rid is None:  # a plain message must not pass for a request: its reply would be read as another's
            fields.pop("request", None)
        try:  # sealed by the sender thread: tags follow the order frames are written in
            body = frame_body({"kind": kind, **fields})
        except (TypeError, ValueError):  # e.g. a circular structure
            body = b""
        item = _Urgent(body, rid, time.monotonic() + (wait or 0.0))
        with self._lock:
            ok = frame_fits(body) and not (self._failed or self._closed)
            if ok and self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name="sparkdl-channel-client")
                self._thread.start()
        with suppress(queue.Full):
            if ok:
                self._queue.put(item if wait is not None else body, block=wait is not None, timeout=wait)
                if self._failed:  # the sender died meanwhile: nobody reads the queue any more
                    self._drop_queued()
                return item
        self._drop()
        return None

    def send(self, kind: str, **fields: Any) -> None:
        """Queue {"kind": kind, **fields}; returns at once, dropping (and counting) if it cannot."""
        self._enqueue(kind, fields, None)

    def send_now(self, kind: str, timeout: float = 5.0, **fields: Any) -> bool:
        """Send after what is already queued and wait until written; for a rank's dying error."""
        deadline = time.monotonic() + timeout
        item = self._enqueue(kind, fields, timeout)
        return item is not None and item.done.wait(max(0.0, deadline - time.monotonic())) and item.ok

    def request(self, kind: str, timeout: float, **fields: Any) -> dict[str, Any] | None:
        """Send {"kind": kind, **fields} after what is queued and wait for the driver's reply; None if
        the channel is down or closed, the frame unusable, or no reply came within timeout. Never raises."""
        timeout = min(max(0.0, timeout), threading.TIMEOUT_MAX)  # also maps NaN to 0
        deadline, rid = time.monotonic() + timeout, next(self._ids)
        item = self._enqueue(kind, {**fields, "request": rid}, timeout, rid)
        return item.reply if item is not None and item.done.wait(max(0.0, deadline - time.monotonic())) else None

    def _run(self) -> None:
        item: Any = None
        try:
            while (item := self._queue.get()) is not _STOP:
                if self._sock is None:
                    self._sock, replies, seal = with_retries(self._connect, self._timeout)
                self._sock.sendall(pack_frame(item.body if isinstance(item, _Urgent) else item, seal))
                if isinstance(item, _Urgent):
                    if item.rid is not None:
                        item.reply = replies.reply_to(item.rid, item.deadline)
                    item.ok = True
                    item.done.set()
        except (OSError, FrameError) as e:
            with self._lock:
                gave_up, self._failed = self._failed, True  # gave_up: close() timed out and cut the socket
            if not gave_up:
                log.warning("sparkdl: driver channel unreachable (%s:%d: %s); the epoch metrics and rank 0's last "
                            "output lines reach the driver with the job's result",
                            self._address.host, self._address.port, e)
            if item is not None:  # the message being written when it failed
                self._drop()
                if isinstance(item, _Urgent):
                    item.done.set()
            self._drop_queued()
        finally:
            if self._sock is not None:
                self._sock.close()

    def _connect(self) -> tuple[socket.socket, _Replies, FrameSeal]:
        sock = socket.create_connection((self._address.host, self._address.port), self._timeout)
        try:
            replies = _Replies(sock)
            return sock, replies, self._hello(sock, replies)
        except BaseException:
            sock.close()
            raise

    def _hello(self, sock: socket.socket, replies: _Replies) -> FrameSeal:
        """Answer the driver's challenge and wait for its welcome; the seal of the frames this client
        sends after it (that of the driver's replies goes to `replies`)."""
        challenge = replies.challenge(time.monotonic() + self._timeout)
        sock.settimeout(self._timeout)
        replies.welcome(hello_frame(self._address.secret, PURPOSE, challenge, self._rank),
                        FrameSeal(self._address.secret, challenge, TO_PEER), time.monotonic() + self._timeout)
        sock.settimeout(self._timeout)  # the sender's own, for sendall (the welcome's read set another)
        return FrameSeal(self._address.secret, challenge, TO_DRIVER)

    def _drop_queued(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Urgent):
                item.done.set()
            if item is not _STOP:
                self._drop()

    def close(self, timeout: float = 10.0) -> None:
        """Flush what is queued (up to timeout), then close. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed, thread = True, self._thread
        if thread is None:
            return
        deadline = time.monotonic() + timeout
        with suppress(queue.Full):
            self._queue.put(_STOP, timeout=timeout)
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():  # driver too slow: give up on the rest rather than hang the task
            with self._lock:
                self._failed = True
            with suppress(OSError, AttributeError):
                self._sock.shutdown(socket.SHUT_RDWR)  # type: ignore[union-attr]
            self._drop_queued()
            log.warning("sparkdl: driver channel did not take the last messages within %g s (%d dropped); "
                        "metrics stay in the run history", timeout, self.dropped)
