"""The driver's end of the driver channel: one authenticated TCP server per run (the protocol, its
frames and the hello, is wire/frames.py, shared with the executors' end, executor/channel_client.py).
All connections feed one queue drained by one consumer thread."""
from __future__ import annotations

import logging
import queue
import secrets
import socket
import struct
import sys
import threading
import time
from contextlib import suppress
from typing import Any, Callable

from sparkdl.wire.admission import Admission, AdmissionLimits, Pending, read_hello, where
from sparkdl.wire.frames import (MAX_FRAME_BYTES, PURPOSE, ChannelAddress, FrameError, check_hello,
                                 encode_frame, frame_body, frame_fits, pack_frame, read_frame, welcome_frame)
from sparkdl.wire.handshake import TO_DRIVER, TO_PEER, FrameSeal, new_challenge

log = logging.getLogger("sparkdl")
_STOP = object()  # queue sentinel of the consumer thread


class _Reply:
    """msg["reply"] for a request: writes {"reply": id, **obj} once on the request's connection."""

    def __init__(self, conn: list[Any], request_id: Any, rank: int) -> None:
        # conn: [lock, socket (None once closed), the seal of frames to the peer]
        self._conn, self._id, self._rank, self.done = conn, request_id, rank, False

    def __call__(self, obj: dict[str, Any]) -> None:
        body = b""
        with suppress(TypeError, ValueError):  # e.g. a circular structure
            body = frame_body({**obj, "reply": self._id})  # the id last: obj cannot change it
        if not frame_fits(body):  # the worker would refuse it
            log.warning("sparkdl driver channel: reply to rank %d not encodable or too large; sent {}", self._rank)
            body = frame_body({"reply": self._id})
        with self._conn[0]:  # one writer at a time (the seal's sequence); the reader's close() waits for us
            done, self.done, sock = self.done, True, self._conn[1]
            if done or sock is None:  # sock None: the worker hung up (or we are closing), nobody waits
                return
            try:
                sock.sendall(pack_frame(body, self._conn[2]))
            except OSError as e:
                with suppress(OSError):  # maybe half a frame went out: the stream is unusable
                    sock.shutdown(socket.SHUT_RDWR)
                log.warning("sparkdl driver channel: could not reply to rank %d: %s", self._rank, e)


