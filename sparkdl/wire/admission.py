"""Who gets a thread on the driver before proving the run's secret: the admission of connections
shared by the driver channel (driver/channel.py) and the model receiver (model_transfer.PartReceiver).

Anyone who reaches the driver's ports can connect; only a peer that answers the challenge
(wire/handshake.py) is a rank. Until it has, a connection is *pending* and held to:
- a cap on pending connections (AdmissionLimits.max_pending). When all places are taken, the oldest
  pending connection gives its place to the new one if it has had `evict_after_s` for its hello (a
  rank needs milliseconds); otherwise the new one is closed at once, before any thread or read. So a
  burst is refused without a thread each, and idle or trickling peers that hold every place cannot
  keep a rank that comes later out. Authenticated connections are not counted: a run has its ranks,
  and a rank's connection leaves the count the moment its hello holds (Pending.authenticated).
  An evicted connection is never admitted, even when its hello arrives whole afterwards (or was
  buffered but not yet read when its place went): its socket is shut already.
- a deadline for the whole hello (not per recv: a peer sending a byte a second would renew a
  per-recv timeout forever) and a size cap checked on the length prefix, before a byte of the body
  is read or allocated.
- a thread that cannot be started (RuntimeError "can't start new thread") closes that connection;
  the accept loop goes on.
- refusals logged at most once per interval, with the count of those not logged since.
A rank knows it was admitted only by the driver's welcome, the first sealed frame after its hello
(send_hello); it sends nothing more before it. A connection the driver closes before the challenge
or before the welcome is Refused, and the rank tries again for a while (with_retries): a flood of
other connections delays a rank, it does not cost it its channel or its model part.
Stdlib only: the driver's servers and the ranks' clients (send_hello, with_retries, Refused) import it.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass, replace
from threading import Thread
from typing import Any, BinaryIO, Callable, TypeVar

from sparkdl.wire.frames import FRAME_HEADER, MAX_HELLO_BYTES, FrameError, decode_body, is_welcome, read_frame
from sparkdl.wire.handshake import FrameSeal

log = logging.getLogger("sparkdl")
T = TypeVar("T")
_READ_PIECE = 1024  # the hello arrives in pieces this small at most: never more than was sent is held


@dataclass(frozen=True)
class AdmissionLimits:
    """What a connection that has not proved the secret may hold on the driver."""

    max_pending: int = 64  # connections accepted but not yet authenticated
    evict_after_s: float = 0.5  # with every place taken, the oldest gives its place up after this long
    hello_deadline_s: float = 5.0  # wall time from accept to a complete hello
    max_hello_bytes: int = MAX_HELLO_BYTES  # the largest hello read (a real one is ~130 bytes)
    log_interval_s: float = 10.0  # at most one refusal warning per interval per server

    def for_ranks(self, ranks: int) -> AdmissionLimits:
        """Room for every rank's hello at once, twice over: all ranks connect as the barrier stage
        starts, and a retried attempt's ranks may arrive while the failed one's still hang up."""
        return replace(self, max_pending=max(self.max_pending, 2 * ranks))


class RateLimitedLog:
    """Warnings of one kind, at most one per `interval_s`; the next one says how many were not
    logged since, and flush() says it for the last ones (a refused flood must not flood the log)."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval, self._clock = interval_s, clock
        self._lock = threading.Lock()
        self._last: float | None = None
        self.suppressed = 0

    def warning(self, message: str, *args: Any) -> bool:
        """Log it unless one was logged within the interval; whether it was logged."""
        with self._lock:
            now = self._clock()
            if self._last is not None and now - self._last < self._interval:
                self.suppressed += 1
                return False
            self._last, since, self.suppressed = now, self.suppressed, 0
        if since:
            message += f" ({since} more not logged in the last {self._interval:g} s)"
        log.warning(message, *args)
        return True

    def flush(self, message: str) -> None:
        """Log `message` with the count of warnings not logged yet, if any; `message` takes it as %d."""
        with self._lock:
            since, self.suppressed = self.suppressed, 0
        if since:
            log.warning(message, since)


class Pending:
    """One admitted connection's place among the pending ones, given back once: when its hello
    holds (authenticated), when it ends without one, or when a newer connection takes it (evicted)."""

    def __init__(self, admission: Admission, conn: socket.socket) -> None:
        self._admission, self.conn, self.since = admission, conn, time.monotonic()
        self.evicted = False

    def authenticated(self) -> bool:
        """Its hello held: leave the pending count as a rank's connection. False when its place went
        to a newer connection first (evicted, its socket shut): it must be refused all the same."""
        return self._admission._authenticate(self)

    def release(self) -> None:
        self._admission._release(self)


