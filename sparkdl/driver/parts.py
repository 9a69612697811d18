"""Driver side of the model transfer (wire/model_transfer.py): where this attempt's parts go, and the
parts the job left, as trained_model.ModelParts (files the driver reads one tensor at a time)."""
from __future__ import annotations

import logging
import os
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from sparkdl.config import LaunchConfig
from sparkdl.errors import ConfigError, TrainingError
from sparkdl.wire.admission import AdmissionLimits
from sparkdl.wire.model_transfer import ModelSink, PartReceiver, part_name, parts_directory, remove_directory
from sparkdl.storage.files import is_local_path
from sparkdl.storage.private_dirs import open_private
from sparkdl.model.trained import ModelParts, remove_files

log = logging.getLogger("sparkdl")


@dataclass
class OpenSink:
    sink: ModelSink
    directory: str  # this attempt's directory on the driver's disk (received parts, parts from rows)
    receiver: PartReceiver | None = None


def transfer_mode(launch: LaunchConfig, checkpoint_dir: str | None, cluster: bool = False) -> str:
    """launch.model_transfer with "auto" decided: the channel when it is on, else the run's storage
    when there is one the driver shares with every executor, else the job's rows. `cluster`: the
    executors are other hosts (a host-local checkpoint_dir is a different directory on each)."""
    if launch.model_transfer != "auto":
        return launch.model_transfer
    if launch.channel != "off":
        return "channel"
    root = storage_root(launch, checkpoint_dir)
    return "storage" if root and not (cluster and is_local_path(root)) else "rows"


def storage_root(launch: LaunchConfig, checkpoint_dir: str | None) -> str | None:
    """Where parts go with model_transfer="storage": train.checkpoint_dir, else launch.run_dir."""
    return checkpoint_dir or launch.run_dir


def check_transfer(launch: LaunchConfig, checkpoint_dir: str | None, cluster: bool = False) -> None:
    """Before any job: "storage" needs a directory every rank and the driver reach."""
    if transfer_mode(launch, checkpoint_dir, cluster) != "storage":
        return
    root = storage_root(launch, checkpoint_dir)
    if not root:
        raise ConfigError('launch.model_transfer="storage" needs train.checkpoint_dir or launch.run_dir',
                          hint="set checkpoint_dir to a directory every executor and the driver reach (a shared "
                               'mount, s3://...), or use model_transfer="auto"')
    if cluster and is_local_path(root):
        raise ConfigError(f'launch.model_transfer="storage" writes the model under {root!r}, a host-local path: on a '
                          "cluster every executor writes its part on its own host, out of the driver's reach",
                          hint='use a URI every host reaches (s3://..., abfs://..., hdfs://...) or model_transfer="auto"')


def open_sink(spark: Any, spec: Any, cleanup: ExitStack) -> OpenSink:
    """This attempt's sink; what it opens is closed by `cleanup`, and the directory removed when
    the attempt fails (a successful one hands it to the ModelParts)."""
    from sparkdl.spark.session import facts

    from sparkdl.spark.session import is_local_master

    launch, checkpoint_dir = spec.launch, spec.train.checkpoint_dir
    cluster = not is_local_master(facts(spark).master())
    check_transfer(launch, checkpoint_dir, cluster)
    mode = transfer_mode(launch, checkpoint_dir, cluster)
    directory = parts_directory(spec.run_id)
    timeout = float(launch.timeout_s)
    explicit = launch.model_transfer != "auto"
    if mode == "channel":
        channel = launch.channel
        receiver = PartReceiver(facts(spark).channel_host() if channel == "auto" else channel, directory, timeout,
                                AdmissionLimits().for_ranks(spec.world_size))
        cleanup.callback(receiver.close)
        cleanup.push(_remove_on_failure(directory, None))
        return OpenSink(ModelSink("channel", receiver.address, timeout_s=timeout, fallback=not explicit), directory,
                        receiver)
    if mode == "storage":
        from sparkdl.storage.files import join

        attempt = os.path.basename(directory)  # unique per attempt: a retry never mixes with a failed one
        where = join(str(storage_root(launch, checkpoint_dir)), spec.run_id, "model", attempt)
        cleanup.push(_remove_on_failure(directory, where))
        return OpenSink(ModelSink("storage", storage_uri=where, timeout_s=timeout), directory)
    cleanup.push(_remove_on_failure(directory, None))
    return OpenSink(ModelSink("rows", timeout_s=timeout), directory)


