"""In-task main of every rank: rendezvous -> spool -> communicator -> strategy or user loop -> result.

Runs inside a barrier mapInArrow task. Never imports pyspark.sql (worker-side module); the only
Spark object it touches is the BarrierTaskContext.
"""
from __future__ import annotations

import os
import time
import traceback
from contextlib import ExitStack, closing
from typing import Any, Callable, Iterable, Iterator

import pyarrow as pa

from sparkdl.comm.base import Communicator, WorldInfo
from sparkdl.executor.failures import is_peer_failure, report_error
from sparkdl.executor.context import WorkerContext, check_shards
from sparkdl.wire.spec import TrainSpec
from sparkdl.wire.codec import dumps_any, failure_text, output_batch, result_batches


def make_task(spec: TrainSpec) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The function handed to mapInArrow; it closes over the spec only."""

    def sparkdl_barrier_task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark.taskcontext import BarrierTaskContext

        context = BarrierTaskContext.get()
        rank = context.partitionId()
        client = _channel_client(spec, rank)
        try:
            with _forward_output(client, rank, spec.launch.rank_output) as output:
                if spec.child is not None:
                    from sparkdl.executor.child_rank import run_child_rank

                    yield from run_child_rank(spec, context, batches, client)
                else:
                    yield from run_rank(spec, context, batches, client)
            if output is not None and (client is None or client.failed):
                yield output_batch(rank, output)  # the driver saw none of it live
        except Exception as exc:  # noqa: BLE001 - re-raised with the rank named for the driver
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            peer = is_peer_failure(exc)
            report_error(client, exc)
            if peer and "timed out" not in detail.lower():
                # Spark reports the first task failure it hears of; let the rank that failed first
                # (whose error made this collective break) be heard before this echo of it. A
                # timeout has no such first rank (a stalled peer says nothing): fail at once.
                time.sleep(spec.launch.peer_failure_delay_s)
            raise RuntimeError(failure_text(rank, detail, traceback.format_exc())) from None
        finally:
            if client is not None:
                client.close()

    return sparkdl_barrier_task


def _channel_client(spec: TrainSpec, rank: int) -> Any:
    if spec.channel is None:
        return None
    from sparkdl.executor.channel_client import ChannelClient

    return ChannelClient(spec.channel, rank)


def _forward_output(client: Any, rank: int, ranks: str) -> Any:
    """Rank 0's stdout/stderr lines (every rank's with launch.rank_output="all") also go to the
    driver's log (their tail to the job's result when the channel is off or fails)."""
    from contextlib import nullcontext

    if rank != 0 and ranks != "all":
        return nullcontext()
    from sparkdl.executor.output import forward_output

    return forward_output(client)


def run_rank(spec: TrainSpec, context: Any, batches: Iterable[pa.RecordBatch],
             client: Any = None) -> Iterator[pa.RecordBatch]:
    from sparkdl import comm as comm_registry
    from sparkdl.tracking.phases import Clock

    with ExitStack() as stack:
        task_started = time.perf_counter()
        clock = Clock()
        from sparkdl.executor.memory import reset_peak

        _import_what_training_imports(spec)
        clock.lap("imports")
        reset_peak()  # the rank's peak RSS counts from this task (Spark reuses Python workers)
        clock.lap("memory_reset")
        streaming = bool(spec.row_counts) and spec.layout is not None
        spool, validation = _take_input(spec, context, batches, streaming, stack, clock)
        spooled_seconds = time.perf_counter() - task_started
        clock.lap("spool")
        launch = spec.launch
        world, listening, gathering = _rendezvous(spec, context, client)
        clock.lap("rendezvous")
        _limit_threads(spec, context, world, stack)
        _pin_gpus(world, stack)
        comm = comm_registry.create(launch.backend, world, launch.timeout_s, exchange=context.allGather,
                                    env=launch.horovod_env, listening=listening[1] if listening else None)
        stack.callback(comm.close)
        comm = _maybe_emulate(spec, comm)
        clock.lap("communicator")
        # Runs before comm.close (LIFO): the error reaches the driver while peers are still waiting.
        stack.push(lambda kind, exc, tb: report_error(client, exc) if isinstance(exc, Exception) else None)
        row_counts = spec.row_counts if streaming else \
            tuple(int(n) for n in comm.allgather_object(spool.num_rows if spool is not None else 0))
        if spool is not None:
            check_shards(row_counts, spec.data)  # same verdict on every rank: nobody waits in a collective
        store, resume, shares = _agree_before_training(spec, comm, world, row_counts)
        clock.lap("agreement")
        from sparkdl.executor.reporter import Reporter

        ctx = WorkerContext(world=world, comm=comm, spec=spec, row_counts=row_counts, spool=spool,
                            validation=validation, spooled_first_seconds=0.0 if streaming else spooled_seconds,
                            task_started=task_started, batch_shares=shares, clock=clock,
                            reporter=Reporter(client, world.rank, spec.tracking.log_every))
        history, payload, part = _train(ctx, context, gathering, resume, store)
        clock.lap("training")
        if streaming:
            spool.finish()  # the rest of the partition is received (and spooled): Spark's stream ends cleanly
        _last_barrier(spec, context, comm, gathering)
        clock.lap("last_barrier")
    yield from result_batches(world.rank, (history or []) if world.rank == 0 else None, payload, part)


def _take_input(spec: TrainSpec, context: Any, batches: Iterable[pa.RecordBatch], streaming: bool,
                stack: ExitStack, clock: Any) -> tuple[Any, Any]:
    """(spool, validation) of this rank's partition, as its delivery mode hands the rows over."""
    if spec.source is not None:
        batches = _read_own_rows(spec, context.partitionId(), batches)
    elif spec.packed_rows:
        from sparkdl.data.arrow_rows import unpacked_batches

        batches = unpacked_batches(batches, spec.layout)
    batches = clock.iterate(batches, "delivery")
    if streaming:
        # Rows stream in on a thread from now on; the rank trains as soon as its first batch is here.
        _share_the_gil(stack)
        return _stream_input(spec, context.partitionId(), batches, stack, clock)
    # Spool first: it takes as long as Spark takes to deliver the partition, and the port rank 0
    # picks at the rendezvous must be bound by gloo right after, not minutes later.
    return _spool_input(spec, batches, stack, clock)


