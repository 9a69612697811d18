"""The Communicator interface every backend implements, and the WorldInfo it is built from.

Strategies talk only to this interface, so a strategy never depends on a backend. Backends count
the bytes their rank sends from tensor sizes, so every strategy reports exact traffic.
"""
from __future__ import annotations

import abc
import functools
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

if TYPE_CHECKING:
    import torch

ALLREDUCE = "allreduce"
BROADCAST = "broadcast"
ALLGATHER = "allgather"
SEND_RECV = "send_recv"
BARRIER = "barrier"
SUBGROUP = "subgroup"
ALL_TO_ALL = "all_to_all"  # a backend's own all-to-all; without it Communicator.all_to_all uses send/irecv
# Streaming DiLoCo's communication thread charges bytes while the training thread does too.
_CHARGE_LOCK = threading.Lock()
# Seconds each thread spent blocked in collectives (the training thread's: its waits; a background
# sync thread's own time is not the training thread's wait). Outermost calls only: a collective built
# on another (reduce_scatter on allreduce, a subgroup, the network emulator) counts once.
_BLOCKED = threading.local()
TIMED_COLLECTIVES = ("allreduce", "broadcast", "allgather", "barrier", "reduce_scatter", "allgather_into",
                     "allgather_object", "recv", "all_to_all")


def blocked_seconds() -> float:
    """Seconds this thread has spent inside collectives of any Communicator so far."""
    return float(getattr(_BLOCKED, "seconds", 0.0))


def blocking(wait: Callable[[], Any]) -> Any:
    """Run `wait` (a backend's own collective outside the Communicator, e.g. Horovod's
    DistributedOptimizer.synchronize) counted as time blocked in collectives."""
    return _timed(lambda _: wait())(None)


