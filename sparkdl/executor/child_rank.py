"""In-task main of a compat rank (sparkdl.compat): the rank's child processes run the user's
function or script with the torchrun (or Horovod) variables set and no process group yet.

One Spark task is one torchrun node, as under PySpark's TorchDistributor: it runs
`processes_per_task` children (one per GPU of the task with use_gpu; one otherwise), global ranks
task * processes_per_task + local rank. Rank 0's task hosts the rendezvous (MASTER_ADDR/PORT, or
Horovod's gloo RendezvousServer). Every child's stdout/stderr line goes to this task's streams, which
forward it to the driver. Never imports pyspark.sql or torch (worker-side module).
"""
from __future__ import annotations

import json
import os
import sys
import threading
from contextlib import ExitStack
from typing import Any, Iterable, Iterator

import pyarrow as pa

from sparkdl.comm.base import WorldInfo
from sparkdl.errors import SparkdlError
from sparkdl.executor.child_process import ChildOutcome, child_env, first_failure, rank_failure, run_child
from sparkdl.executor.rendezvous import rendezvous
from sparkdl.storage.private_dirs import HeldDirectory, hold_new_directory, private_root
from sparkdl.wire.child import RESULT_TENSOR, ChildCall, torchrun_variables
from sparkdl.wire.codec import result_batches
from sparkdl.wire.spec import TrainSpec

LARGE_RESULT_BYTES = 32 << 20  # above this a return value leaves the job's rows (result_rows)
PARTITION_FILE_VARIABLE = "SPARK_PARTITION_ARROW_DATA_FILE"  # PySpark's own names (pyspark.ml.torch.distributor)
SCHEMA_FILE_VARIABLE = "SPARK_DATAFRAME_SCHEMA_FILE"
RANK_PREFIX = "sparkdl-rank"  # a task's working directory: <prefix><rank>-<random> (private_dirs)


def run_child_rank(spec: TrainSpec, context: Any, batches: Iterable[pa.RecordBatch],
                   client: Any = None) -> Iterator[pa.RecordBatch]:
    call = spec.child
    assert call is not None
    world = rendezvous(context)
    with ExitStack() as stack:
        workdir = stack.enter_context(rank_workdir(world.rank)).path
        data_variables = write_partition(call, batches, workdir, world.rank)
        per_task = call.processes_per_task
        ranks = [world.rank * per_task + i for i in range(per_task)]
        envs = [child_env({**data_variables, **_rank_variables(spec, call, world, context, stack, r, i)},
                          call.use_gpu) for i, r in enumerate(ranks)]
        if call.use_gpu and world.gpus and "CUDA_VISIBLE_DEVICES" not in os.environ:
            for env in envs:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(world.gpus)
        outcomes = run_children(call, envs, workdir, ranks)
        _raise_first_failure(ranks, outcomes)
        if call.framework == "horovod":
            context.barrier()  # rank 0's rendezvous server stays up until every rank is done
    for rank, outcome in zip(ranks, outcomes):
        if rank == 0 or call.results == "all":
            yield from result_rows(spec, rank, outcome.result or b"")


def result_rows(spec: TrainSpec, rank: int, payload: bytes) -> list[pa.RecordBatch]:
    """A rank's return value: in the job's rows when small; a large one travels as trained models do
    (wire/model_transfer.py: to the driver's receiver or the run's storage, outside the JVMs, whose
    result rows are bounded by spark.driver.maxResultSize), as one uint8 tensor named "result"."""
    sink = spec.model_sink
    if len(payload) <= LARGE_RESULT_BYTES or sink is None or sink.mode == "rows":
        return result_batches(rank, None, payload)
    import torch

    from sparkdl.wire.model_transfer import deliver, record_bytes

    record = deliver(sink, rank, {RESULT_TENSOR: torch.frombuffer(bytearray(payload), dtype=torch.uint8)})
    return result_batches(rank, None, record.get("payload"), record_bytes(record))


