"""In-task main of every rank: rendezvous -> spool -> communicator -> strategy or user loop -> result.

Runs inside a barrier mapInArrow task. Never imports pyspark.sql (worker-side module); the only
Spark object it touches is the BarrierTaskContext.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import tempfile
import time
import traceback
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import pyarrow as pa

from sparkdl.comm.base import Communicator, WorldInfo
from sparkdl.launch.spec import RESULT_CHUNK_BYTES, TrainSpec

FAILURE_MARKER = "SPARKDL_RANK_FAILED"
PEER_FAILURE_DELAY_S = 5.0
_PEER_FAILURE_SIGNS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
                       "gloo/transport", "NCCL communicator was aborted", "Socket Timeout",
                       "Horovod has been shut down", "HorovodInternalError")


def is_peer_failure(exc: BaseException) -> bool:
    """A collective that broke because another rank died: an echo, not the cause."""
    import torch.distributed as dist

    peer_types = tuple(t for t in (getattr(dist, "DistNetworkError", None), getattr(dist, "DistBackendError", None))
                       if t is not None)
    text = f"{type(exc).__name__}: {exc}"
    return isinstance(exc, peer_types) or any(sign in text for sign in _PEER_FAILURE_SIGNS)


def report_error(client: Any, exc: BaseException) -> None:
    """Tell the driver this rank's error at once, before tearing down the communicator: once a
    backend shuts down, peers fail fast and Spark may kill this task before it says anything."""
    if client is None or getattr(exc, "_sparkdl_reported", False):
        return
    detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    import socket

    client.send_now("error", text=f"{detail}\n{trace}", peer_failure=is_peer_failure(exc), host=socket.gethostname())
    try:
        exc._sparkdl_reported = True  # type: ignore[attr-defined]
    except AttributeError:  # some C-level exceptions take no attributes
        pass


@dataclass
class WorkerContext:
    """What a custom loop (`sparkdl.run(train_fn)`) receives on every rank."""

    world: WorldInfo
    comm: Communicator
    spec: TrainSpec
    row_counts: list[int] = field(default_factory=list)
    _spool: Any = None
    _validation: Any = None
    reporter: Any = None  # metrics and progress to the driver (rank 0); see launch.reporter
    batch_shares: list[int] | None = None  # rows per rank and step when shared by speed (launch.balance)
    spool_seconds: float = 0.0  # receiving this rank's partition from Spark and spooling it (epoch 1's extra)

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def world_size(self) -> int:
        return self.world.size

    @property
    def local_rank(self) -> int:
        return self.world.local_rank

    @property
    def device(self) -> Any:
        return self.comm.device

    @property
    def config(self) -> Any:
        return self.spec.config

    @property
    def num_rows(self) -> int:
        """Rows of this rank's shard."""
        return self.row_counts[self.rank] if self.row_counts else 0

    @property
    def steps_per_epoch(self) -> int:
        from sparkdl.data.batches import steps_per_epoch

        data = self.spec.config.data
        if not self.row_counts:
            return 0
        if self.batch_shares:
            from sparkdl.launch.balance import balanced_steps

            return balanced_steps(self.row_counts, sum(self.batch_shares), data.drop_last)
        return steps_per_epoch(self.row_counts, data.batch_size, data.drop_last)

    def batches(self, epoch: int = 0) -> Iterator[tuple[Any, Any]]:
        """(features, labels) torch batches of this rank's shard; the same step count on every rank."""
        from sparkdl.data.batches import last_batch_size

        if self._spool is None:
            from sparkdl.errors import ConfigError

            raise ConfigError("ctx.batches() needs data, but this run has no DataFrame",
                              hint="pass df= to sparkdl.run")
        data = self.spec.config.data
        if self.batch_shares:  # every step holds this rank's full share
            yield from self._spool.batches(
                epoch, batch_size=self.batch_shares[self.rank], steps=self.steps_per_epoch, shuffle=data.shuffle,
                seed=self.spec.config.train.seed, rank=self.rank, drop_last=True)
            return
        yield from self._spool.batches(
            epoch, batch_size=data.batch_size, steps=self.steps_per_epoch, shuffle=data.shuffle,
            seed=self.spec.config.train.seed, rank=self.rank, drop_last=data.drop_last,
            last_batch_size=last_batch_size(self.row_counts, data.batch_size, data.drop_last))

    def validation_batches(self, batch_size: int = 1024) -> Iterator[tuple[Any, Any]]:
        """This rank's validation rows, in order, once (empty without validation data). Ranks hold
        different numbers of rows: combine per-rank sums with one collective afterwards."""
        spool = self._validation
        if spool is None or spool.num_rows == 0:
            return iter(())
        steps = -(-spool.num_rows // batch_size)
        return spool.batches(0, batch_size=batch_size, steps=steps, shuffle=False, seed=0, rank=self.rank,
                             drop_last=False, last_batch_size=spool.num_rows - (steps - 1) * batch_size)


def make_task(spec: TrainSpec) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The function handed to mapInArrow; it closes over the spec only."""

    def sparkdl_barrier_task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark.taskcontext import BarrierTaskContext

        context = BarrierTaskContext.get()
        rank = context.partitionId()
        client = _channel_client(spec, rank)
        try:
            with _forward_output(client, rank):
                yield from run_rank(spec, context, batches, client)
        except Exception as exc:  # noqa: BLE001 - re-raised with the rank named for the driver
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            peer = is_peer_failure(exc)
            report_error(client, exc)
            if peer and "timed out" not in detail.lower():
                # Spark reports the first task failure it hears of; let the rank that failed first
                # (whose error made this collective break) be heard before this echo of it. A
                # timeout has no such first rank (a stalled peer says nothing): fail at once.
                time.sleep(PEER_FAILURE_DELAY_S)
            raise RuntimeError(f"{FAILURE_MARKER} rank={rank}: {detail}\n{traceback.format_exc()}") from None
        finally:
            if client is not None:
                client.close()

    return sparkdl_barrier_task


def _channel_client(spec: TrainSpec, rank: int) -> Any:
    if spec.channel is None:
        return None
    from sparkdl.launch.channel import ChannelClient

    return ChannelClient(spec.channel, rank)


def _forward_output(client: Any, rank: int) -> Any:
    """Rank 0's stdout/stderr lines also go to the driver's log."""
    from contextlib import nullcontext

    if client is None or rank != 0:
        return nullcontext()
    from sparkdl.launch.channel import forward_output

    return forward_output(client)


def run_rank(spec: TrainSpec, context: Any, batches: Iterable[pa.RecordBatch],
             client: Any = None) -> Iterator[pa.RecordBatch]:
    from sparkdl import comm as comm_registry
    from sparkdl.launch.rendezvous import rendezvous

    with ExitStack() as stack:
        # Spool first: it takes as long as Spark takes to deliver the partition, and the port rank 0
        # picks at the rendezvous must be bound by gloo right after, not minutes later.
        spool_started = time.perf_counter()
        spool, validation = _spool_input(spec, batches, stack)
        spool_seconds = time.perf_counter() - spool_started
        world = rendezvous(context)
        _limit_threads(spec, world, stack)
        _pin_gpus(world, stack)
        comm = comm_registry.create(spec.config.launch.backend, world, spec.config.launch.timeout_s,
                                    exchange=context.allGather)
        stack.callback(comm.close)
        comm = _maybe_emulate(spec, comm)
        # Runs before comm.close (LIFO): the error reaches the driver while peers are still waiting.
        stack.push(lambda kind, exc, tb: report_error(client, exc) if isinstance(exc, Exception) else None)
        row_counts = [int(n) for n in comm.allgather_object(spool.num_rows if spool is not None else 0)]
        if spool is not None:
            _check_shards(spec, row_counts)  # same verdict on every rank: nobody waits in a collective
        from sparkdl.launch.reporter import Reporter

        context_obj = WorkerContext(world=world, comm=comm, spec=spec, row_counts=row_counts, _spool=spool,
                                    _validation=validation, spool_seconds=spool_seconds,
                                    reporter=Reporter(client, world.rank, spec.config.tracking.log_every))
        if spec.train_fn is not None:
            result = spec.train_fn(context_obj)
            payload = _dumps_any(result) if world.rank == 0 else None
            history: list[dict[str, Any]] = []
        else:
            from sparkdl.launch.loop import train

            # Several ranks may each return part of the model (pipeline stages); merged on the driver.
            state, history = train(context_obj)
            payload = _dumps_state(state) if state is not None else None
        comm.barrier()
    if world.rank == 0:
        yield _result_batch(world.rank, "history", 0, json.dumps(history).encode())
    if payload is not None:
        for seq, start in enumerate(range(0, max(len(payload), 1), RESULT_CHUNK_BYTES)):
            yield _result_batch(world.rank, "payload", seq, payload[start: start + RESULT_CHUNK_BYTES])


def _maybe_emulate(spec: TrainSpec, comm: Communicator) -> Communicator:
    options = spec.config.launch.emulate_network
    if not options:
        return comm
    from sparkdl.comm.emulated import EmulatedNetwork, network_from_options

    latency_s, bandwidth = network_from_options(options)
    if comm.rank == 0:
        print(f"sparkdl: EMULATED network: every message slowed to {latency_s * 1e3:g} ms latency and "
              f"{bandwidth * 8 / 1e9:g} Gbit/s (launch.emulate_network); timings are not this cluster's", flush=True)
    return EmulatedNetwork(comm, latency_s, bandwidth)


def _spool_input(spec: TrainSpec, batches: Iterable[pa.RecordBatch], stack: ExitStack) -> tuple[Any, Any]:
    """(training spool, validation spool or None); both None for a run without a DataFrame."""
    if spec.layout is None:
        for _ in batches:  # the placeholder input of a run without a DataFrame is drained
            pass
        return None, None
    from sparkdl.data.batches import Spool

    directory = spec.config.data.spool_dir or os.path.join(tempfile.gettempdir(), "sparkdl-spool")
    if spec.layout.split_column is None:
        return stack.enter_context(Spool.write(batches, spec.layout, directory)), None
    held_out: list[pa.RecordBatch] = []
    train = stack.enter_context(Spool.write(_split(batches, spec.layout.split_column, held_out), spec.layout,
                                            directory))
    # Validation rows are few by design; they wait in memory until the training rows are spooled.
    return train, stack.enter_context(Spool.write(iter(held_out), spec.layout, directory))


def _split(batches: Iterable[pa.RecordBatch], column: str, held_out: list[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    import pyarrow.compute as pc

    for batch in batches:
        is_validation = pc.equal(batch.column(batch.schema.get_field_index(column)), 1)
        held_out.append(batch.filter(is_validation))
        yield batch.filter(pc.invert(is_validation))


def _check_shards(spec: TrainSpec, row_counts: list[int]) -> None:
    from sparkdl.data.batches import steps_per_epoch
    from sparkdl.errors import EmptyDataError

    empty = [rank for rank, n in enumerate(row_counts) if n == 0]
    if empty:
        raise EmptyDataError(f"rank(s) {empty} received no rows (rows per rank: {row_counts})",
                             hint="use fewer workers, or repartition the DataFrame so no partition is empty")
    data = spec.config.data
    if steps_per_epoch(row_counts, data.batch_size, data.drop_last) == 0:
        raise EmptyDataError(f"drop_last=True with batch_size={data.batch_size} leaves no full batch "
                             f"(rows per rank: {row_counts})", hint="lower batch_size or set drop_last=False")


def _pin_gpus(world: WorldInfo, stack: ExitStack) -> None:
    """CUDA_VISIBLE_DEVICES follows the GPU addresses Spark gave this task (BarrierTaskContext
    resources), so the rank and any library it loads see only its own GPUs. Restored afterwards, since
    Spark reuses Python workers across tasks, unless CUDA started meanwhile: it keeps the narrowed
    view for the process, and later tasks (inference) map addresses through the variable. Left alone
    once CUDA is initialised in this process (it would no longer take effect);
    comm/torch_dist.cuda_index maps addresses either way."""
    if not world.gpus:
        return
    import torch

    if torch.cuda.is_initialized():
        return
    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(world.gpus)

    def restore() -> None:
        if torch.cuda.is_initialized():
            return  # CUDA keeps the narrowed view for this process: the variable must keep saying so
        if previous is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = previous

    stack.callback(restore)


def _limit_threads(spec: TrainSpec, world: WorldInfo, stack: ExitStack) -> None:
    import torch

    threads = spec.config.launch.threads_per_worker
    if threads is None:
        # Ranks sharing a host would otherwise each start one thread per core and thrash.
        threads = max(1, (os.cpu_count() or 1) // max(world.local_size, 1))
    # Python workers are reused by later tasks (inference too): give them back what they had.
    stack.callback(torch.set_num_threads, torch.get_num_threads())
    torch.set_num_threads(threads)


def _dumps_state(state: dict[str, Any]) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def _dumps_any(obj: Any) -> bytes:
    # pyspark's own copy, so modules registered for pickling by value (launch.shipping) apply.
    from pyspark import cloudpickle

    return cloudpickle.dumps(obj)


def _result_batch(rank: int, kind: str, seq: int, payload: bytes) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays(
        [pa.array([rank], pa.int32()), pa.array([kind], pa.string()), pa.array([seq], pa.int32()),
         pa.array([payload], pa.binary())],
        names=["rank", "kind", "seq", "payload"])


def loads_result(parts: dict[str, list[tuple[int, int, bytes]]], custom: bool) -> tuple[Any, list[dict]]:
    """Driver side: reassemble the (rank, seq, bytes) chunks (kept here beside the writer so both stay
    in step). A custom loop returns rank 0's value; the built-in loop's state dicts of every
    contributing rank are merged by key."""
    history = json.loads(b"".join(p for _, _, p in sorted(parts.get("history", []))) or b"[]")
    by_rank: dict[int, list[tuple[int, bytes]]] = {}
    for rank, seq, chunk in parts.get("payload", []):
        by_rank.setdefault(rank, []).append((seq, chunk))
    payloads = {rank: b"".join(c for _, c in sorted(chunks)) for rank, chunks in by_rank.items()}
    if custom:
        payload = payloads.get(0, b"")
        return (pickle.loads(payload) if payload else None), history
    import torch

    state: dict[str, Any] = {}
    for rank in sorted(payloads):
        state.update(torch.load(io.BytesIO(payloads[rank]), weights_only=True))
    return state, history
