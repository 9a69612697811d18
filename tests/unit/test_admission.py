"""Peers that never prove the run's secret, against the real driver channel and the real model
receiver over real sockets on 127.0.0.1 (wire/admission.py): the cap on pending connections, the
hello's deadline and size cap, a thread that cannot be started, and refusal logs that do not flood."""
from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
import tracemalloc
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

from sparkdl.driver import channel as channel_module
from sparkdl.driver.channel import DriverChannel
from sparkdl.executor.channel_client import ChannelClient
from sparkdl.wire import admission, model_transfer
from sparkdl.wire.admission import AdmissionLimits, RateLimitedLog, read_hello
from sparkdl.wire.frames import (FRAME_HEADER, ChannelAddress, FrameError, challenge_of, encode_frame, hello_frame,
                                 read_frame)
from sparkdl.wire.handshake import TO_DRIVER, TO_PEER, FrameSeal, StreamTag
from sparkdl.wire.model_transfer import ModelSink, PartReceiver, deliver, part_name

pytestmark = pytest.mark.timeout(60)
SERVERS = ("channel", "receiver")
THREAD_NAMES = {"channel": "sparkdl-channel-conn", "receiver": "sparkdl-part"}


def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


class Server:
    """One of the two driver-side servers, with what a real rank of it does."""

    def __init__(self, kind: str, limits: AdmissionLimits, directory: Path) -> None:
        self.kind, self.directory = kind, directory
        self.messages: list[dict[str, Any]] = []
        if kind == "channel":
            self.server: Any = DriverChannel("127.0.0.1", self.messages.append, limits=limits)
        else:
            self.server = PartReceiver("127.0.0.1", str(directory), timeout_s=10, limits=limits)

    @property
    def address(self) -> ChannelAddress:
        return self.server.address

    @property
    def purpose(self) -> str:
        return "channel" if self.kind == "channel" else "model"

    def legit_rank_gets_through(self, rank: int) -> None:
        """A real rank's client: its message reaches on_message, or its part the receiver's directory."""
        if self.kind == "channel":
            client = ChannelClient(self.address, rank, connect_timeout=5.0)
            assert client.send_now("metric", loss=float(rank))
            client.close()
            wait_until(lambda: any(m.get("rank") == rank for m in self.messages))
        else:
            sink = ModelSink("channel", self.address, timeout_s=10, fallback=False)
            assert deliver(sink, rank, {"w": torch.full((3,), float(rank))})["via"] == "channel"
            assert (self.directory / part_name(rank)).exists()

    def rank_is_answered(self, rank: int) -> None:
        """A real rank's client that needs the driver to write back: a request's reply (the channel
        answers {} for a handler that does not), or the receiver's confirmation of a part."""
        if self.kind == "channel":
            client = ChannelClient(self.address, rank, connect_timeout=5.0)
            assert client.request("epoch", 10.0, epoch=1) == {}
            client.close()
        else:
            self.legit_rank_gets_through(rank)  # deliver() fails without the receiver's "ok"

    def threads(self) -> int:
        return sum(t.name == THREAD_NAMES[self.kind] for t in threading.enumerate())

    def close(self) -> None:
        self.server.close()


@contextmanager
def serving(kind: str, tmp_path: Path, **limits: Any) -> Iterator[Server]:
    server = Server(kind, AdmissionLimits(**limits), tmp_path)
    try:
        yield server
    finally:
        server.close()