class Admission:
    """The pending connections of one server: admit() starts a connection's thread, or closes it
    at once (no place, or no thread to be had) and logs the refusal, rate-limited."""

    def __init__(self, name: str, limits: AdmissionLimits) -> None:
        self.name, self.limits = name, limits
        self._lock = threading.Lock()
        self._waiting: dict[Pending, None] = {}  # the pending connections, oldest first
        self.refused = 0  # connections refused: no place, no thread, or a hello that did not hold in time
        self._refusals = RateLimitedLog(limits.log_interval_s)

    @property
    def pending(self) -> int:
        return len(self._waiting)

    def admit(self, conn: socket.socket, peer: Any, serve: Callable[[socket.socket, Any, Pending], None],
              thread_name: str) -> Thread | None:
        """Start serve(conn, peer, pending) on its own thread; None when the connection was closed instead."""
        pending = self._place(conn)
        if pending is None:
            self.refuse(peer, f"all {self.limits.max_pending} places of connections waiting for their hello are "
                              f"taken, none for {self.limits.evict_after_s:g} s yet (max_pending)")
            _close(conn)
            return None
        thread = Thread(target=serve, args=(conn, peer, pending), daemon=True, name=thread_name)
        try:
            thread.start()
        except RuntimeError as exc:  # "can't start new thread": out of threads or memory for a stack
            pending.release()
            self.refuse(peer, f"no thread to serve it ({exc})")
            _close(conn)
            return None
        return thread

    def _place(self, conn: socket.socket) -> Pending | None:
        """A place for a new connection: a free one, or the oldest pending one's once it has waited
        evict_after_s (its socket is shut down: its own thread sees the end and refuses it)."""
        with self._lock:
            evicted = None
            if len(self._waiting) >= self.limits.max_pending:
                oldest = next(iter(self._waiting))
                if time.monotonic() - oldest.since < self.limits.evict_after_s:
                    return None
                del self._waiting[oldest]
                oldest.evicted, evicted = True, oldest
            pending = Pending(self, conn)
            self._waiting[pending] = None
        if evicted is not None:
            try:  # not close(): its thread still reads the socket, and closes it
                evicted.conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return pending

    def hello_failed(self, peer: Any, pending: Pending, error: Exception) -> None:
        """Refuse a connection whose hello did not hold, saying why in words an operator can act on."""
        if pending.evicted:
            reason: object = (f"its hello not read after {self.limits.evict_after_s:g} s while all "
                              f"{self.limits.max_pending} places were taken: its place went to a newer connection "
                              "(a rank tries again)")
        elif isinstance(error, TimeoutError):
            reason = f"no hello within {self.limits.hello_deadline_s:g} s"
        else:
            reason = error
        self.refuse(peer, reason)

    def refuse(self, peer: Any, reason: object) -> None:
        """Count a refused connection and warn, at most once per interval."""
        with self._lock:
            self.refused += 1
        self._refusals.warning(f"sparkdl {self.name}: refused a connection from %s: %s", where(peer), reason)

    def flush(self) -> None:
        """At close: the refusals not logged yet, counted."""
        self._refusals.flush(f"sparkdl {self.name}: %d more connections refused since the last warning")

    def _authenticate(self, pending: Pending) -> bool:
        with self._lock:  # under the lock of _place: evicted now, or never once out of _waiting
            if pending.evicted:
                return False
            self._waiting.pop(pending, None)
            return True

    def _release(self, pending: Pending) -> None:
        with self._lock:
            self._waiting.pop(pending, None)


class Refused(ConnectionError):
    """The driver closed a new connection before its challenge or before welcoming its hello: it had
    no place for one more connection waiting for its hello, or gave this one's place to a newer one
    before reading its hello; worth another try (with_retries)."""


def send_hello(sock: socket.socket, hello: bytes, replies: BinaryIO, seal: FrameSeal) -> None:
    """A rank's side of admission: send the hello, then read the driver's welcome, the first frame
    sealed by `seal` (driver to peer), off `replies`. Refused when the driver closes (or resets) the
    connection before it; FrameError when that frame is something else."""
    try:
        sock.sendall(hello)
        frame = read_frame(replies, MAX_HELLO_BYTES, seal)
    except (BrokenPipeError, ConnectionResetError) as exc:
        raise Refused(f"the driver closed the connection after the hello ({exc})") from None
    if frame is None:
        raise Refused("the driver closed the connection after the hello, without welcoming it (no place for it, "
                      "or the hello did not hold: the driver's log says which)")
    if not is_welcome(frame):
        raise FrameError("the driver's first frame after the hello is not its welcome (a sparkdl of another version?)")


def with_retries(connect: Callable[[], T], within_s: float, first_pause_s: float = 0.1) -> T:
    """connect(), again after a pause (doubling up to 1 s) each time it raises Refused, until
    `within_s` is over; then the last Refused. A rank's side: stdlib only, like the protocol."""
    deadline, pause = time.monotonic() + within_s, first_pause_s
    while True:
        try:
            return connect()
        except Refused:
            if time.monotonic() + pause >= deadline:
                raise
            time.sleep(pause)
            pause = min(2 * pause, 1.0)


def where(peer: Any) -> str:
    """host:port of a peer address (an IPv6 one has more fields)."""
    try:
        return f"{peer[0]}:{peer[1]}"
    except (TypeError, IndexError):
        return str(peer)


def read_hello(conn: socket.socket, deadline: float, max_bytes: int) -> dict[str, Any] | None:
    """The first frame a peer sends, read off the socket itself (the bytes after it stay unread) by
    `deadline` (time.monotonic()); None on a close before it. TimeoutError once the deadline has
    passed; FrameError for a length over max_bytes (before any byte of the body is read) or a
    frame that is not a JSON object."""
    header = _read_by(conn, FRAME_HEADER.size, deadline)
    if not header:
        return None
    (size,) = FRAME_HEADER.unpack(header)
    if size > max_bytes:
        raise FrameError(f"a hello of {size} bytes exceeds max_hello_bytes={max_bytes}")
    return decode_body(_read_by(conn, size, deadline, eof_ok=False))


def _read_by(conn: socket.socket, size: int, deadline: float, eof_ok: bool = True) -> bytes:
    """Exactly `size` bytes by `deadline`, in small pieces; b"" when the peer closes before the first
    (with eof_ok)."""
    data = bytearray()
    while len(data) < size:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("hello deadline passed")
        conn.settimeout(left)  # each recv waits no longer than what is left of the whole deadline
        chunk = conn.recv(min(size - len(data), _READ_PIECE))
        if not chunk:
            if eof_ok and not data:
                return b""
            raise FrameError("connection closed in the middle of a frame")
        data += chunk
    return bytes(data)


def _close(conn: socket.socket) -> None:
    try:
        conn.close()
    except OSError:
        pass
