"""The peer probe and interface choice that run before the collectives (comm/reachability.py,
comm/interfaces.py), on real sockets of this host."""
from __future__ import annotations

import os
import socket

import pytest

from sparkdl.comm import interfaces
from sparkdl.comm.reachability import PeerProbe, dial_one, dial_peers
from sparkdl.errors import ConfigError


def test_a_listening_peer_is_reached_and_a_closed_port_is_named_within_seconds() -> None:
    probe = PeerProbe("127.0.0.1")
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{closed.getsockname()[1]}"  # bound, never listening: refused
    try:
        dial_peers(0, "127.0.0.1", ["127.0.0.1:1", probe.address])  # its own entry is skipped
        with pytest.raises(ConfigError) as raised:
            dial_peers(1, "127.0.0.1", [dead, probe.address], deadline_s=5)
        message = str(raised.value)
        assert "rank 1" in message and "rank 0" in message and dead in message
        assert socket.gethostname() in message and "GLOO_SOCKET_IFNAME" in message
    finally:
        probe.close()


def test_dial_one_names_the_peer_rank_it_dialled() -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{closed.getsockname()[1]}"
    with pytest.raises(ConfigError, match=f"rank 2 .* cannot reach rank 0 at {endpoint}"):
        dial_one(2, "127.0.0.1", 0, endpoint, deadline_s=3)


def test_the_interface_holding_loopback_is_found_and_gloo_is_pointed_at_it(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    loopback = interfaces.interface_of("127.0.0.1")
    assert loopback is not None and "127.0.0.1" in interfaces.interface_addresses()[loopback]
    assert interfaces.interface_of("198.18.0.250") is None  # on no interface of this host
    monkeypatch.delenv(interfaces.GLOO_INTERFACE_ENV, raising=False)
    assert interfaces.gloo_interface_env("127.0.0.1") == {interfaces.GLOO_INTERFACE_ENV: loopback}
    monkeypatch.setenv(interfaces.GLOO_INTERFACE_ENV, "eth9")  # the user's choice wins
    assert interfaces.gloo_interface_env("127.0.0.1") == {}


def test_the_ioctl_fallback_sees_the_same_ipv4_addresses_as_psutil() -> None:
    fallback = interfaces._linux_ipv4_addresses()  # noqa: SLF001
    full = interfaces.interface_addresses()
    assert fallback and all(set(addrs) <= set(full.get(name, [])) for name, addrs in fallback.items())


def test_a_host_name_on_loopback_across_hosts_is_refused_naming_the_setting(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(socket, "gethostname", lambda: "localhost")
    with pytest.raises(ConfigError, match="spark.executorEnv.GLOO_SOCKET_IFNAME"):
        interfaces.check_not_loopback_across_hosts("198.18.0.11", ("198.18.0.11", "198.18.0.12"), 0,
                                                   "GLOO_SOCKET_IFNAME")
    interfaces.check_not_loopback_across_hosts("127.0.0.1", ("127.0.0.1", "127.0.0.1"), 0, "GLOO_SOCKET_IFNAME")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    interfaces.check_not_loopback_across_hosts("198.18.0.11", ("198.18.0.11", "198.18.0.12"), 0,
                                               "GLOO_SOCKET_IFNAME")


def test_environment_is_restored_exactly(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("SPARKDL_T_A", "kept")
    monkeypatch.delenv("SPARKDL_T_B", raising=False)
    saved = interfaces.set_environment({"SPARKDL_T_A": "x", "SPARKDL_T_B": "y"})
    assert os.environ["SPARKDL_T_A"] == "x" and os.environ["SPARKDL_T_B"] == "y"
    interfaces.restore_environment(saved)
    assert os.environ["SPARKDL_T_A"] == "kept" and "SPARKDL_T_B" not in os.environ


def test_the_driver_is_taken_out_of_the_executor_list_wherever_it_sorts() -> None:
    from sparkdl.spark.session import without_driver

    # On separate hosts the driver's address need not sort first (issue 31: the key held the driver).
    executors = ["198.18.0.11:40001", "198.18.0.12:40002", "198.18.0.3:39999"]
    assert without_driver(sorted(executors), "198.18.0.3:39999") == ("198.18.0.11:40001", "198.18.0.12:40002")
    assert without_driver(["127.0.0.1:5000"], "127.0.0.1:5000") == ("127.0.0.1:5000",)  # local mode


def test_probe_messages_are_sized_to_the_link_from_a_first_measurement() -> None:
    from sparkdl.driver import probe

    at_20_mbit = probe.message_bytes(256 << 10, (256 << 10) / 2.5e6 + 0.001, 0.001)  # 20 Mbit/s = 2.5 MB/s
    assert abs(at_20_mbit - 2.5e6 * probe.TRANSFER_S) < 8 and at_20_mbit % 4 == 0
    assert probe.message_bytes(256 << 10, (256 << 10) / 125e6) == 12_500_000  # 1 Gbit/s: 0.1 s of it
    assert probe.message_bytes(256 << 10, (256 << 10) / 1.25e9) == probe.MAX_MESSAGE_BYTES  # 10 Gbit/s: the cap
    assert probe.message_bytes(256 << 10, 30.0) == probe.MIN_MESSAGE_BYTES  # a crawl: still a measurable size


def test_a_store_that_listens_late_is_waited_for() -> None:
    import threading
    import time

    with socket.socket() as spare:
        spare.bind(("127.0.0.1", 0))
        port = spare.getsockname()[1]
    late = socket.socket()

    def listen_later() -> None:
        time.sleep(0.6)
        late.bind(("127.0.0.1", port))
        late.listen(4)

    thread = threading.Thread(target=listen_later)
    thread.start()
    try:
        dial_one(1, "127.0.0.1", 0, f"127.0.0.1:{port}", deadline_s=10, wait_for_listener=True)
    finally:
        thread.join()
        late.close()


@pytest.mark.parametrize("code", ["EHOSTUNREACH", "EACCES"])
def test_no_route_or_a_rejecting_firewall_fails_at_once_even_for_a_late_listener(code: str) -> None:
    import errno
    import time

    calls: list[float] = []

    def rejected(address: tuple[str, int], timeout: float) -> None:  # what connect() raises on such a route
        calls.append(time.monotonic())
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    started = time.monotonic()
    with pytest.raises(ConfigError, match="rank 1 .* cannot reach rank 0 at 198.18.0.11:4000"):
        dial_peers(1, "198.18.0.12", ["198.18.0.11:4000", ""], deadline_s=20, dial=rejected, wait_for_listener=True)
    assert len(calls) == 1 and time.monotonic() - started < 1.0
