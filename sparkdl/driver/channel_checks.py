"""launch.channel against the cluster it runs on: the address the driver channel listens on must be
one the executors can dial (the option's own form is checked in config/training.check_channel)."""
from __future__ import annotations

import re
import socket

from sparkdl.config.training import unspecified_ip, wildcard_channel
from sparkdl.errors import ConfigError

_MASTER_HOST = re.compile(r"^spark://(?:\[(?P<v6>[^\]]+)\]|(?P<host>[^:/,]+))")


def master_host(master: str) -> str:
    """The host of a standalone master URL (the first of several), "" for any other master."""
    match = _MASTER_HOST.match(master)
    return (match["v6"] or match["host"]) if match else ""


def check_channel_reachable(master: str, channel: str) -> None:
    """A loopback launch.channel under a cluster manager: every executor on another host would dial
    its own loopback, and the run would go on without its live metrics (silently, before)."""
    from sparkdl.comm.interfaces import is_loopback
    from sparkdl.spark.session import local_master_slots

    if channel in ("auto", "off"):
        return
    check_channel_not_wildcard(channel)
    if not is_loopback(channel):
        return
    if local_master_slots(master, 1) is not None:  # local[N] and local-cluster: executors share this host
        return
    if is_loopback(master_host(master)):  # a standalone master on loopback: its workers are on this host
        return
    raise ConfigError(f"launch.channel={channel!r} is a loopback address, but the master {master!r} runs executors "
                      "on other hosts, which cannot reach it",
                      hint='leave launch.channel="auto" (the session\'s own address), give this client\'s address '
                           'on the executors\' network, or "off" when they cannot reach it at all')


def check_channel_not_wildcard(channel: str) -> None:
    """A host name for launch.channel that resolves to the unspecified address (an /etc/hosts entry
    "0.0.0.0 name", as ad blockers write): the channel would listen on every interface. Numeric
    spellings were refused with the options (config/training.check_channel); names are looked up here,
    on the driver, before any job."""
    try:
        infos = socket.getaddrinfo(channel.strip("[]"), None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):  # unresolvable here: the channel says so when it binds
        return
    wildcard = next((str(info[4][0]) for info in infos if unspecified_ip(str(info[4][0]))), "")
    if wildcard:
        raise wildcard_channel(channel, wildcard)