def run_children(call: ChildCall, envs: list[dict[str, str]], workdir: str, ranks: list[int],
                 prefix_always: bool = False, sibling_grace_s: float = 5.0) -> list[ChildOutcome]:
    """Each env's child at once, each in its own subdirectory; output lines to this process's
    streams, prefixed with the global rank when a task runs several (or `prefix_always`: the
    driver's own children in local mode). Once one fails, the others get `sibling_grace_s` to fail
    too (their collectives break) and are then stopped: a rank waiting for the failed one in a
    rendezvous or collective would wait for torch's timeout (30 minutes)."""
    outcomes: list[ChildOutcome | None] = [None] * len(envs)
    stop = threading.Event()

    def one(i: int) -> None:
        directory = os.path.join(workdir, f"rank-{ranks[i]}")
        os.makedirs(directory, mode=0o700, exist_ok=True)  # inside a 0700 directory of this task's own
        prefix = f"[rank {ranks[i]}] " if len(envs) > 1 or prefix_always else ""
        outcome = run_child(call, envs[i], directory,
                            lambda stream, line: print(prefix + line, file=getattr(sys, stream), flush=True), stop)
        outcomes[i] = outcome
        if outcome.error is not None and not stop.is_set():
            timer = threading.Timer(sibling_grace_s, stop.set)
            timer.daemon = True
            timer.start()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(envs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stop.set()
    return [o if o is not None else ChildOutcome(-1, None, {"type": "RuntimeError", "module": "builtins",
                                                            "message": "the child never ran", "traceback": ""})
            for o in outcomes]


def write_partition(call: ChildCall, batches: Iterable[pa.RecordBatch], workdir: str, rank: int) -> dict[str, str]:
    """This task's partition as PySpark's TorchDistributor writes it (an Arrow IPC stream and
    Spark's schema as JSON), named by the variables pyspark's _get_spark_partition_data_loader and
    sparkdl.compat.partition_batches read; without a DataFrame the placeholder rows are drained."""
    if not call.partition_schema:
        for _ in batches:
            pass
        return {}
    data_path, schema_path = os.path.join(workdir, "data.arrow"), os.path.join(workdir, "schema.json")
    rows = 0
    writer = None
    with open(data_path, "wb") as sink:
        for batch in batches:
            if writer is None:
                writer = pa.ipc.new_stream(sink, batch.schema)
            writer.write_batch(batch)
            rows += batch.num_rows
        if writer is not None:
            writer.close()
    if rows == 0:
        raise SparkdlError(f"rank {rank}: its partition of the DataFrame is empty, and _train_on_dataframe feeds "
                           "rank r the DataFrame's partition r",
                           hint="repartition the DataFrame to num_processes partitions that each hold rows "
                                "(df.repartition(num_processes))")
    with open(schema_path, "w", encoding="utf-8") as f:
        f.write(call.partition_schema)
    return {PARTITION_FILE_VARIABLE: data_path, SCHEMA_FILE_VARIABLE: schema_path}


def _rank_variables(spec: TrainSpec, call: ChildCall, world: WorldInfo, context: Any, stack: ExitStack,
                    rank: int, local_rank: int) -> dict[str, str]:
    per_task = call.processes_per_task
    variables = torchrun_variables(rank, world.size * per_task, local_rank, per_task, world.rank, world.size,
                                   world.master_addr, world.master_port, spec.run_id)
    variables.update(dict(call.env))
    if rank == 0:
        variables.update(dict(call.rank0_env))
    if call.framework == "horovod":
        variables.update(_horovod_variables(spec, world, context, stack))
    return variables


def _horovod_variables(spec: TrainSpec, world: WorldInfo, context: Any, stack: ExitStack) -> dict[str, str]:
    from sparkdl.comm.horovod_env import horovod_variables, start_rendezvous

    port = 0
    if world.rank == 0:
        server, port = start_rendezvous(world.hosts)
        stack.callback(server.stop)
    messages = [json.loads(m) for m in context.allGather(json.dumps({"rank": world.rank, "port": port}))]
    port = next(m["port"] for m in messages if m["rank"] == 0)
    return horovod_variables(world.hosts, world.rank, world.master_addr, port, spec.launch.timeout_s,
                             spec.launch.horovod_env)


def _raise_first_failure(ranks: list[int], outcomes: list[ChildOutcome]) -> None:
    failed = first_failure(outcomes, ranks)
    if failed is not None:
        raise rank_failure(*failed)


def rank_workdir(rank: int) -> HeldDirectory:
    """This task's working directory (its partition's copy, its children's directories), 0700 and
    held by a lock while the task's process lives: a task SIGKILLed with its partition on disk
    leaves a directory the next rank task under the same root sweeps (storage/private_dirs.py)."""
    return hold_new_directory(_local_dir() or private_root("spool"), RANK_PREFIX, f"{rank}-")


def _local_dir() -> str | None:
    """Spark's local directories (SPARK_LOCAL_DIRS, set for Python workers): a partition may be large."""
    for directory in (os.environ.get("SPARK_LOCAL_DIRS") or "").split(","):
        if directory and os.path.isdir(directory):
            return directory
    return None
