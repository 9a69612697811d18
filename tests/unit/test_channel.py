"""The driver channel over real sockets on 127.0.0.1 (no mocks, no Spark, no torch)."""
from __future__ import annotations

import io
import logging
import pickle
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable, Iterator

import pytest

from sparkdl.driver.channel import DriverChannel
from sparkdl.wire.admission import AdmissionLimits
from sparkdl.wire.frames import PURPOSE, ChannelAddress, challenge_of, encode_frame, hello_frame, read_frame
from sparkdl.wire.handshake import TO_DRIVER, TO_PEER, FrameSeal
from sparkdl.executor.channel_client import ChannelClient
from sparkdl.executor.output import LineForwarder, forward_output

pytestmark = pytest.mark.timeout(20)  # a hang here is a bug: fail fast instead of at the 1200 s default


class Inbox:
    """on_message target that records messages (thread-safe) and can wait for a count."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self._cond = threading.Condition()

    def __call__(self, msg: dict[str, Any]) -> None:
        with self._cond:
            self.messages.append(msg)
            self._cond.notify_all()

    def wait_for(self, n: int, timeout: float = 2.0) -> list[dict[str, Any]]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.messages) >= n, timeout), self.messages
            return list(self.messages)


@pytest.fixture
def inbox() -> Inbox:
    return Inbox()


@pytest.fixture
def channel(inbox: Inbox) -> Iterator[DriverChannel]:
    with DriverChannel("127.0.0.1", inbox) as ch:
        yield ch


def wait_until(cond: Callable[[], bool], timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def raw_connect(address: ChannelAddress) -> socket.socket:
    return socket.create_connection((address.host, address.port), timeout=2.0)


class RawPeer:
    """A connection driven by hand: reads the driver's challenge and prepares the answer (`hello`,
    with the run's secret unless given another) and the tags of the frames after it (`frame`)."""

    def __init__(self, address: ChannelAddress, rank: int = 0, secret: str | None = None) -> None:
        self.sock = raw_connect(address)
        self.stream = self.sock.makefile("rb")
        self.challenge = challenge_of(read_frame(self.stream, 1 << 20))
        secret = address.secret if secret is None else secret
        self.hello = hello_frame(secret, PURPOSE, self.challenge, rank)
        self.outbound, self.inbound = FrameSeal(secret, self.challenge, TO_DRIVER), FrameSeal(secret, self.challenge, TO_PEER)

    def frame(self, obj: dict[str, Any]) -> bytes:
        return encode_frame(obj, self.outbound)

    def close(self) -> None:
        self.stream.close()
        self.sock.close()

    def __enter__(self) -> "RawPeer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def assert_closed_by_peer(sock: socket.socket) -> None:
    """The driver closes the connection (after its challenge and, to a hello that holds, its welcome:
    all it ever sends unasked)."""
    sock.settimeout(2.0)
    try:
        while sock.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass


def test_address_is_picklable_and_secret_is_long(channel: DriverChannel) -> None:
    address = channel.address
    assert pickle.loads(pickle.dumps(address)) == address
    assert address.port > 0 and len(address.secret) == 64


def test_three_clients_arrive_in_order_with_rank(channel: DriverChannel, inbox: Inbox) -> None:
    clients = [ChannelClient(channel.address, rank) for rank in range(3)]
    for step in range(50):
        for client in clients:
            client.send("metric", step=step, loss=1.0 / (step + 1))
    for client in clients:
        client.close()
    messages = inbox.wait_for(150)
    for rank in range(3):
        mine = [m for m in messages if m["rank"] == rank]
        assert [m["step"] for m in mine] == list(range(50))
        assert all(m["kind"] == "metric" for m in mine)
    assert channel.refused == 0 and all(c.dropped == 0 for c in clients)


def test_a_message_cannot_forge_its_rank(channel: DriverChannel, inbox: Inbox) -> None:
    client = ChannelClient(channel.address, 2)
    client.send("metric", rank=0, loss=0.5)
    client.close()
    assert inbox.wait_for(1)[0]["rank"] == 2


def test_wrong_secret_is_refused_and_logged(channel: DriverChannel, inbox: Inbox,
                                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="sparkdl")
    forged = ChannelAddress(channel.address.host, channel.address.port, "0" * 64)
    bad = ChannelClient(forged, 0, connect_timeout=1.0)  # never welcomed: it tries again for 1 s, then gives up
    bad.send("metric", loss=123.0)
    bad.close()
    assert bad.failed and bad.dropped == 1
    wait_until(lambda: channel.refused >= 2)
    good = ChannelClient(channel.address, 1)
    good.send("metric", loss=1.0)
    good.close()
    channel.close()
    assert [m["loss"] for m in inbox.messages] == [1.0]
    refusals = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
    assert len(refusals) == 1 and "wrong secret" in refusals[0]
    assert "from 127.0.0.1:" in refusals[0]