class AuthenticatedRank:
    """A rank's connection driven by hand, past its hello: it holds no pending place any more."""

    def __init__(self, server: Server, rank: int, payload: bytes = b"part" * 64) -> None:
        address, self.payload, self.server = server.address, payload, server
        self.sock = socket.create_connection((address.host, address.port), timeout=5)
        self.stream = self.sock.makefile("rb")
        self.challenge = challenge_of(read_frame(self.stream, 1 << 16))
        fields = {} if server.kind == "channel" else {"bytes": len(payload)}
        self.sock.sendall(hello_frame(address.secret, server.purpose, self.challenge, rank, **fields))
        self.inbound = FrameSeal(address.secret, self.challenge, TO_PEER)
        assert read_frame(self.stream, 1 << 16, self.inbound) == {"welcome": 1}  # admitted as a rank

    def finish(self) -> None:
        """Send what the rank came for and see it taken."""
        secret = self.server.address.secret
        if self.server.kind == "channel":
            self.sock.sendall(encode_frame({"kind": "late"}, FrameSeal(secret, self.challenge, TO_DRIVER)))
            wait_until(lambda: any(m.get("kind") == "late" for m in self.server.messages))
        else:
            tag = StreamTag(secret, self.challenge)
            tag.update(self.payload)
            self.sock.sendall(self.payload + tag.digest())
            reply = read_frame(self.stream, 1 << 16, self.inbound)
            assert reply is not None and reply["ok"] is True, reply
        self.stream.close()
        self.sock.close()


def idle_connection(address: ChannelAddress) -> socket.socket:
    return socket.create_connection((address.host, address.port), timeout=5)


def closed_without_a_word(sock: socket.socket, within_s: float) -> bool:
    """Whether the server closed this connection within `within_s`, having sent nothing (no challenge)."""
    sock.settimeout(within_s)
    try:
        return sock.recv(1 << 16) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]


@pytest.mark.parametrize("kind", SERVERS)
def test_connections_over_the_pending_cap_are_closed_at_once_and_ranks_still_get_through(
        kind: str, tmp_path: Path) -> None:
    with serving(kind, tmp_path, max_pending=4, evict_after_s=30.0, hello_deadline_s=30.0) as server, \
            ExitStack() as stack:
        rank = AuthenticatedRank(server, 1)
        idle = [stack.enter_context(idle_connection(server.address)) for _ in range(4)]
        for sock in idle:  # each has its challenge: admitted, and now holding one of the 4 places
            assert sock.recv(1 << 16)
        threads_before = server.threads()
        started = time.monotonic()
        over = [stack.enter_context(idle_connection(server.address)) for _ in range(20)]
        assert all(closed_without_a_word(sock, 2.0) for sock in over)
        assert time.monotonic() - started < 3.0  # closed at once, not at the 30 s hello deadline
        assert server.threads() <= threads_before  # no thread for any of them
        rank.finish()  # an authenticated connection is not held to the cap
        for sock in idle:
            sock.close()
        wait_until(lambda: server.server.refused == 24)  # the 20 over the cap, the 4 that hung up
        server.legit_rank_gets_through(2)


@pytest.mark.parametrize("kind", SERVERS)
def test_a_rank_takes_the_place_of_the_oldest_idle_connection_once_it_had_its_time(
        kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="sparkdl")
    with serving(kind, tmp_path, max_pending=4, evict_after_s=0.3, hello_deadline_s=30.0) as server, \
            ExitStack() as stack:
        idle = []
        for _ in range(4):  # one at a time: the first is the oldest
            idle.append(stack.enter_context(idle_connection(server.address)))
            assert idle[-1].recv(1 << 16)  # its challenge: it holds a place
        time.sleep(0.4)
        server.legit_rank_gets_through(0)  # no place free: it took the oldest one's
        assert closed_without_a_word(idle[0], 2.0)
        assert not any(closed_without_a_word(sock, 0.2) for sock in idle[1:])  # the others still wait
        wait_until(lambda: server.server.refused == 1)
        assert "its place went to a newer connection" in refusals(caplog)[0], refusals(caplog)


@pytest.mark.parametrize("kind", SERVERS)
def test_a_rank_refused_at_once_tries_again_and_gets_through(kind: str, tmp_path: Path) -> None:
    with serving(kind, tmp_path, max_pending=2, evict_after_s=30.0, hello_deadline_s=1.0) as server, \
            ExitStack() as stack:
        for _ in range(2):  # every place taken, none given up before the hello deadline
            assert stack.enter_context(idle_connection(server.address)).recv(1 << 16)
        started = time.monotonic()
        server.legit_rank_gets_through(0)  # refused at once, again and again, until the idle ones are cut
        assert 0.5 < time.monotonic() - started < 5.0
        assert server.server.refused >= 3  # the two idle ones and at least the rank's first try