def _train(ctx: WorkerContext, context: Any, gathering: Any, resume: Any, store: Any
           ) -> tuple[list[dict[str, Any]] | None, bytes | None, bytes | None]:
    """(history, payload, part): a custom loop's result (rank 0's, pickled), or the built-in loop's
    history and this rank's part of the model (several ranks may each hold one: pipeline stages)."""
    spec = ctx.spec
    if spec.train_fn is not None:
        from sparkdl.executor.rendezvous import spark_barriers_after

        with spark_barriers_after(context, gathering):
            result = spec.train_fn(ctx)
        return None, dumps_any(result) if ctx.world.rank == 0 else None, None
    from sparkdl.executor.loop import train

    state, history = train(ctx, resume, store)
    part, payload = _deliver_part(spec, ctx.world.rank, state)
    return history, payload, part


def _deliver_part(spec: TrainSpec, rank: int, state: Any) -> tuple[bytes | None, bytes | None]:
    """(the record of where this rank's part of the model went, the part itself when it must ride
    in the job's rows): the trained state travels outside the JVMs (wire/model_transfer.py)."""
    if state is None:
        return None, None
    from sparkdl.wire.model_transfer import deliver, record_bytes

    record = deliver(spec.model_sink, rank, state)
    del state
    return record_bytes(record), record.get("payload")


def _import_what_training_imports(spec: TrainSpec) -> None:
    """The modules a fresh Python worker would import during training, now: their ~100 MB (torch's
    optimizers pull in torch._dynamo) is then not counted as this run's memory, and the first step
    waits for them either way."""
    if spec.train_fn is not None:
        return
    import torch._dynamo  # noqa: F401 - what the first optimizer's constructor imports

    import sparkdl.executor.loop  # noqa: F401
    from sparkdl.strategies import strategy_class

    strategy_class(spec.train.strategy)