@pytest.mark.parametrize("payload, reason", [
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "exceeds max_hello_bytes"),  # "GET " read as a length
    (struct.pack(">I", 5) + b"\xff\xfe{}}", "not UTF-8 JSON"),
    (encode_frame({"kind": "metric", "loss": 1.0}), "not a hello"),
    (struct.pack(">I", 2_000_000), "exceeds max_hello_bytes"),
])
def test_garbage_and_oversized_frames_are_refused_without_killing_the_server(
        channel: DriverChannel, inbox: Inbox, caplog: pytest.LogCaptureFixture, payload: bytes, reason: str) -> None:
    caplog.set_level(logging.WARNING, logger="sparkdl")
    with raw_connect(channel.address) as sock:
        sock.sendall(payload)
        assert_closed_by_peer(sock)
    wait_until(lambda: channel.refused == 1)
    assert any(reason in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    client = ChannelClient(channel.address, 0)
    client.send("metric", loss=2.0)
    client.close()
    assert inbox.wait_for(1)[0]["loss"] == 2.0


def test_oversized_frame_after_hello_closes_only_that_connection(channel: DriverChannel, inbox: Inbox,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="sparkdl")
    with RawPeer(channel.address, 3) as peer:
        peer.sock.sendall(peer.hello + peer.frame({"kind": "a"}) + struct.pack(">I", 1 << 30))
        assert_closed_by_peer(peer.sock)
    assert inbox.wait_for(1) == [{"kind": "a", "rank": 3}]
    assert any("closed the connection" in r.getMessage() and "(rank 3)" in r.getMessage() for r in caplog.records)
    client = ChannelClient(channel.address, 0)
    client.send("metric", loss=3.0)
    client.close()
    assert inbox.wait_for(2)[1]["loss"] == 3.0


def test_client_to_closed_port_drops_quietly_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="sparkdl")
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = ChannelClient(ChannelAddress("127.0.0.1", port, "x" * 64), 0, connect_timeout=1.0)
    start = time.monotonic()
    for i in range(20):
        client.send("metric", step=i)
    assert time.monotonic() - start < 0.5
    wait_until(lambda: client.dropped == 20)
    client.send("metric", step=99)
    assert client.dropped == 21
    assert client.send_now("error", message="boom") is False
    client.close()
    warnings = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(warnings) == 1 and "reach the driver with the job's result" in warnings[0]


def test_full_queue_drops_instead_of_blocking() -> None:
    with socket.socket() as listener:  # accepts into the backlog but never reads: the sender stalls
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = ChannelAddress("127.0.0.1", listener.getsockname()[1], "x" * 64)
        client = ChannelClient(address, 0, queue_size=4)
        start = time.monotonic()
        for _ in range(300):  # 30 MB: far more than the kernel buffers hold
            client.send("log", line="y" * 100_000)
        assert time.monotonic() - start < 1.5  # a blocking send would sit here for connect_timeout (10 s)
        assert client.dropped > 0
        client.close(timeout=0.2)
        assert client.dropped > 0


def test_on_message_raising_does_not_stop_later_messages(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="sparkdl")
    seen: list[int] = []

    def handler(msg: dict[str, Any]) -> None:
        seen.append(msg["i"])
        if msg["i"] % 2 == 0:
            raise RuntimeError("mlflow is down")

    with DriverChannel("127.0.0.1", handler) as ch:
        client = ChannelClient(ch.address, 0)
        for i in range(10):
            client.send("metric", i=i)
        client.close()
        wait_until(lambda: len(seen) == 10)
        assert ch.handler_errors == 5
    assert seen == list(range(10))
    assert sum("on_message failed" in r.getMessage() for r in caplog.records) == 1


def test_send_now_delivers_synchronously(channel: DriverChannel, inbox: Inbox) -> None:
    client = ChannelClient(channel.address, 1)
    client.send("metric", step=1)
    assert client.send_now("error", message="CUDA out of memory", traceback="...") is True
    messages = inbox.wait_for(2)
    assert [m["kind"] for m in messages] == ["metric", "error"] and messages[1]["rank"] == 1
    client.close()


