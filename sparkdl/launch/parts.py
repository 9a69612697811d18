"""Driver side of the model transfer (launch/model_transfer.py): where this attempt's parts go, and the
parts the job left, as trained_model.ModelParts (files the driver reads one tensor at a time)."""
from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from sparkdl.config import RunConfig
from sparkdl.errors import ConfigError, TrainingError
from sparkdl.launch.model_transfer import ModelSink, PartReceiver, part_name, parts_directory, remove_directory
from sparkdl.trained_model import ModelParts


@dataclass
class OpenSink:
    sink: ModelSink
    directory: str  # this attempt's directory on the driver's disk (received parts, parts from rows)
    receiver: PartReceiver | None = None


def transfer_mode(config: RunConfig) -> str:
    """launch.model_transfer with "auto" decided: the channel when it is on, else the run's storage
    when there is one, else the job's rows."""
    launch, train = config.launch, config.train
    if launch.model_transfer != "auto":
        return launch.model_transfer
    if launch.channel != "off":
        return "channel"
    return "storage" if storage_root(config) else "rows"


def storage_root(config: RunConfig) -> str | None:
    return config.train.checkpoint_dir or config.launch.run_dir


def check_transfer(config: RunConfig) -> None:
    """Before any job: "storage" needs a directory every rank and the driver reach."""
    if transfer_mode(config) == "storage" and not storage_root(config):
        raise ConfigError('launch.model_transfer="storage" needs train.checkpoint_dir or launch.run_dir',
                          hint="set checkpoint_dir to a directory every executor and the driver reach (a shared "
                               'mount, s3://...), or use model_transfer="auto"')


def open_sink(spark: Any, spec: Any, cleanup: ExitStack) -> OpenSink:
    """This attempt's sink; what it opens is closed by `cleanup`, and the directory removed when
    the attempt fails (a successful one hands it to the ModelParts)."""
    from sparkdl.session import facts

    config: RunConfig = spec.config
    check_transfer(config)
    mode = transfer_mode(config)
    directory = parts_directory(spec.run_id)
    cleanup.push(lambda kind, exc, tb: remove_directory(directory) if exc is not None else None)
    timeout = float(config.launch.timeout_s)
    if mode == "channel":
        channel = config.launch.channel
        receiver = PartReceiver(facts(spark).channel_host() if channel == "auto" else channel, directory, timeout)
        cleanup.callback(receiver.close)
        return OpenSink(ModelSink("channel", receiver.address, timeout_s=timeout), directory, receiver)
    if mode == "storage":
        from sparkdl.storage import join

        attempt = os.path.basename(directory)  # unique per attempt: a retry never mixes with a failed one
        where = join(str(storage_root(config)), spec.run_id, "model", attempt)
        return OpenSink(ModelSink("storage", storage_uri=where, timeout_s=timeout), directory)
    return OpenSink(ModelSink("rows", timeout_s=timeout), directory)


def gather_parts(opened: OpenSink, parts: dict[str, Any]) -> ModelParts:
    """The parts the ranks sent, wherever they went; a part that rode in the rows is written to the
    attempt's directory first, so every part is a file."""
    from sparkdl.launch.wire import part_records

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
        elif how == "storage":
            files.append(str(record["uri"]))
        else:
            path = os.path.join(opened.directory, part_name(rank))
            with open(path, "wb") as out:
                while chunks:
                    out.write(chunks.pop(0))
            files.append(path)
        sizes[rank], via[rank], seconds[rank] = int(record.get("bytes", 0)), str(how), float(record.get("seconds", 0))
    return ModelParts(tuple(files), owned_directory=opened.directory, bytes_by_rank=sizes, via_by_rank=via,
                      seconds_by_rank=seconds,                      storage_directory=opened.sink.storage_uri)
