"""Rank 0's TCPStore listens on the executor's own address only (not every interface of its host)."""
from __future__ import annotations

import datetime
import socket

import pytest

from sparkdl.comm.interfaces import interface_addresses
from sparkdl.comm.torch_dist import TorchDistCommunicator, store_bind_address


def _non_loopback_ipv4() -> str | None:
    for addresses in interface_addresses().values():
        for address in addresses:
            if "." in address and not address.startswith("127."):
                return address
    return None


def _answers(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=2.0).close()
        return True
    except OSError:
        return False


def test_the_store_answers_on_its_address_and_nowhere_else() -> None:
    own = _non_loopback_ipv4()
    if own is None:
        pytest.skip("no non-loopback IPv4 interface on this machine")
    port, store = TorchDistCommunicator.listen(5.0, own)
    try:
        assert _answers(own, port)
        assert not _answers("127.0.0.1", port)  # before: bound to 0.0.0.0, reachable on loopback too
        store.set("k", "v")  # the server still serves (a client of its own)
        import torch.distributed as dist

        client = dist.TCPStore(own, port, None, False, timeout=datetime.timedelta(seconds=5))
        assert client.get("k") == b"v"
    finally:
        del store


def test_an_address_no_interface_holds_listens_everywhere() -> None:
    # A NAT or proxy address: peers dial it, the packets arrive on some interface here ("": all).
    assert store_bind_address("198.18.0.250") == ""
    assert store_bind_address("") == ""
    assert store_bind_address("127.0.0.1") == "127.0.0.1"


def test_with_no_address_the_store_answers_everywhere() -> None:
    port, store = TorchDistCommunicator.listen(5.0, "")
    try:
        assert _answers("127.0.0.1", port)
        own = _non_loopback_ipv4()
        assert own is None or _answers(own, port)
    finally:
        del store
