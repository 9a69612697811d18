"""Network emulation for experiments: a Communicator wrapper that makes every collective and message
take as long as it would on a network with the given latency and bandwidth.

A collective (run on the real local network) is stretched to latency x (messages on the critical
path) + (bytes this rank sent) / bandwidth, or left as it is if the real one took longer; a point-to-point message sleeps before it is
sent (it arrives only after its time on the link), so decisions can be checked at bandwidths this
machine does not have (`launch.emulate_network={"latency_ms": .., "gbps": ..}`, off by default). It is
always labelled as emulation in logs and in the plan. Backend-independent: wraps any Communicator.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Sequence

from sparkdl.comm.base import Communicator, Work

if TYPE_CHECKING:
    import torch


def network_from_options(options: Any) -> tuple[float, float]:
    """(latency in s, bandwidth in bytes/s) from {"latency_ms": .., "gbps": ..}."""
    return float(options.get("latency_ms", 0.0)) / 1e3, float(options["gbps"]) * 1e9 / 8


class EmulatedNetwork(Communicator):
    def __init__(self, inner: Communicator, latency_s: float, bandwidth_Bps: float) -> None:
        super().__init__(inner.world)
        self.inner = inner
        self.latency_s = latency_s
        self.bandwidth_Bps = bandwidth_Bps
        self.ops = inner.ops
        self.emulated_s = 0.0  # total time added, for reports

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def size(self) -> int:
        return self.inner.size

    @property
    def device(self) -> Any:
        return self.inner.device

    @property
    def bytes_sent(self) -> int:  # type: ignore[override]
        return self.inner.bytes_sent

    @bytes_sent.setter
    def bytes_sent(self, value: int) -> None:
        pass  # the inner communicator counts

    def _delay(self, before: int, messages: int, started: float | None = None) -> None:
        """Sleep what the emulated link needs beyond the time the real operation already took (an
        emulated link cannot be faster than the real one)."""
        target = messages * self.latency_s + (self.inner.bytes_sent - before) / self.bandwidth_Bps
        spent = time.perf_counter() - started if started is not None else 0.0
        self._sleep(target - spent)

    def _sleep(self, seconds: float) -> None:
        if seconds > 0:
            self.emulated_s += seconds
            time.sleep(seconds)

    def allreduce(self, tensor: "torch.Tensor", op: str = "sum") -> "torch.Tensor":
        before, started = self.inner.bytes_sent, time.perf_counter()
        out = self.inner.allreduce(tensor, op)
        self._delay(before, 2 * (self.size - 1) if self.size > 1 else 0, started)
        return out

    def broadcast(self, tensor: "torch.Tensor", src: int = 0) -> "torch.Tensor":
        before, started = self.inner.bytes_sent, time.perf_counter()
        out = self.inner.broadcast(tensor, src)
        self._delay(before, 1 if self.size > 1 else 0, started)
        return out

    def allgather(self, tensor: "torch.Tensor") -> list["torch.Tensor"]:
        before, started = self.inner.bytes_sent, time.perf_counter()
        out = self.inner.allgather(tensor)
        self._delay(before, self.size - 1, started)
        return out

    def reduce_scatter(self, tensor: "torch.Tensor", op: str = "avg") -> "torch.Tensor":
        before, started = self.inner.bytes_sent, time.perf_counter()
        out = self.inner.reduce_scatter(tensor, op)
        self._delay(before, self.size - 1, started)
        return out

    def allgather_into(self, shard: "torch.Tensor", out: "torch.Tensor | None" = None) -> "torch.Tensor":
        before, started = self.inner.bytes_sent, time.perf_counter()
        out = self.inner.allgather_into(shard, out)
        self._delay(before, self.size - 1, started)
        return out

    def barrier(self) -> None:
        started = time.perf_counter()
        self.inner.barrier()
        self._delay(self.inner.bytes_sent, 1 if self.size > 1 else 0, started)

    def send(self, tensor: "torch.Tensor", dst: int, tag: int = 0) -> Work:
        # The message occupies the sender's link first and only then arrives: delay, then send.
        self._sleep(self.latency_s + tensor.numel() * tensor.element_size() / self.bandwidth_Bps)
        return self.inner.send(tensor, dst, tag)

    def irecv(self, tensor: "torch.Tensor", src: int, tag: int = 0) -> Work:
        return self.inner.irecv(tensor, src, tag)  # the sender pays for the message

    def split(self, groups: Sequence[Sequence[int]]) -> "Communicator | None":
        group = self.inner.split(groups)
        return EmulatedNetwork(group, self.latency_s, self.bandwidth_Bps) if group is not None else None

    def wrap_optimizer(self, optimizer: Any, module: Any) -> Any:
        return None  # averaging must go through allreduce() to be delayed

    def record_allreduce(self, nbytes: int) -> None:
        self.inner.record_allreduce(nbytes)

    def alive(self) -> bool:
        return self.inner.alive()

    def close(self) -> None:
        self.inner.close()

    @property
    def ranks(self) -> tuple[int, ...]:
        return getattr(self.inner, "ranks", tuple(range(self.size)))