def _remove_on_failure(directory: str, storage: str | None) -> Any:
    """An exit callback: a failed attempt leaves none of its parts behind, here or in storage."""
    def on_exit(kind: Any, exc: BaseException | None, trace: Any) -> None:
        if exc is not None:
            remove_files(directory, storage)
    return on_exit


def gather_parts(opened: OpenSink, parts: dict[str, Any]) -> ModelParts:
    """The parts the ranks sent, wherever they went; a part that rode in the rows is written to the
    attempt's directory first, so every part is a file."""
    from sparkdl.wire.codec import part_records

    files, sizes, via, seconds = [], {}, {}, {}
    for rank, (record, chunks) in sorted(part_records(parts).items()):
        how = record.get("via")
        if how == "channel":
            path = os.path.join(opened.directory, part_name(rank))
            if not os.path.exists(path):
                reason = opened.receiver.errors.get(rank, "no file arrived") if opened.receiver else "no receiver"
                raise TrainingError(f"rank {rank}'s part of the trained model did not arrive: {reason}",
                                    hint="see the driver's log; launch.model_transfer=\"storage\" with a shared "
                                         "checkpoint_dir avoids the driver's network")
            files.append(path)
        elif how == "rows" and opened.sink.mode == "channel":
            reason = opened.receiver.errors.get(rank, "it could not connect") if opened.receiver else "no receiver"
            log.warning("sparkdl: rank %d's part of the model came back in the job's rows, not over the channel "
                        "(%s)", rank, reason)
        if how == "storage":
            files.append(str(record["uri"]))
        if how not in ("channel", "storage"):
            path = os.path.join(opened.directory, part_name(rank))
            if os.path.lexists(path):  # the receiver's copy, when the rank missed its confirmation
                os.unlink(path)
            with open_private(path) as out:  # 0600, like the parts the receiver writes
                while chunks:
                    out.write(chunks.pop(0))
            files.append(path)
        sizes[rank], via[rank], seconds[rank] = int(record.get("bytes", 0)), str(how), float(record.get("seconds", 0))
    return ModelParts(tuple(files), owned_directory=opened.directory, bytes_by_rank=sizes, via_by_rank=via,
                      seconds_by_rank=seconds, storage_directory=opened.sink.storage_uri)


def child_results(opened: OpenSink | None, parts: dict[str, Any], world_size: int) -> list[Any]:
    """Every rank's return value of a compat run (None where a rank returned none): from the job's
    rows, or, for a large one, from the tensor file it was sent as (executor/child_rank.result_rows)."""
    import pickle

    from sparkdl.storage.files import locate, open_input
    from sparkdl.model.tensor_files import read_tensors
    from sparkdl.wire.child import RESULT_TENSOR
    from sparkdl.wire.codec import loads_every_result

    sent = {rank for rank, _, _ in parts.get("part", [])}
    payloads = parts.pop("payload", [])
    values = loads_every_result({"payload": [p for p in payloads if p[0] not in sent]}, world_size)
    if not sent:
        if opened is not None:  # no rank sent a file: the attempt's directory is not needed
            remove_directory(opened.directory)
        return values
    if opened is None:
        raise TrainingError("a rank sent its return value as a file, but no receiver was open")
    parts["payload"] = [p for p in payloads if p[0] in sent]
    received = gather_parts(opened, parts)
    for rank, uri in zip(sorted(sent), received.files):
        with open_input(locate(uri)) as stream:
            tensors = dict(read_tensors(stream))
        values[rank] = pickle.loads(memoryview(tensors[RESULT_TENSOR].numpy()))
    received.remove()  # the files were read: nothing of them is kept
    return values
