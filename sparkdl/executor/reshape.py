"""Resuming a checkpoint written by another world size (spot-safe runs: launch.min_workers /
max_workers, driver/elastic.py on the driver).

What carries over, per strategy (config_elastic.RESHAPEABLE):
- data parallel (allreduce): its state is replicated, rank 0's part is everyone's;
- DiLoCo: rank 0's part, with every replica restarting from the global model and the outer
  optimizer's state (diloco.OuterSync: progress since each fragment's last sync and the residuals
  of the old ranks are dropped);
- sharded: every old rank's shards laid end to end, each new rank cutting its own (sharded.py);
- embeddings: each new rank reads the old parts one at a time and keeps the rows of its own
  placement (strategies/embedding_reshape.py).
The position (epoch, step, global step), rank 0's history and early stopping's state continue;
the epoch's running sums start again (the epoch's loss is over the steps after the resume), and a
new rank without a part of its own takes rank 0's RNG state.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from sparkdl.config import LaunchConfig, TrainConfig
from sparkdl.errors import CheckpointError
from sparkdl.executor.checkpoint import CheckpointStore, Position, Resume, StepRecord

KEPT_PROGRESS = ("history", "early_stopping")


def reshaper_for(train: TrainConfig, launch: LaunchConfig) -> Callable[[CheckpointStore, StepRecord, int, Any], Resume] | None:
    """find_resume's `reshape` for a run that may change size, or that continues another fit's
    checkpoints (train.resume_run) on another number of workers; None: same size only."""
    from sparkdl.config.elastic import is_elastic

    if not is_elastic(launch) and not train.resume_run:
        return None
    return reshaper(train)


def reshaper(train: Any) -> Callable[[CheckpointStore, StepRecord, int, Any], Resume]:
    """find_resume's `reshape` for this run's strategy."""
    def reshape(store: CheckpointStore, latest: StepRecord, written_by: int, comm: Any) -> Resume:
        first = _read(store, latest.step, 0)
        if train.strategy == "sharded":
            state = gathered_shards([_read(store, latest.step, r)["strategy"] for r in range(written_by)])
        elif train.strategy == "embeddings":  # each rank reads the old parts one at a time, keeps its rows
            state = {"reshape_from": written_by, "steps": first["strategy"].get("steps", {}),
                     "read_part": lambda r: first["strategy"] if r == 0 else _read(store, latest.step, r)["strategy"]}
        else:
            state = first.get("strategy")
            if state is None:
                raise CheckpointError(f"the checkpoint of step {latest.step} holds no training state in rank 0's part",
                                      hint="start a fresh run (another checkpoint_dir)")
            if train.sync == "diloco":
                state = {**state, "restart_from_global": True}
        if comm.rank == 0:
            print(f"sparkdl: resuming the checkpoint of step {latest.step}, written by {written_by} workers, on "
                  f"{comm.size}", flush=True)
        own_rng = _read(store, latest.step, comm.rank)["rng"] if comm.rank < written_by else first["rng"]
        epoch, step, global_step = first["position"]
        progress = {k: v for k, v in dict(first["progress"]).items() if k in KEPT_PROGRESS}
        return Resume(Position(int(epoch), int(step), int(global_step)), progress, state, own_rng, written_by)

    return reshape


def gathered_shards(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Sharded data parallel's states of every old rank as one: each layer's shards (and the
    optimizer's per-shard tensors) concatenated in rank order; Sharded.load_checkpoint_state cuts
    its own slice (`gathered_from`)."""
    first = parts[0]
    module = {key: torch.cat([p["module"][key] for p in parts]) if key.startswith("shard.") else value
              for key, value in first["module"].items()}
    state: dict[str, Any] = {**first, "module": module, "gathered_from": len(parts)}
    if "optimizer" in first:
        optimizer = {**first["optimizer"], "state": {}}
        for index, values in first["optimizer"]["state"].items():
            optimizer["state"][index] = {
                name: torch.cat([p["optimizer"]["state"][index][name] for p in parts])
                if torch.is_tensor(value) and value.dim() >= 1 else value for name, value in values.items()}
        state["optimizer"] = optimizer
    return state


def _read(store: CheckpointStore, step: int, rank: int) -> dict[str, Any]:
    try:
        return store.read_part(step, rank)
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(
            f"cannot read rank {rank}'s part of the checkpoint of step {step} under {store.root.path!r} to resume on "
            f"another number of workers: {type(exc).__name__}: {exc}",
            hint="an elastic run needs train.checkpoint_dir on storage every host shares (a host-local directory "
                 "left with its host)") from None
