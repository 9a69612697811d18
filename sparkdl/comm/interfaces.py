"""Which network interface a rank's collectives use.

gloo (torch.distributed and Horovod alike) picks its address from the host name unless told an
interface; a host name that resolves to 127.0.0.1 (the default /etc/hosts of Debian and Ubuntu
images and of many containers) makes every rank advertise loopback, and its peers on other hosts
dial their own loopback. The executor's own address (the one Spark's task infos give, which Spark
already chose past a loopback host name) names the interface to use instead.
"""
from __future__ import annotations

import ipaddress
import socket
from typing import Sequence


def interface_addresses() -> dict[str, list[str]]:
    """{interface name: its IPv4/IPv6 addresses} of this host (psutil when installed, else Linux ioctl)."""
    try:
        import psutil
    except ImportError:
        return _linux_ipv4_addresses()
    families = (socket.AF_INET, socket.AF_INET6)
    return {name: [a.address.split("%", 1)[0] for a in addresses if a.family in families]
            for name, addresses in psutil.net_if_addrs().items()}


def _linux_ipv4_addresses() -> dict[str, list[str]]:
    import fcntl
    import struct

    siocgifaddr = 0x8915
    out: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), siocgifaddr, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue  # no IPv4 address on it
            out[name] = [socket.inet_ntoa(packed[20:24])]
    return out


def resolved(address: str) -> str:
    """`address` as an IP (a host name resolved here; unresolvable names come back unchanged)."""
    try:
        ipaddress.ip_address(address)
        return address
    except ValueError:
        try:
            return socket.gethostbyname(address)
        except OSError:
            return address


def interface_of(address: str) -> str | None:
    """The interface holding `address` (an IP or a host name), or None when no interface here does."""
    wanted = resolved(address)
    for name, addresses in interface_addresses().items():
        if wanted in addresses:
            return name
    return None


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(resolved(address)).is_loopback
    except ValueError:
        return False


def spans_hosts(hosts: Sequence[str]) -> bool:
    """More than one distinct executor address among the ranks."""
    return len(set(hosts)) > 1


GLOO_INTERFACE_ENV = "GLOO_SOCKET_IFNAME"


def gloo_interface_env(own_address: str) -> dict[str, str]:
    """{GLOO_SOCKET_IFNAME: the interface holding this rank's executor address}, or {} when the user
    chose one already (spark.executorEnv.GLOO_SOCKET_IFNAME) or no interface here holds it."""
    import os

    if os.environ.get(GLOO_INTERFACE_ENV):
        return {}
    interface = interface_of(own_address)
    return {GLOO_INTERFACE_ENV: interface} if interface else {}


def check_not_loopback_across_hosts(own_address: str, hosts: Sequence[str], rank: int, env_name: str) -> None:
    """Ranks on several hosts with no interface chosen for this one: gloo falls back to what the
    host name resolves to, and loopback there is unreachable for every peer. Said before any
    connection is tried (gloo would retry it until the timeout)."""
    import os

    from sparkdl.errors import ConfigError

    if not spans_hosts(hosts) or os.environ.get(env_name):
        return
    name = socket.gethostname()
    advertised = resolved(name)
    if is_loopback(advertised):
        raise ConfigError(f"rank {rank} on host {name!r} would advertise {advertised} to its peers on other hosts "
                          f"(the host name resolves to loopback) and no interface here holds its executor address "
                          f"{own_address!r}",
                          hint=f"set spark.executorEnv.{env_name} to the interface the executors reach each other "
                               "on (for example eth0), or make the host name resolve to that interface's address")


def set_environment(values: dict[str, str]) -> dict[str, str | None]:
    """Set `values` in os.environ; returns what they replaced, for restore_environment."""
    import os

    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    return saved


def restore_environment(saved: dict[str, str | None]) -> None:
    import os

    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def gloo_bind_address(own_address: str) -> str:
    """The IPv4 address gloo binds: the first of the interface GLOO_SOCKET_IFNAME names (when it
    has one), else the executor's own address."""
    import os

    interface = os.environ.get(GLOO_INTERFACE_ENV, "").split(",")[0].strip()
    if interface:
        for address in interface_addresses().get(interface, []):
            if "." in address:
                return address
    return resolved(own_address)