def _blocking(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """call(*args, **kwargs), its time added to this thread's blocked_seconds unless an outer
    collective already counts it."""
    if getattr(_BLOCKED, "depth", 0):
        return call(*args, **kwargs)
    _BLOCKED.depth = 1
    started = time.perf_counter()
    try:
        return call(*args, **kwargs)
    finally:
        _BLOCKED.depth = 0
        _BLOCKED.seconds = blocked_seconds() + time.perf_counter() - started


def _timed(method: Callable[..., Any]) -> Callable[..., Any]:
    if getattr(method, "_sparkdl_timed", False):
        return method

    @functools.wraps(method)
    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        return _blocking(method, self, *args, **kwargs)

    timed._sparkdl_timed = True  # type: ignore[attr-defined]
    return timed


class Work(Protocol):
    """A pending point-to-point send; wait() returns once the buffer may be reused."""

    def wait(self) -> Any: ...


class PendingReduce:
    """An allreduce in flight (Communicator.allreduce_async): wait() blocks until it is done, the
    time it blocks counted in blocked_seconds like a synchronous collective's, and returns the
    reduced tensor. `finish`: what to apply once it is done (the division of "avg")."""

    def __init__(self, tensor: "torch.Tensor", work: Any = None,
                 finish: "Callable[[torch.Tensor], Any] | None" = None) -> None:
        self.tensor = tensor
        self._work = work
        self._finish = finish

    def wait(self) -> "torch.Tensor":
        if self._work is not None:
            work, self._work = self._work, None
            _blocking(work.wait)
            if self._finish is not None:
                self._finish(self.tensor)
        return self.tensor


@dataclass(frozen=True)
class WorldInfo:
    """Where this rank sits; built by the rendezvous, identical on every rank except `rank`."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    hosts: tuple[str, ...]  # host of every rank, indexed by rank
    master_addr: str
    master_port: int
    gpus: tuple[str, ...] = field(default_factory=tuple)  # this task's GPU addresses
    executors: tuple[str, ...] = field(default_factory=tuple)  # executor address (host:port) of every rank

    @property
    def is_chief(self) -> bool:
        return self.rank == 0


class Communicator(abc.ABC):
    """Collectives over the ranks of one run. `ops` lists what the backend supports so planning can
    reject a strategy the backend cannot serve before any job starts."""

    ops: frozenset[str] = frozenset()

    listens: bool = False  # listen() opens something: rank 0 can announce its port before anyone connects

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Every backend's collectives are timed (blocked_seconds), whatever the backend."""
        super().__init_subclass__(**kwargs)
        for name in TIMED_COLLECTIVES:
            if name in cls.__dict__ and not getattr(cls.__dict__[name], "__isabstractmethod__", False):
                setattr(cls, name, _timed(cls.__dict__[name]))

    @classmethod
    def listen(cls, timeout_s: float, own_address: str = "") -> tuple[int, Any] | None:
        """Rank 0, before the rendezvous: open what the others will connect to (on `own_address`,
        its executor's address, where the others dial) and return (its port, a handle for the
        constructor), so that no rank connects before anything listens.
        None (the default): rank 0 announces a free port and the backend binds it itself."""
        return None

    def __init__(self, world: WorldInfo) -> None:
        self.world = world
        self.bytes_sent = 0

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def size(self) -> int:
        return self.world.size

    @property
    def device(self) -> "torch.device":
        import torch

        return torch.device("cpu")

    @abc.abstractmethod
    def allreduce(self, tensor: "torch.Tensor", op: str = "sum") -> "torch.Tensor":
        """In place over all ranks; op is "sum", "avg", "max" or "min". Returns the tensor."""

    # True: allreduce_async returns while the collective runs on (gradient averaging overlaps backward);
    # False: the interface's default, which reduces before it returns.
    overlaps_allreduce: bool = False

    def allreduce_async(self, tensor: "torch.Tensor", op: str = "sum") -> PendingReduce:
        """Start an allreduce of `tensor` in place (as allreduce; the same bytes counted); the result
        is there once wait() returns. Every rank starts the same allreduces in the same order. Leave
        the tensor alone until then. This default reduces at once and returns finished work."""
        self.allreduce(tensor, op=op)
        return PendingReduce(tensor)

    @abc.abstractmethod
    def broadcast(self, tensor: "torch.Tensor", src: int = 0) -> "torch.Tensor":
        """In place: every rank ends with src's values."""

    @abc.abstractmethod
    def allgather(self, tensor: "torch.Tensor") -> list["torch.Tensor"]:
        """Every rank's tensor (same shape on all ranks), indexed by rank."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Return once every rank has called it."""

    def reduce_scatter(self, tensor: "torch.Tensor", op: str = "avg") -> "torch.Tensor":
        """A 1-D tensor whose length is a multiple of the world size, reduced over all ranks; returns
        this rank's contiguous 1/W of the result (a new tensor). This default allreduces the whole
        buffer (twice a ring reduce-scatter's bytes); backends with the collective override it."""
        self.allreduce(tensor, op=op)
        return tensor.view(self.size, -1)[self.rank].clone()

    def allgather_into(self, shard: "torch.Tensor", out: "torch.Tensor | None" = None) -> "torch.Tensor":
        """Every rank's 1-D shard (same length everywhere), concatenated in rank order (into `out`
        when given: W times the shard's length)."""
        import torch

        return torch.cat(self.allgather(shard), out=out)

    def allgather_object(self, obj: Any) -> list[Any]:
        """Small plain objects from every rank (comm/object_codec.py: typed, no pickle between ranks),
        built on allgather of byte tensors."""
        import torch

        from sparkdl.comm.object_codec import decode_object, encode_object, encode_refusal, raise_refusals

        try:
            encoded = encode_object(obj)
        except TypeError as exc:  # still join the collectives: peers must not wait out the timeout
            encoded = encode_refusal(self.rank, str(exc))
        payload = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
        sizes = self.allgather(torch.tensor([payload.numel()], dtype=torch.int64))
        longest = int(max(int(s.item()) for s in sizes))
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: payload.numel()] = payload
        gathered = self.allgather(padded)
        values = [decode_object(bytes(t[: int(n.item())].numpy())) for t, n in zip(gathered, sizes)]
        raise_refusals(values)  # one rank's unsendable value: the same TypeError on every rank
        return values

    def all_to_all(self, tensor: "torch.Tensor", send_rows: Sequence[int],
                   recv_rows: Sequence[int]) -> "torch.Tensor":
        """Rows of `tensor` (dim 0, in rank order: send_rows[r] of them) go to rank r; returns the rows
        every rank sent here, concatenated in rank order (recv_rows[r] from rank r). Trailing shape and
        dtype are the same on every rank. Only rows to other ranks are charged. This default posts every
        receive, then sends (point to point); backends with the collective override it."""
        import torch

        starts = [sum(send_rows[:r]) for r in range(self.size)]
        out = torch.empty((sum(recv_rows), *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        blocks = list(torch.split(out, list(recv_rows)))
        pending = [self.irecv(blocks[r], r) for r in range(self.size) if r != self.rank and recv_rows[r]]
        sends = [self.send(tensor[starts[r]: starts[r] + send_rows[r]], r) for r in range(self.size)
                 if r != self.rank and send_rows[r]]
        blocks[self.rank].copy_(tensor[starts[self.rank]: starts[self.rank] + send_rows[self.rank]])
        for work in pending + sends:
            work.wait()
        return out

    def send(self, tensor: "torch.Tensor", dst: int, tag: int = 0) -> Work:
        """Start sending `tensor` to rank dst (asynchronous); keep the tensor unchanged until wait()."""
        raise NotImplementedError(f"{type(self).__name__} has no point-to-point send/recv")

    def recv(self, tensor: "torch.Tensor", src: int, tag: int = 0) -> "torch.Tensor":
        """Receive into `tensor` (its shape and dtype must match the sender's) from rank src; blocks."""
        self.irecv(tensor, src, tag).wait()
        return tensor

    def irecv(self, tensor: "torch.Tensor", src: int, tag: int = 0) -> Work:
        """Post a receive into `tensor` now; wait() returns once it is filled. Posting receives
        before they are needed lets the sender's data go out without waiting for this rank."""
        raise NotImplementedError(f"{type(self).__name__} has no point-to-point send/recv")

    def split(self, groups: Sequence[Sequence[int]]) -> "Communicator | None":
        """Subgroups of ranks (disjoint, every rank's call lists the same groups in the same order);
        returns the communicator of the group holding this rank, or None. Its rank and size are
        group-local; collectives over it take group-local ranks; its bytes count for this one too."""
        raise NotImplementedError(f"{type(self).__name__} has no subgroups")

    def wrap_optimizer(self, optimizer: "torch.optim.Optimizer",
                       module: "torch.nn.Module") -> "torch.optim.Optimizer | None":
        """A backend's own distributed optimizer (Horovod's), or None: the strategy then averages
        gradients itself through allreduce."""
        return None

    def record_allreduce(self, nbytes: int) -> None:
        """Count an allreduce the backend ran on its own (inside a wrapped optimizer)."""
        self._count_allreduce(nbytes)

    def close(self) -> None:
        """Release the backend; safe to call twice."""

    def alive(self) -> bool:
        """The backend still runs collectives (a custom loop may have shut it down itself)."""
        return True

    def _charge(self, nbytes: int) -> None:
        with _CHARGE_LOCK:
            self.bytes_sent += nbytes

    def _count_allreduce(self, nbytes: int) -> None:
        # A ring allreduce sends 2 (W-1)/W of the buffer from each rank (reduce-scatter + allgather).
        if self.size > 1:
            self._charge(2 * (self.size - 1) * nbytes // self.size)

    def _count_broadcast(self, nbytes: int, src: int) -> None:
        # Counted as the root pushing the buffer to every peer; the others send nothing.
        if self.rank == src:
            self._charge((self.size - 1) * nbytes)

    def _count_allgather(self, nbytes: int) -> None:
        # A ring allgather forwards W-1 blocks of this size from each rank.
        self._charge((self.size - 1) * nbytes)

    def _count_send(self, nbytes: int) -> None:
        self._charge(nbytes)


for _name in TIMED_COLLECTIVES:  # the interface's own implementations (reduce_scatter, allgather_object, ...)
    _method = Communicator.__dict__[_name]
    if not getattr(_method, "__isabstractmethod__", False):
        setattr(Communicator, _name, _timed(_method))