class DriverChannel:
    """Authenticated TCP server for one run. All connections feed one queue drained by one
    consumer thread, so on_message (which talks to MLflow) never runs concurrently and a slow
    handler never stalls a socket reader."""

    def __init__(self, host: str, on_message: Callable[[dict[str, Any]], None], *,
                 max_frame_bytes: int = MAX_FRAME_BYTES, limits: AdmissionLimits = AdmissionLimits()) -> None:
        self._on_message, self._max = on_message, max_frame_bytes
        # what a connection may hold before its hello proves the secret (wire/admission.py)
        self._admission = Admission("driver channel", limits)
        try:
            family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
            self._server = socket.create_server((host, 0), family=family, backlog=128)
        except OSError:  # the address others see (NAT, a given launch.channel) need not be bindable here
            self._server = socket.create_server(("", 0), backlog=128)
        self._server.settimeout(0.1)  # how often the accept loop looks for close()
        self._address = ChannelAddress(host, self._server.getsockname()[1], secrets.token_hex(32))
        log.debug("sparkdl driver channel: listening on %s:%d", host, self._address.port)
        self.handler_errors = 0
        self._lock, self._idle, self._closing = threading.Lock(), threading.Condition(), threading.Event()
        self._closed = False
        self._conns: dict[socket.socket, threading.Thread] = {}  # connections and their reader threads
        self._queue: queue.Queue[Any] = queue.Queue()
        self._pending = 0  # received but not yet handled, for drain()
        self._accepter = threading.Thread(target=self._accept_loop, daemon=True, name="sparkdl-channel-accept")
        self._consumer = threading.Thread(target=self._consume, daemon=True, name="sparkdl-channel-consumer")
        self._accepter.start()
        self._consumer.start()

    @property
    def address(self) -> ChannelAddress:
        return self._address

    @property
    def refused(self) -> int:
        """Connections refused: over the pending cap, no thread for them, or no valid hello in time."""
        return self._admission.refused

    def _accept_loop(self) -> None:
        while True:
            # Once closing, one last non-blocking pass empties the backlog: a client that connected,
            # sent and closed before we got to accept() it must not lose its messages.
            if closing := self._closing.is_set():
                self._server.setblocking(False)
            try:
                conn, peer = self._server.accept()
            except (TimeoutError, BlockingIOError):
                if closing:
                    return
                continue
            except OSError:  # e.g. out of file descriptors: keep serving the connections we have
                if closing:
                    return
                time.sleep(0.1)
                continue
            # admit() has started the thread: registering it after is safe, close() joins this loop first
            thread = self._admission.admit(conn, peer, self._serve, "sparkdl-channel-conn")
            if thread is not None:
                with self._lock:
                    self._conns = {c: t for c, t in self._conns.items() if t.is_alive()}
                    self._conns[conn] = thread

    def _serve(self, conn: socket.socket, peer: Any, pending: Pending) -> None:
        rank, stream, challenge = -1, conn.makefile("rb"), new_challenge()
        # Shared with this connection's _Reply objects; conn None once closed.
        state: list[Any] = [threading.Lock(), conn, FrameSeal(self._address.secret, challenge, TO_PEER)]
        limits = self._admission.limits
        try:
            deadline = time.monotonic() + limits.hello_deadline_s  # for the whole hello, not per recv
            conn.settimeout(limits.hello_deadline_s)
            conn.sendall(encode_frame({"challenge": challenge.hex()}))
            # off the socket itself, not the buffered stream, which reads the frames after it
            hello = read_hello(conn, deadline, min(limits.max_hello_bytes, self._max))
            claimed = self._check_hello(hello, challenge)
            if not pending.authenticated():  # evicted while its hello sat unread: the peer tries again
                raise FrameError("its place went to a newer connection")
            with state[0]:  # the welcome takes the first sequence number of the frames to the peer
                conn.sendall(welcome_frame(state[2]))
            rank = claimed  # a rank now, no longer counted against the pending cap
            inbound = FrameSeal(self._address.secret, challenge, TO_DRIVER)
            conn.settimeout(None)
            if sys.platform != "win32":  # 5 s per send(): a worker that stops reading must not hold the
                with suppress(OSError, AttributeError):  # consumer; reads stay blocking (Windows wants ms)
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 5, 0))
            while (msg := read_frame(stream, self._max, inbound)) is not None:
                msg["rank"] = rank
                if "request" in msg:
                    msg["reply"] = _Reply(state, msg.pop("request"), rank)
                with self._idle:
                    self._pending += 1
                self._queue.put(msg)
        except (FrameError, OSError) as e:
            if self._closing.is_set():
                pass  # close() interrupted us: not the peer's fault
            elif rank < 0:
                self._admission.hello_failed(peer, pending, e)
            else:
                log.warning("sparkdl driver channel: closed the connection from %s (rank %d): %s", where(peer), rank, e)
        finally:
            pending.release()
            with state[0]:  # never in the middle of a reply (nor can the fd be reused under one)
                state[1] = None
                stream.close()
                conn.close()

    def _check_hello(self, hello: dict[str, Any] | None, challenge: bytes) -> int:
        return check_hello(hello, self._address.secret, PURPOSE, challenge)

    def _consume(self) -> None:
        while (msg := self._queue.get()) is not _STOP:
            reply = msg.get("reply")  # taken first: the handler may pop it
            try:
                self._on_message(msg)
            except Exception:
                self.handler_errors += 1
                if self.handler_errors == 1:  # once: a broken handler must not flood the log
                    log.exception("sparkdl driver channel: on_message failed on %r (later failures are "
                                  "only counted in handler_errors)", msg)
            finally:
                if isinstance(reply, _Reply):  # no verdict, or a broken handler: the worker must not wait
                    reply({})
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def drain(self, timeout: float = 5.0) -> None:
        """Wait (up to timeout) until every message received so far was handled."""
        with self._idle:
            self._idle.wait_for(lambda: self._pending <= 0, timeout)

    def close(self) -> None:
        """Stop accepting, read what peers already sent, handle it, join the threads. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._closing.set()
        self._accepter.join(5.0)  # within 0.1 s, after accepting what is in the backlog
        self._server.close()
        with self._lock:  # the accept loop has stopped: no connection is added any more
            conns = dict(self._conns)
        for conn, thread in conns.items():  # SHUT_RD wakes a blocked reader; buffered data is still read first
            with suppress(OSError):
                conn.shutdown(socket.SHUT_RD)
            thread.join(5.0)
        self._queue.put(_STOP)
        self._consumer.join(10.0)
        self._admission.flush()

    def __enter__(self) -> DriverChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