def test_unserialisable_fields_become_strings(channel: DriverChannel, inbox: Inbox) -> None:
    client = ChannelClient(channel.address, 0)
    client.send("metric", value=object(), nested={"x": {1, 2}}, loss=float("nan"))
    client.close()
    msg = inbox.wait_for(1)[0]
    assert msg["value"].startswith("<object object") and msg["nested"]["x"] == "{1, 2}"
    assert msg["loss"] != msg["loss"]  # NaN survives (Python's JSON reads it back)


def test_drain_waits_for_in_flight_messages() -> None:
    gate, handled = threading.Event(), []

    def slow(msg: dict[str, Any]) -> None:
        gate.wait(2.0)
        time.sleep(0.01)
        handled.append(msg["i"])

    with DriverChannel("127.0.0.1", slow) as ch:
        with RawPeer(ch.address) as peer:
            sock = peer.sock
            sock.sendall(peer.hello + b"".join(peer.frame({"kind": "m", "i": i}) for i in range(10)))
            wait_until(lambda: ch._pending == 10)  # all received (queued), none handled: the handler is gated
            assert handled == []
            gate.set()
            ch.drain(timeout=2.0)
            assert handled == list(range(10))
            gate.clear()
            sock.sendall(peer.frame({"kind": "m", "i": 10}))
            wait_until(lambda: ch._pending == 1)
            start = time.monotonic()
            ch.drain(timeout=0.1)  # a stuck handler: drain gives up after its timeout
            assert 0.09 < time.monotonic() - start < 1.0 and len(handled) == 10
            gate.set()


def test_close_is_idempotent_and_handles_what_was_sent(inbox: Inbox) -> None:
    ch = DriverChannel("127.0.0.1", inbox)
    client = ChannelClient(ch.address, 0)
    for i in range(100):
        client.send("metric", i=i)
    client.close()
    client.close()
    ch.close()
    ch.close()
    assert [m["i"] for m in inbox.messages] == list(range(100))
    with pytest.raises(OSError):
        raw_connect(ch.address)
    assert not any(t.name.startswith("sparkdl-channel") and t.is_alive() for t in threading.enumerate()
                   if t.name != "sparkdl-channel-client")


def test_close_reads_from_still_connected_clients(inbox: Inbox) -> None:
    ch = DriverChannel("127.0.0.1", inbox)
    with RawPeer(ch.address, 4) as peer:  # stays open while the driver closes
        peer.sock.sendall(peer.hello + peer.frame({"kind": "m"}))
        wait_until(lambda: len(inbox.messages) == 1)
        start = time.monotonic()
        ch.close()
        assert time.monotonic() - start < 1.0
    assert inbox.messages == [{"kind": "m", "rank": 4}]


class Tap:
    """A relay between one client and the driver that keeps a copy of what the client sends: a host
    on the path of the connection, as on a shared network."""

    def __init__(self, target: ChannelAddress) -> None:
        self.sent = bytearray()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = ChannelAddress("127.0.0.1", self._listener.getsockname()[1], target.secret)
        self._target = target
        self._thread = threading.Thread(target=self._relay, daemon=True)
        self._thread.start()

    def _relay(self) -> None:
        client, _ = self._listener.accept()
        driver = socket.create_connection((self._target.host, self._target.port))

        def pump(source: socket.socket, sink: socket.socket, copy: bytearray | None) -> None:
            while chunk := source.recv(1 << 16):
                if copy is not None:
                    copy += chunk
                sink.sendall(chunk)
            sink.shutdown(socket.SHUT_WR)

        back = threading.Thread(target=pump, args=(driver, client, None), daemon=True)
        back.start()
        pump(client, driver, self.sent)
        back.join(5.0)
        client.close()
        driver.close()
        self._listener.close()

    def join(self) -> bytes:
        self._thread.join(5.0)
        return bytes(self.sent)


