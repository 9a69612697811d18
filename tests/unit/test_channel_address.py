"""launch.channel names an address executors can dial: never a wildcard, and loopback only where the
executors share the driver's host (local and local-cluster masters)."""
from __future__ import annotations

import pytest

from sparkdl.config import LaunchConfig
from sparkdl.driver.channel_checks import check_channel_reachable
from sparkdl.errors import ConfigError


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::", "[::]", "*", "0:0:0:0:0:0:0:0"])
def test_a_wildcard_channel_is_refused(wildcard: str) -> None:
    with pytest.raises(ConfigError, match=r"launch.channel=.* is a wildcard address"):
        LaunchConfig(channel=wildcard).validate()


@pytest.mark.parametrize("master", ["spark://10.1.2.3:7077", "yarn", "k8s://https://api:6443", "mesos://m:5050"])
@pytest.mark.parametrize("loopback", ["127.0.0.1", "localhost", "127.0.1.1"])
def test_loopback_on_a_cluster_master_is_refused(master: str, loopback: str) -> None:
    with pytest.raises(ConfigError, match=f"launch.channel='{loopback}' is a loopback address, but the master"):
        check_channel_reachable(master, loopback)


@pytest.mark.parametrize("master", ["local[2]", "local", "local[*]", "local-cluster[2,1,1024]"])
def test_loopback_on_one_host_is_fine(master: str) -> None:
    check_channel_reachable(master, "127.0.0.1")


@pytest.mark.parametrize("master", ["spark://127.0.0.1:7077", "spark://localhost:7077", "spark://[::1]:7077"])
def test_loopback_with_a_standalone_master_on_loopback_is_fine(master: str) -> None:
    check_channel_reachable(master, "127.0.0.1")


def test_auto_off_and_real_addresses_pass_on_a_cluster() -> None:
    for channel in ("auto", "off", "10.0.0.5"):
        check_channel_reachable("spark://10.1.2.3:7077", channel)
