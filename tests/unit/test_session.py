"""sparkdl/spark/session.py without Spark: slot rules from conf values, the probe's overlap count, the
Connect file I/O (pyarrow), the channel address, launch.channel, and what a rank returns when its
driver channel is off or unreachable."""
from __future__ import annotations

import ipaddress
import socket
import sys

import pytest

from sparkdl.config.training import check_channel
from sparkdl.errors import ConfigError
from sparkdl.wire.frames import ChannelAddress
from sparkdl.executor.channel_client import ChannelClient
from sparkdl.executor.output import forward_output
from sparkdl.wire.codec import collect_parts, output_batch, output_lines
from sparkdl.spark.session import (ConnectSession, Shipped, is_connect, is_local_master, local_master_slots,
                                   max_overlap, route_address, static_slots)


@pytest.mark.parametrize("master, cpus, slots", [
    ("local", 1, 1), ("local[3]", 1, 3), ("local[4, 2]", 1, 4), ("local-cluster[2,2,1024]", 1, 4),
    ("local-cluster[3, 4, 2048]", 2, 6), ("spark://h:7077", 1, None), ("yarn", 1, None), ("k8s://https://x", 1, None)])
def test_local_master_slots(master: str, cpus: int, slots: int | None) -> None:
    assert local_master_slots(master, cpus) == slots


def test_local_star_counts_this_machines_cores() -> None:
    import os

    assert local_master_slots("local[*]", 1) == (os.cpu_count() or 1)


@pytest.mark.parametrize("instances, cores, cpus, dynamic, slots", [
    ("4", "8", "1", None, 32), ("4", "8", "2", "false", 16), ("4", "3", "2", None, 4),
    ("4", "8", "1", "true", None), ("4", None, "1", None, None), (None, "8", "1", None, None)])
def test_static_slots_of_a_cluster_manager(instances, cores, cpus, dynamic, slots) -> None:  # type: ignore[no-untyped-def]
    assert static_slots("yarn", cpus, instances, cores, dynamic) == slots


def test_static_slots_prefer_the_local_master() -> None:
    assert static_slots("local-cluster[2,2,1024]", None, "9", "9", None) == 4


def test_is_local_master() -> None:
    assert is_local_master("local") and is_local_master("local[2]")
    assert not is_local_master("local-cluster[2,1,1024]") and not is_local_master("spark://h:7077")


@pytest.mark.parametrize("intervals, most", [
    ([], 0), ([(0, 1)], 1), ([(0, 1), (0.5, 1.5), (1.2, 2)], 2), ([(0, 1), (1, 2), (2, 3)], 1),
    ([(0, 5), (1, 2), (1.5, 3), (1.8, 4)], 4)])
def test_max_overlap(intervals, most) -> None:  # type: ignore[no-untyped-def]
    assert max_overlap(intervals) == most


def test_is_connect_looks_at_the_session_class() -> None:
    connect_like = type("SparkSession", (), {"__module__": "pyspark.sql.connect.session"})()
    classic_like = type("SparkSession", (), {"__module__": "pyspark.sql.session"})()
    assert is_connect(connect_like) and not is_connect(classic_like)


def test_route_address_is_this_machines_address() -> None:
    assert ipaddress.ip_address(route_address("127.0.0.1")).is_loopback
    assert ipaddress.ip_address(route_address("no-such-host.invalid"))  # falls back to the host name's address


@pytest.mark.parametrize("uri", ["{d}/m/data/state.pt", "file:{d}/m/data/state.pt", "file://{d}/m/data/state.pt"])
def test_connect_files_round_trip_through_pyarrow(tmp_path, uri: str) -> None:  # type: ignore[no-untyped-def]
    session = ConnectSession(spark=None)
    path = uri.format(d=tmp_path)
    payload = bytes(range(256)) * 1000
    session.write_bytes(path, payload)  # creates the missing directories
    assert session.read_bytes(path) == payload
    assert (tmp_path / "m" / "data" / "state.pt").read_bytes() == payload
    with pytest.raises(FileNotFoundError):
        session.read_bytes(str(tmp_path / "missing.pt"))


def test_shipped_bytes_read_like_a_broadcast() -> None:
    import pickle

    shipped = pickle.loads(pickle.dumps(Shipped(b"model")))
    assert shipped.value == b"model"


@pytest.mark.parametrize("value", ["auto", "off", "10.1.2.3", "client.example.com", "fe80::1"])
def test_launch_channel_accepts(value: str) -> None:
    check_channel(value)


@pytest.mark.parametrize("value", ["", " ", "a b", "host:8080", "sc://host", "user@host", 3, None])
def test_launch_channel_refuses(value) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="launch.channel"):
        check_channel(value)


def test_a_client_that_cannot_connect_says_so() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = ChannelClient(ChannelAddress("127.0.0.1", port, "secret"), rank=0, connect_timeout=2)
    assert not client.failed
    assert client.request("epoch", timeout=5) is None
    assert client.failed
    client.close()


def test_rank_zeros_output_tail_without_a_channel() -> None:
    with forward_output(None, tail_lines=3) as tail:
        for i in range(5):
            print(f"line {i}")
        sys.stderr.write("unfinished")
    assert list(tail) == ["line 3", "line 4", "unfinished"]
    rows = output_batch(0, tail).to_pylist()
    assert output_lines(collect_parts(rows)) == ["line 3", "line 4", "unfinished"]
    assert output_lines(collect_parts([])) == []