def _read_own_rows(spec: TrainSpec, rank: int, placeholder: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Direct Parquet delivery: the job's input is one placeholder row per rank; the rank's rows
    come from its pieces of the files (data/parquet_shards.py)."""
    from sparkdl.data.parquet_shards import shard_batches

    for _ in placeholder:
        pass
    return shard_batches(spec.source, rank, spec.layout)


def _last_barrier(spec: TrainSpec, context: Any, comm: Communicator, gathering: Any) -> None:
    """Every rank is done before any rank's task ends. The communicator's barrier while the backend
    is alive: Spark's barrier wakes a rank that waits in it only once a second (its RPC is polled).
    A train_fn may have shut its backend down (hvd.shutdown() at the end of a Horovod script): then
    Spark's own, after the rendezvous's allGather returned (two Spark barrier calls at once on one
    task break Spark's barrier epochs)."""
    if spec.train_fn is None or comm.alive():
        comm.barrier()
        return
    if hasattr(context, "barrier"):
        if gathering is not None:
            gathering.join()
        context.barrier()


def _rendezvous(spec: TrainSpec, context: Any, client: Any) -> tuple[WorldInfo, Any, Any]:
    """(the world, rank 0's listening handle or None, the thread still waiting in Spark's allGather
    or None). A backend that listens before the rendezvous lets the ranks learn rank 0's port from
    the driver channel instead of waiting for Spark's allGather (executor/rendezvous.py says why);
    Horovod bootstraps over Spark's barrier, so it gathers through Spark only."""
    from sparkdl import comm as comm_registry
    from sparkdl.executor.rendezvous import rendezvous, rendezvous_through_driver

    launch = spec.launch
    backend = comm_registry.backend_class(launch.backend)
    own_address = context.getTaskInfos()[context.partitionId()].address.rsplit(":", 1)[0]
    listening = backend.listen(launch.timeout_s, own_address) if backend.listens and context.partitionId() == 0 \
        else None
    port = listening[0] if listening else 0
    if backend.listens and launch.backend not in comm_registry.BOOTSTRAPS_THROUGH_SPARK:
        # Not joined here: every rank's request is in by the time any rank trained, so the barrier is
        # complete on Spark's side; its thread returns on Spark's next poll (up to 1 s), which a
        # short run would otherwise wait for at its start. Joined before any other Spark barrier call.
        world, gathering = rendezvous_through_driver(context, port, client)
        return world, listening, gathering
    return rendezvous(context, port), listening, None


def _agree_before_training(spec: TrainSpec, comm: Communicator, world: WorldInfo, row_counts: tuple[int, ...]
                           ) -> tuple[Any, Any, tuple[int, ...] | None]:
    """What every rank must agree on before the context exists (collectives, in the same order on
    every rank): the run's checkpoint store, the checkpoint a retried attempt resumes from, and the
    batch shares by speed (the shares the run started with when resuming, not a new measurement)."""
    if spec.train_fn is not None:
        return None, None, None  # a custom loop keeps its own checkpoints and balance
    from sparkdl.executor.balance import agreed_shares
    from sparkdl.executor.checkpoint import find_resume, open_store
    from sparkdl.executor.reshape import reshaper_for

    store = open_store(spec, world.rank)
    resume = find_resume(store, comm, reshaper_for(spec.train, spec.launch)) if store is not None else None
    started_with = resume.progress.get("batch_shares") if resume is not None else None
    return store, resume, agreed_shares(spec.train, spec.data.batch_size, spec.launch.emulate_speed, comm,
                                        world.rank, world.size, row_counts, started_with)


def _maybe_emulate(spec: TrainSpec, comm: Communicator) -> Communicator:
    options = spec.launch.emulate_network
    if not options:
        return comm
    from sparkdl.comm.emulated import EmulatedNetwork, network_from_options

    latency_s, bandwidth = network_from_options(options)
    if comm.rank == 0:
        print(f"sparkdl: EMULATED network: every message slowed to {latency_s * 1e3:g} ms latency and "
              f"{bandwidth * 8 / 1e9:g} Gbit/s (launch.emulate_network); timings are not this cluster's", flush=True)
    return EmulatedNetwork(comm, latency_s, bandwidth)


_STREAMING_SWITCH_INTERVAL_S = 0.001


def _share_the_gil(stack: ExitStack) -> None:
    """A shorter GIL switch interval while the reader thread works beside the training loop: each
    time the reader releases the GIL (a numpy copy, a Parquet read) it waits for the loop to hand it
    back, up to the interval (5 ms by default) per call. Measured with a small MLP training beside
    direct Parquet reads: the reader 0.94M rows/s at 5 ms, 2.4M at 1 ms, the loop's steps unchanged.
    Restored afterwards: Python workers are reused by later tasks."""
    import sys

    previous = sys.getswitchinterval()
    sys.setswitchinterval(min(previous, _STREAMING_SWITCH_INTERVAL_S))
    stack.callback(sys.setswitchinterval, previous)


def _stream_input(spec: TrainSpec, rank: int, batches: Iterable[pa.RecordBatch], stack: ExitStack,
                  clock: Any) -> tuple[Any, Any]:
    """(StreamingSpool, its late validation rows or None): the partition arrives on a thread while
    epoch 1 trains; spool="disk" writes the spool for later epochs alongside (always for a custom
    loop, which may read its epochs in any order)."""
    from sparkdl.config.training import spool_mode
    from sparkdl.data.epochs import epoch_plan
    from sparkdl.data.stream import StreamedPartition, default_buffer_rows
    from sparkdl.data.streaming_spool import StreamingSpool
    from sparkdl.data.arrow_rows import spool_columns

    data = spec.data
    one_pass = spec.train_fn is None and spool_mode(data.spool, spec.train) == "none"
    expected = spec.row_counts[rank]
    # Under spool="none" a shard smaller than epoch 1's steps need wraps around copies of its first rows.
    plan = epoch_plan(spec.row_counts, data)
    needed = (plan.steps - 1) * plan.batch_size(rank) + plan.last_batch_size(rank) if plan.steps else 0
    write = None if one_pass else _spool_writer(spec, clock)
    partition = StreamedPartition(batches, spec.layout, write=write, keep_rows=max(needed - expected, 0), clock=clock)
    row_bytes = sum(c.row_bytes for c in spool_columns(spec.layout)) or 1024
    buffer_rows = data.shuffle_buffer_rows or default_buffer_rows(row_bytes, data.batch_size)
    source = stack.enter_context(closing(StreamingSpool(partition, spec.layout, expected, buffer_rows, one_pass)))
    return source, source.validation() if spec.layout.split_column is not None else None


def _spool_writer(spec: TrainSpec, clock: Any) -> Any:
    """batches -> Spool under data.spool_dir, free space checked first against the average share
    (validation rows included): the driver's shards differ by a few rows; a kept, skewed partitioning
    is caught while writing instead."""
    from sparkdl.data.batches import Spool
    from sparkdl.data.spool_space import spool_bytes

    from sparkdl.storage.private_dirs import private_root

    # data.spool_dir is the user's; the default is this user's own 0700 root, never a shared name.
    directory = spec.data.spool_dir or private_root("spool")
    expected = spool_bytes(spec.layout, -(-spec.rows // spec.world_size))
    return lambda batches, check=True: Spool.write(batches, spec.layout, directory,
                                                   expected_bytes=expected if check else 0, clock=clock)


def _spool_input(spec: TrainSpec, batches: Iterable[pa.RecordBatch], stack: ExitStack, clock: Any
                 ) -> tuple[Any, Any]:
    """(training spool, validation spool or None); both None for a run without a DataFrame."""
    if spec.layout is None:
        for _ in batches:  # the placeholder input of a run without a DataFrame is drained
            pass
        return None, None
    write = _spool_writer(spec, clock)
    if spec.layout.split_column is None:
        return stack.enter_context(write(batches)), None
    from sparkdl.data.arrow_rows import split_validation

    held_out: list[pa.RecordBatch] = []
    train = stack.enter_context(write(split_validation(batches, spec.layout.split_column, held_out)))
    # Validation rows are few by design; they wait in memory until the training rows are spooled.
    return train, stack.enter_context(write(iter(held_out), check=False))


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


def _limit_threads(spec: TrainSpec, context: Any, world: WorldInfo, stack: ExitStack) -> None:
    """torch's intra-op threads for this rank: the task's CPUs as Spark allotted them, or
    launch.threads_per_worker (executor/threads.py, the rule's one home)."""
    import torch

    from sparkdl.executor.threads import threads_for_rank

    threads = threads_for_rank(spec.launch.threads_per_worker, context, world.executors, world.rank, world.local_size,
                               spec.executor_cores)
    # Python workers are reused by later tasks (inference too): give them back what they had.
    stack.callback(torch.set_num_threads, torch.get_num_threads())
    torch.set_num_threads(threads)
