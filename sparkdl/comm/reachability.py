"""Every rank dials every peer once before the collectives start: a peer it cannot reach (a
firewall, an address that is not the peer's on this network) is named within seconds, where gloo
would retry the connection until launch.timeout_s and report only that a rank stopped responding.

Each rank listens on its executor address (port chosen by the OS), the ranks swap "address:port"
through `gather` (the backend's store, or Spark's allGather), then dial. The listener stays open
until close(): a slower peer may still be dialling it."""
from __future__ import annotations

import errno
import socket
import time
from typing import Callable, Sequence

from sparkdl.errors import ConfigError

PROBE_DEADLINE_S = 20.0  # per peer, at most: a reachable peer answers in milliseconds
_RETRY_S = 0.2
# No route to the peer's host, or a firewall rejecting (ICMP "administratively prohibited"): retrying
# would only wait out the deadline.
_NO_ROUTE = (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EACCES, errno.EPERM)


class PeerProbe:
    """Listens where gloo will: on the address of the interface GLOO_SOCKET_IFNAME names (set by
    the user, or by sparkdl to the executor's own interface), else on the executor's address."""

    def __init__(self, own_address: str) -> None:
        from sparkdl.comm.interfaces import gloo_bind_address

        bind = gloo_bind_address(own_address)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._listener.bind((bind, 0))
        except OSError:
            # The executor's address is not on an interface here (a NAT, a proxy): listen everywhere.
            bind = own_address
            self._listener.bind(("0.0.0.0", 0))
        self._listener.listen(64)  # the kernel completes the handshakes: nothing needs to accept
        self.address = f"{bind}:{self._listener.getsockname()[1]}"

    def close(self) -> None:
        self._listener.close()


def dial_peers(rank: int, own_address: str, endpoints: Sequence[str], deadline_s: float = PROBE_DEADLINE_S,
               dial: Callable[[tuple[str, int], float], None] | None = None, wait_for_listener: bool = False) -> None:
    """Connect once to every other rank's endpoint ("host:port"); the first one that cannot be
    reached within `deadline_s` raises a ConfigError naming both ranks, the address and the fix.
    A refused connection fails at once (the peers listen before they publish), unless
    `wait_for_listener` (a peer that may not listen yet): then it is retried until the deadline.
    No route to the peer, or a firewall that rejects the connection, fails at once either way."""
    dial = dial or _connect
    for peer, endpoint in enumerate(endpoints):
        if peer == rank or not endpoint:
            continue
        host, port = endpoint.rsplit(":", 1)
        started = time.monotonic()
        while True:
            remaining = deadline_s - (time.monotonic() - started)
            try:
                dial((host, int(port)), max(min(remaining, 5.0), 0.1))
                break
            except OSError as exc:
                refused = exc.errno == errno.ECONNREFUSED
                if (refused and not wait_for_listener) or exc.errno in _NO_ROUTE or remaining <= _RETRY_S:
                    raise unreachable(rank, own_address, peer, endpoint, exc) from None
                time.sleep(_RETRY_S)


def dial_one(rank: int, own_address: str, peer: int, endpoint: str, deadline_s: float = PROBE_DEADLINE_S,
             wait_for_listener: bool = False) -> None:
    """dial_peers for one peer (rank 0's store, say) whatever this rank's index among them."""
    endpoints = [endpoint if r == peer else "" for r in range(max(rank, peer) + 1)]
    dial_peers(rank, own_address, endpoints, deadline_s, wait_for_listener=wait_for_listener)


def unreachable(rank: int, own_address: str, peer: int, endpoint: str, exc: OSError) -> ConfigError:
    reason = exc.strerror or type(exc).__name__
    return ConfigError(f"rank {rank} on host {socket.gethostname()!r} ({own_address}) cannot reach rank {peer} at "
                       f"{endpoint}: {reason}; its collectives would wait until launch.timeout_s",
                       hint="let the executors reach each other on TCP (any port: firewalls and security groups "
                            "between the worker hosts), and if that address is not the peer's on this network, "
                            "set SPARK_LOCAL_IP on its host or spark.executorEnv.GLOO_SOCKET_IFNAME to the right "
                            "interface")


def _connect(address: tuple[str, int], timeout: float) -> None:
    with socket.create_connection(address, timeout=timeout):
        pass


def host_answers(endpoint: str, timeout_s: float) -> bool:
    """Whether the host of `endpoint` ("host:port") answers a TCP connection at all: accepted, or
    refused (only the host itself refuses). False when nothing answers within `timeout_s` or there is
    no route: its link is down, or a firewall drops what is sent to it."""
    host, port = endpoint.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False
