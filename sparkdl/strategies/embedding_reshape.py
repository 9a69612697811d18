"""Strategy "embeddings" resuming a checkpoint written by another number of ranks (elastic runs,
train.resume_run on another size) or another placement: each rank reads the old ranks' parts one at
a time and keeps only the rows its own placement gives it, so no rank ever holds more than its new
rows plus one old part. Rows come with their per-row optimizer state; scalar state (Adam's step
count), the dense model and its optimizer come from old rank 0, whose copies every rank shared.
Checkpoints are written after a flush: no late embedding update is in flight in them.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from sparkdl.errors import CheckpointError

ReadPart = Callable[[int], dict[str, Any]]  # old rank -> the strategy state it saved


def reshaped_state(bags: Any, old_world: int, read_part: ReadPart) -> dict[str, Any]:
    """(first old part's training state, this rank's shard_state for `bags`) cut from every old part."""
    placement, rank = bags.placement, bags.comm.rank
    wanted = {s.name: placement.rows_of(s.name, rank) if not _whole_everywhere(bags) else (0, s.num_rows)
              for s in placement.tables}
    tables: dict[str, dict[str, Any]] = {}
    first: dict[str, Any] | None = None
    for old_rank in range(old_world):
        part = read_part(old_rank).get("training")
        if part is None:
            raise CheckpointError(f"rank {old_rank}'s part of the checkpoint holds no embedding training state",
                                  hint="resume with the strategy the checkpoint was written by")
        first = first or part
        for name, saved in part["tables"]["tables"].items():
            if name in wanted:
                _take_rows(tables, name, wanted[name], saved)
        if _whole_everywhere_state(part):  # a replicated checkpoint: one part holds every row
            break
    assert first is not None
    for spec in placement.tables:
        start, stop = wanted[spec.name]
        got = tables.get(spec.name)
        if got is None or got["filled"] != stop - start:
            raise CheckpointError(f"the checkpoint does not hold rows {start}..{stop} of table {spec.name!r}",
                                  hint="resume with the model (its tables) the checkpoint was written for")
        del got["filled"]
    shard = {"format": 1, "rank": rank, "world_size": bags.comm.size, "steps": int(first["tables"]["steps"]),
             "max_lag": 0, "tables": tables, "pending": []}
    if _whole_everywhere(bags):
        shard["kind"] = "replicated"
    return {**first, "tables": shard}


def _whole_everywhere(bags: Any) -> bool:
    return type(bags).__name__ == "ReplicatedEmbeddingBags"


def _whole_everywhere_state(part: dict[str, Any]) -> bool:
    return part["tables"].get("kind") == "replicated"


def _take_rows(tables: dict[str, dict[str, Any]], name: str, wanted: tuple[int, int], saved: dict[str, Any]) -> None:
    """Copy the overlap of `saved`'s rows with `wanted` (rows and per-row optimizer state)."""
    start, stop = wanted
    low, high = max(start, int(saved["start"])), min(stop, int(saved["stop"]))
    weight = saved["weight"]
    if name not in tables:
        optimizer = {key: torch.zeros((stop - start, *value.shape[1:]), dtype=value.dtype)
                     if _per_row(value, saved) else value.clone() for key, value in saved["optimizer"].items()}
        tables[name] = {"start": start, "stop": stop, "filled": 0, "optimizer": optimizer,
                        "weight": torch.zeros((stop - start, *weight.shape[1:]), dtype=weight.dtype)}
    if high <= low:
        return
    into, source = slice(low - start, high - start), slice(low - int(saved["start"]), high - int(saved["start"]))
    entry = tables[name]
    entry["weight"][into] = weight[source]
    for key, value in saved["optimizer"].items():
        if _per_row(value, saved):
            entry["optimizer"][key][into] = value[source]
    entry["filled"] += high - low


def _per_row(value: Any, saved: dict[str, Any]) -> bool:
    return torch.is_tensor(value) and value.dim() >= 1 and value.shape[0] == int(saved["stop"]) - int(saved["start"])
