"""Horovod's rank contract without horovod.torch: the slot plan, the gloo rendezvous server and the
HOROVOD_* variables a rank's process reads at hvd.init(). Used by the Horovod communicator (inside a
sparkdl rank) and by sparkdl.compat (a child process per rank, HorovodRunner / horovod.spark.run).
Imports no torch; horovod.runner only when called.
"""
from __future__ import annotations

from typing import Any, Sequence

from sparkdl.comm.interfaces import interface_of


def slot_plan(hosts: Sequence[str]) -> list[Any]:
    """Horovod SlotInfo for every rank, rank order kept (Horovod's own assignment would renumber
    ranks host by host)."""
    from horovod.runner.common.util.hosts import SlotInfo

    unique = list(dict.fromkeys(hosts))
    local = {h: [r for r, host in enumerate(hosts) if host == h] for h in unique}
    plan = []
    for rank, host in enumerate(hosts):
        local_rank = local[host].index(rank)
        # Cross ranks group the hosts that have a slot with this local rank.
        peers = [h for h in unique if len(local[h]) > local_rank]
        plan.append(SlotInfo(hostname=host, rank=rank, local_rank=local_rank, cross_rank=peers.index(host),
                             size=len(hosts), local_size=len(local[host]), cross_size=len(peers)))
    return plan


def start_rendezvous(hosts: Sequence[str]) -> tuple[Any, int]:
    """Horovod's gloo RendezvousServer for these ranks' hosts, started: (server, port). Stop it with
    server.stop() once every rank has initialised."""
    from horovod.runner.http.http_server import RendezvousServer

    server = RendezvousServer()
    port = int(server.start())
    server.init(slot_plan(hosts))
    return server, port


def horovod_variables(hosts: Sequence[str], rank: int, rendezvous_addr: str, rendezvous_port: int, timeout_s: float,
                      user_env: dict[str, Any] | None = None) -> dict[str, str]:
    """The HOROVOD_* variables of `rank` (its slot, the rendezvous, gloo on this host's interface),
    `user_env` (launch.horovod_env tuning settings) over them."""
    from horovod.runner.gloo_run import create_slot_env_vars

    env = {k: str(v) for k, v in create_slot_env_vars(slot_plan(hosts)[rank]).items()}
    env.update({"HOROVOD_GLOO_RENDEZVOUS_ADDR": rendezvous_addr, "HOROVOD_GLOO_RENDEZVOUS_PORT": str(rendezvous_port),
                "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
                "HOROVOD_GLOO_TIMEOUT_SECONDS": str(int(max(timeout_s, 1)))})
    iface = interface_of(hosts[rank])
    if iface:
        env["HOROVOD_GLOO_IFACE"] = iface
    env.update({k: str(v) for k, v in (user_env or {}).items()})
    return env