@pytest.mark.parametrize("kind", SERVERS)
def test_a_rank_evicted_while_its_hello_waited_unread_tries_again_and_gets_through(
        kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver too busy to read a rank's hello for evict_after_s gives its place to a newer
    connection and shuts its socket; the hello, buffered, still holds. That connection must not be
    taken for a rank's (nothing can be written back on it): it is refused, and the rank, never
    welcomed, tries again."""
    caplog.set_level(logging.WARNING, logger="sparkdl")
    buffered, busy_until, calls = threading.Event(), threading.Event(), itertools.count()

    def busy_driver_reads_hello(conn: socket.socket, deadline: float, max_bytes: int) -> Any:
        if next(calls) == 0:  # the rank's first connection: its hello arrives and waits unread
            assert conn.recv(1, socket.MSG_PEEK)
            buffered.set()
            assert busy_until.wait(10.0)
        return read_hello(conn, deadline, max_bytes)

    monkeypatch.setattr(channel_module if kind == "channel" else model_transfer, "read_hello", busy_driver_reads_hello)
    with serving(kind, tmp_path, max_pending=1, evict_after_s=0.05, hello_deadline_s=30.0) as server:
        failures: list[BaseException] = []
        rank = threading.Thread(target=lambda: run_catching(lambda: server.rank_is_answered(0), failures))
        rank.start()
        assert buffered.wait(5.0)
        time.sleep(0.1)  # the rank's place has had its evict_after_s
        with idle_connection(server.address) as newer:
            assert newer.recv(1 << 16)  # its challenge: it took the rank's place
            busy_until.set()
            rank.join(20.0)
            assert not rank.is_alive() and failures == [], failures
            assert closed_without_a_word(newer, 2.0)  # the rank's next try took its place in turn
        wait_until(lambda: server.server.refused == 2)
        assert "its hello not read after 0.05 s" in refusals(caplog)[0], refusals(caplog)


def run_catching(action: Callable[[], None], failures: list[BaseException]) -> None:
    try:
        action()
    except BaseException as exc:  # an assertion in a thread would go unseen
        failures.append(exc)


@pytest.mark.parametrize("kind", SERVERS)
def test_a_client_sending_a_byte_at_a_time_is_cut_at_the_hello_deadline(
        kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="sparkdl")
    with serving(kind, tmp_path, hello_deadline_s=1.5) as server, idle_connection(server.address) as sock:
        started = time.monotonic()
        assert sock.recv(1 << 16)  # the challenge
        hello = FRAME_HEADER.pack(200) + b"{" + b" " * 199  # a frame that would never end in time
        cut = threading.Event()

        def trickle() -> None:  # every byte renews a per-recv timeout; a deadline is not renewed
            for byte in hello:
                if cut.is_set():
                    return
                try:
                    sock.send(bytes([byte]))
                except OSError:
                    return
                time.sleep(0.3)

        sender = threading.Thread(target=trickle, daemon=True)
        sender.start()
        assert closed_without_a_word(sock, 10.0)
        elapsed = time.monotonic() - started
        cut.set()
        sender.join(2.0)
        assert 1.2 < elapsed < 3.0, elapsed
        wait_until(lambda: server.server.refused == 1)
        assert any("no hello within 1.5 s" in m for m in refusals(caplog)), refusals(caplog)
        server.legit_rank_gets_through(0)


@pytest.mark.parametrize("kind", SERVERS)
def test_an_announced_1_mib_hello_is_refused_by_its_length_before_any_read(
        kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="sparkdl")
    with serving(kind, tmp_path, hello_deadline_s=30.0) as server, idle_connection(server.address) as sock:
        assert sock.recv(1 << 16)  # the challenge
        sock.sendall(FRAME_HEADER.pack(1 << 20))  # the length alone: the body never comes
        started = time.monotonic()
        assert closed_without_a_word(sock, 5.0)
        assert time.monotonic() - started < 2.0  # not waiting for a megabyte that will not come
        wait_until(lambda: server.server.refused == 1)
        assert any("a hello of 1048576 bytes exceeds max_hello_bytes=4096" in m for m in refusals(caplog))


def test_read_hello_refuses_by_the_length_prefix_and_never_allocates_the_announced_size() -> None:
    server, client = socket.socketpair()
    with server, client:
        client.sendall(FRAME_HEADER.pack(1 << 20) + b"x" * 8)
        with pytest.raises(FrameError, match="exceeds max_hello_bytes=4096"):
            read_hello(server, time.monotonic() + 5, 4096)
        assert server.recv(16) == b"x" * 8  # the body was left unread: refused on the length alone
    server, client = socket.socketpair()
    with server, client:  # a length within a (large) cap, and 1 KiB of it before the peer leaves
        client.sendall(FRAME_HEADER.pack(1 << 20) + b"{" * 1024)
        client.shutdown(socket.SHUT_WR)
        tracemalloc.start()
        try:
            with pytest.raises(FrameError, match="closed in the middle"):
                read_hello(server, time.monotonic() + 5, 2 << 20)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 64 << 10, peak  # what arrived, not the megabyte announced


class ThreadsRunOut(threading.Thread):
    """A real thread whose first `failures` starts fail as they do when a process is out of threads."""

    failures = 0

    def start(self) -> None:
        if ThreadsRunOut.failures > 0:
            ThreadsRunOut.failures -= 1
            raise RuntimeError("can't start new thread")
        super().start()


@pytest.mark.parametrize("kind", SERVERS)
def test_a_thread_that_cannot_start_closes_its_connection_and_the_server_goes_on(
        kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.WARNING, logger="sparkdl")
    monkeypatch.setattr(admission, "Thread", ThreadsRunOut)
    monkeypatch.setattr(ThreadsRunOut, "failures", 3)
    with serving(kind, tmp_path, log_interval_s=60.0) as server:
        for _ in range(3):
            with idle_connection(server.address) as sock:
                assert closed_without_a_word(sock, 2.0)
        wait_until(lambda: server.server.refused == 3)
        server.legit_rank_gets_through(0)
        server.legit_rank_gets_through(1)
        logged = refusals(caplog)
        assert len(logged) == 1 and "no thread to serve it (can't start new thread)" in logged[0], logged


@pytest.mark.parametrize("kind", SERVERS)
def test_refusals_are_logged_at_most_once_per_interval_with_the_count_of_the_rest(
        kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="sparkdl")
    with serving(kind, tmp_path, log_interval_s=60.0) as server:
        forged = ChannelAddress(server.address.host, server.address.port, "0" * 64)
        for _ in range(30):
            with idle_connection(forged) as sock, sock.makefile("rb") as stream:
                challenge = challenge_of(read_frame(stream, 1 << 16))
                sock.sendall(hello_frame(forged.secret, server.purpose, challenge, 0, bytes=1))
                assert closed_without_a_word(sock, 5.0)
        wait_until(lambda: server.server.refused == 30)
        assert len(refusals(caplog)) == 1 and "wrong secret" in refusals(caplog)[0]
        server.legit_rank_gets_through(0)
    logged = [r.getMessage() for r in caplog.records]
    assert any("29 more connections refused since the last warning" in m for m in logged), logged


def test_a_refusal_after_the_interval_is_logged_with_the_count_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="sparkdl")
    now = [0.0]
    limited = RateLimitedLog(10.0, clock=lambda: now[0])
    for second in (0.0, 1.0, 2.0, 9.9, 10.5, 11.0):
        now[0] = second
        limited.warning("refused %s", second)
    assert [r.getMessage() for r in caplog.records] == ["refused 0.0", "refused 10.5 (3 more not logged in the last 10 s)"]
    limited.flush("%d more")
    assert caplog.records[-1].getMessage() == "1 more"


def test_the_pending_cap_leaves_room_for_every_rank_of_a_large_run() -> None:
    assert AdmissionLimits().max_pending == 64 and AdmissionLimits().for_ranks(8).max_pending == 64
    assert AdmissionLimits().for_ranks(512).max_pending == 1024
    assert AdmissionLimits().max_hello_bytes == 4096 and AdmissionLimits().hello_deadline_s == 5.0