def test_a_connection_seen_on_the_wire_cannot_be_replayed_and_never_shows_the_secret(
        channel: DriverChannel, inbox: Inbox, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="sparkdl")
    tap = Tap(channel.address)
    client = ChannelClient(tap.address, 1)
    for step in range(3):
        client.send("metric", step=step, loss=0.5)
    client.close()
    seen = tap.join()
    assert [m["step"] for m in inbox.wait_for(3)] == [0, 1, 2]
    assert channel.address.secret.encode() not in seen and b"secret" not in seen
    with raw_connect(channel.address) as sock:  # the same bytes again, on a connection of its own
        sock.sendall(seen)
        assert_closed_by_peer(sock)
    wait_until(lambda: channel.refused == 1)
    channel.close()
    assert [m["step"] for m in inbox.messages] == [0, 1, 2]
    assert any("wrong secret" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("tamper", ["altered", "replayed", "reordered", "untagged"])
def test_a_frame_altered_replayed_or_reordered_on_a_live_connection_closes_it(
        channel: DriverChannel, inbox: Inbox, caplog: pytest.LogCaptureFixture, tamper: str) -> None:
    caplog.set_level(logging.WARNING, logger="sparkdl")
    with RawPeer(channel.address, 2) as peer:
        first, second = peer.frame({"kind": "m", "loss": 1.0}), peer.frame({"kind": "m", "loss": 2.0})
        forged = {"altered": first + second.replace(b"2.0", b"9.0"), "replayed": first + first,
                  "reordered": second + first, "untagged": first + encode_frame({"kind": "m", "loss": 9.0})}[tamper]
        peer.sock.sendall(peer.hello + forged)
        assert_closed_by_peer(peer.sock)
    wait_until(lambda: any("authentication tag" in r.getMessage() for r in caplog.records))
    channel.close()
    assert [m["loss"] for m in inbox.messages] == ([] if tamper == "reordered" else [1.0])


def test_silent_peer_is_refused_after_hello_timeout(inbox: Inbox, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="sparkdl")
    with DriverChannel("127.0.0.1", inbox, limits=AdmissionLimits(hello_deadline_s=0.2)) as ch, \
            raw_connect(ch.address) as sock:
        assert_closed_by_peer(sock)
        wait_until(lambda: ch.refused == 1)
    assert any("no hello within 0.2 s" in r.getMessage() for r in caplog.records)


class Recorder:
    """A stand-in client: LineForwarder only calls send()."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send(self, kind: str, **fields: Any) -> None:
        self.sent.append({"kind": kind, **fields})


def test_line_forwarder_splits_cuts_and_writes_through() -> None:
    original, rec = io.StringIO(), Recorder()
    fw = LineForwarder(original, rec, "stdout", max_line=10)  # type: ignore[arg-type]
    fw.write("epoch 1\nepo")
    fw.write("ch 2\r\n" + "x" * 25 + "\npartial")
    assert [m["line"] for m in rec.sent] == ["epoch 1", "epoch 2", "x" * 10 + " ... [cut: 15 more chars]"]
    assert all(m["kind"] == "log" and m["stream"] == "stdout" for m in rec.sent)
    fw.flush()
    assert len(rec.sent) == 3  # flush() alone does not send the unfinished line
    fw.close()
    fw.close()
    assert rec.sent[-1]["line"] == "partial" and len(rec.sent) == 4
    assert original.getvalue() == "epoch 1\nepoch 2\r\n" + "x" * 25 + "\npartial"


def test_line_forwarder_bounds_a_line_without_newlines() -> None:
    rec = Recorder()
    fw = LineForwarder(io.StringIO(), rec, "stderr")  # type: ignore[arg-type]
    for _ in range(100):
        fw.write("\r 42%|####      | " + "z" * 100)
    fw.write("\n")
    (line,) = [m["line"] for m in rec.sent]
    assert len(line) < 2100 and line.endswith("more chars]")


def test_forward_output_end_to_end(channel: DriverChannel, inbox: Inbox, capsys: pytest.CaptureFixture[str]) -> None:
    client = ChannelClient(channel.address, 0)
    with forward_output(client):
        print("hello driver")
        print("oops", file=sys.stderr, end="")
    client.close()
    messages = inbox.wait_for(2)
    assert {(m["stream"], m["line"]) for m in messages} == {("stdout", "hello driver"), ("stderr", "oops")}
    assert capsys.readouterr().out == "hello driver\n"


def test_forward_output_restores_streams_on_exception() -> None:
    rec = Recorder()
    before_out, before_err = sys.stdout, sys.stderr
    with pytest.raises(RuntimeError, match="boom"):
        with forward_output(rec):  # type: ignore[arg-type]
            assert isinstance(sys.stdout, LineForwarder) and isinstance(sys.stderr, LineForwarder)
            sys.stdout.write("last words")
            raise RuntimeError("boom")
    assert sys.stdout is before_out and sys.stderr is before_err
    assert rec.sent == [{"kind": "log", "stream": "stdout", "line": "last words"}]


def test_forward_output_rejects_unknown_streams() -> None:
    with pytest.raises(ValueError, match="stdin"):
        with forward_output(Recorder(), streams=("stdin",)):  # type: ignore[arg-type]
            pass


def test_channel_module_imports_only_the_stdlib(repo_root: Any) -> None:
    import ast
    tree = ast.parse((repo_root / "sparkdl" / "wire" / "frames.py").read_text())
    roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert roots <= set(sys.stdlib_module_names) | {"__future__", "sparkdl"}, roots
    sparkdl_modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                       and n.module.startswith("sparkdl")}
    assert sparkdl_modules == {"sparkdl.wire.handshake"}, sparkdl_modules
    handshake = ast.parse((repo_root / "sparkdl" / "wire" / "handshake.py").read_text())
    roots = {a.name.split(".")[0] for n in ast.walk(handshake) if isinstance(n, ast.Import) for a in n.names}
    roots |= {n.module.split(".")[0] for n in ast.walk(handshake) if isinstance(n, ast.ImportFrom) and n.module}
    assert roots <= set(sys.stdlib_module_names) | {"__future__"}, roots


def replying(verdict: Callable[[dict[str, Any]], dict[str, Any] | None]) -> Callable[[dict[str, Any]], None]:
    """on_message that answers each request with verdict(msg) (None: no reply) and records everything."""
    seen: list[dict[str, Any]] = []

    def handler(msg: dict[str, Any]) -> None:
        seen.append(msg)
        if "reply" in msg and (answer := verdict(msg)) is not None:
            msg["reply"](answer)
    handler.seen = seen  # type: ignore[attr-defined]
    return handler


def test_request_gets_the_handlers_reply() -> None:
    handler = replying(lambda msg: {"stop": msg["epoch"] >= 2, "reason": f"epoch {msg['epoch']}"})
    with DriverChannel("127.0.0.1", handler) as ch:
        client = ChannelClient(ch.address, 0)
        assert client.request("epoch", 2.0, epoch=1, loss=0.5) == {"stop": False, "reason": "epoch 1"}
        assert client.request("epoch", 2.0, epoch=2) == {"stop": True, "reason": "epoch 2"}
        client.close()
    msg = handler.seen[0]  # type: ignore[attr-defined]
    assert callable(msg.pop("reply")) and msg == {"kind": "epoch", "epoch": 1, "loss": 0.5, "rank": 0}


@pytest.mark.parametrize("broken", ["never replies", "raises"])
def test_a_request_the_handler_does_not_answer_gets_an_empty_reply(broken: str) -> None:
    def handler(msg: dict[str, Any]) -> None:
        if broken == "raises":
            raise RuntimeError("mlflow is down")

    with DriverChannel("127.0.0.1", handler) as ch:
        client = ChannelClient(ch.address, 0)
        start = time.monotonic()
        assert client.request("epoch", 5.0, epoch=1) == {}
        assert time.monotonic() - start < 1.0
        assert ch.handler_errors == (broken == "raises")
        client.close()


def test_only_the_first_reply_counts_and_a_bad_one_becomes_empty(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="sparkdl")
    circular: dict[str, Any] = {}
    circular["self"] = circular
    answers = iter([{"n": 1}, circular, {"big": "x" * 2_000_000}])

    def handler(msg: dict[str, Any]) -> None:
        msg["reply"](next(answers))
        msg["reply"]({"second": True})  # ignored: one reply per request

    with DriverChannel("127.0.0.1", handler) as ch:
        client = ChannelClient(ch.address, 0)
        assert [client.request("epoch", 2.0) for _ in range(3)] == [{"n": 1}, {}, {}]
        client.close()
    assert sum("not encodable or too large" in r.getMessage() for r in caplog.records) == 2


def test_timed_out_request_returns_none_and_its_late_reply_is_not_taken_for_the_next() -> None:
    gate = threading.Event()

    def handler(msg: dict[str, Any]) -> None:
        if msg["epoch"] == 1:
            gate.wait(5.0)
        msg["reply"]({"epoch": msg["epoch"]})

    with DriverChannel("127.0.0.1", handler) as ch:
        client = ChannelClient(ch.address, 0)
        start = time.monotonic()
        assert client.request("epoch", 0.3, epoch=1) is None
        assert 0.25 < time.monotonic() - start < 1.0
        time.sleep(0.2)  # the sender thread stops waiting for it too (its deadline is a hair later)
        gate.set()  # the reply to epoch 1 is written now, before the one to epoch 2
        assert client.request("epoch", 2.0, epoch=2) == {"epoch": 2}
        assert client.request("epoch", 2.0, epoch=3) == {"epoch": 3}
        client.close()
        assert client.dropped == 0


def test_request_is_answered_after_the_messages_sent_before_it() -> None:
    handler = replying(lambda msg: {"handled_before": len(handler.seen) - 1})  # type: ignore[attr-defined]
    with DriverChannel("127.0.0.1", handler) as ch:
        client = ChannelClient(ch.address, 1)
        for i in range(50):
            client.send("metric", i=i)
        assert client.request("epoch", 2.0, epoch=1) == {"handled_before": 50}
        client.send("metric", i=50)
        client.close()
        ch.drain()
    assert [m["kind"] for m in handler.seen] == ["metric"] * 50 + ["epoch", "metric"]  # type: ignore[attr-defined]


def test_a_plain_send_cannot_pose_as_a_request() -> None:
    handler = replying(lambda msg: {"to": msg["kind"]})
    with DriverChannel("127.0.0.1", handler) as ch:
        client = ChannelClient(ch.address, 0)
        client.send("metric", request=1, loss=1.0)  # would be answered, and that reply taken for request 1's
        assert client.request("epoch", 2.0) == {"to": "epoch"}
        client.close()
    assert handler.seen[0] == {"kind": "metric", "loss": 1.0, "rank": 0}  # type: ignore[attr-defined]


def test_request_on_a_raw_connection_gets_a_reply_frame(channel: DriverChannel, inbox: Inbox) -> None:
    with RawPeer(channel.address, 2) as peer:
        peer.sock.sendall(peer.hello)
        assert read_frame(peer.stream, 1 << 20, peer.inbound) == {"welcome": 1}  # the first sealed frame
        peer.sock.sendall(peer.frame({"kind": "epoch", "request": "abc"}))
        reply = read_frame(peer.stream, 1 << 20, peer.inbound)
    assert reply == {"reply": "abc"}  # Inbox never replies: the channel answers {}
    assert inbox.messages[0]["rank"] == 2 and "request" not in inbox.messages[0]


def test_request_to_an_unreachable_driver_returns_none_quickly() -> None:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = ChannelClient(ChannelAddress("127.0.0.1", port, "x" * 64), 0, connect_timeout=1.0)
    start = time.monotonic()
    assert client.request("epoch", 5.0, epoch=1) is None
    assert client.request("epoch", 5.0, epoch=2) is None  # failed: refused at once
    assert time.monotonic() - start < 1.0
    client.close()
    assert client.request("epoch", 5.0) is None


def test_request_that_cannot_be_sent_returns_none(channel: DriverChannel, inbox: Inbox) -> None:
    client = ChannelClient(channel.address, 0)
    circular: list[Any] = []
    circular.append(circular)
    assert client.request("epoch", 2.0, history=circular) is None
    assert client.request("epoch", 2.0, blob="x" * 2_000_000) is None
    assert client.request("epoch", 2.0, epoch=1) == {}  # the channel is still fine
    client.close()
    assert client.request("epoch", 2.0, epoch=2) is None  # closed


def test_a_reply_breaking_the_protocol_fails_the_client(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="sparkdl")
    with socket.socket() as listener:  # a fake driver whose reply frame is oversized
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        client = ChannelClient(ChannelAddress("127.0.0.1", listener.getsockname()[1], "x" * 64), 0)
        result: list[Any] = []
        thread = threading.Thread(target=lambda: result.append(client.request("epoch", 5.0)))
        thread.start()
        conn, _ = listener.accept()
        with conn:
            stream, challenge = conn.makefile("rb"), b"c" * 32
            conn.sendall(encode_frame({"challenge": challenge.hex()}))
            assert read_frame(stream, 1 << 20)["hello"] == 2  # type: ignore[index]
            outbound = FrameSeal("x" * 64, challenge, TO_PEER)
            conn.sendall(encode_frame({"welcome": 1}, outbound))
            rid = read_frame(stream, 1 << 20, FrameSeal("x" * 64, challenge, TO_DRIVER))["request"]  # type: ignore[index]
            stale = encode_frame({"reply": rid + 1}, outbound)
            conn.sendall(stale + struct.pack(">I", 2_000_000))  # stale, then too big
            start = time.monotonic()
            thread.join(5.0)
            assert result == [None] and time.monotonic() - start < 1.0
            stream.close()
    client.send("metric", loss=1.0)
    assert client.dropped == 2  # the request and the send after it
    client.close()
    assert any("exceeds max_frame_bytes" in r.getMessage() for r in caplog.records)
