"""Integrity of checkpoint files: a checksum per part, taken as it is written and checked whenever it
is read, and a strict reading of the manifest (every field's type and range).

A damaged file must be named as damaged, the same way on every rank, so that the ranks can agree to
resume from an older step (executor/checkpoint_fallback.py) instead of failing deep in torch.load,
or with a TypeError on rank 0 alone while the others wait in the next collective.

Checksums are SHA-256, written "sha256:<hex>" in the manifest next to each rank's part. The part is
hashed piece by piece while it is written (the pieces are in memory already: no second pass over the
file) on the writer thread, and hashlib releases the GIL on large buffers, so training does not wait
for it (about 1.7 GB/s with the CPU's SHA extensions). Reading hashes the bytes read, in memory.
The checksum detects truncation, bit flips and a part of another step; it is no authentication:
whoever can rewrite a part can rewrite the manifest too (docs/operations.md, "Security model").

Manifests written before checksums have none: their parts are read as before, and a part that
torch.load cannot read is still found unreadable (only a silent change goes unnoticed there).
"""
from __future__ import annotations

import hashlib
import json
import re
from typing import Any, NamedTuple

from sparkdl.errors import CheckpointError

FORMAT = 1  # the manifest's format version (checksums are an optional field: older readers skip them)
ALGORITHM = "sha256"
MAX_MANIFEST_BYTES = 4 << 20  # a manifest lists a few steps; anything larger is not one sparkdl wrote
_CHECKSUM = re.compile(r"^sha256:[0-9a-f]{64}$")


class PartDigest:
    """The running checksum of a part being written, one piece at a time."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()

    def update(self, piece: bytes | memoryview) -> None:
        self._hash.update(piece)

    @property
    def value(self) -> str:
        return f"{ALGORITHM}:{self._hash.hexdigest()}"


def checksum(data: bytes | memoryview) -> str:
    """The manifest's checksum of `data`."""
    digest = PartDigest()
    digest.update(data)
    return digest.value


def verify(data: bytes, expected: str, what: str) -> None:
    """CheckpointError naming `what` when `data` is not what the manifest recorded."""
    found = checksum(data)
    if found != expected:
        raise CheckpointError(f"{what} does not match its checksum: {len(data)} bytes with {found[:19]}..., the "
                              f"manifest recorded {expected[:19]}... (truncated or changed since it was written)")


class StepFields(NamedTuple):
    """One manifest entry, checked: executor/checkpoint.StepRecord's fields."""

    step: int
    ranks: tuple[int, ...]
    strategy_ranks: tuple[int, ...]
    world_size: int
    checksums: tuple[str, ...]


class DamagedEntry(NamedTuple):
    """A manifest entry that cannot be used: its step number when it has a readable one, and why."""

    step: int | None
    reason: str


class ManifestFields(NamedTuple):
    """A manifest, checked: the world size, and its entries oldest first (resuming falls back past
    the damaged ones)."""

    world_size: int
    entries: tuple[StepFields | DamagedEntry, ...]


def manifest_error(where: str, problem: str) -> CheckpointError:
    return CheckpointError(f"the checkpoint manifest {where!r} cannot be used: {problem}",
                           hint="it was changed or damaged after sparkdl wrote it: restore it, or start a fresh run "
                                "(another checkpoint_dir, or remove the run's directory)")


def parse_manifest(text: str, where: str = "manifest.json") -> ManifestFields:
    """The manifest's fields, every type and range checked. A damaged top level (not JSON, the
    wrong types, a newer format) is a CheckpointError naming `where`; a damaged entry is kept as the
    reason it cannot be used. Deterministic: every rank that parses the same text gets the same."""
    if len(text) > MAX_MANIFEST_BYTES:
        raise manifest_error(where, f"{len(text)} characters, more than any manifest sparkdl writes")
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise manifest_error(where, f"not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise manifest_error(where, f"holds {_kind(data)}, not a JSON object")
    version = data.get("format", 0)
    if not _is_int(version) or version < 0:
        raise manifest_error(where, f"'format' must be a whole number, not {_shown(version)}")
    if version > FORMAT:
        raise CheckpointError(f"checkpoint manifest format {version} is newer than this sparkdl reads ({FORMAT})",
                              hint="resume with the sparkdl version that wrote the checkpoints")
    world_size = data.get("world_size")
    if not _is_int(world_size) or world_size < 1:
        raise manifest_error(where, f"'world_size' must be a whole number >= 1, not {_shown(world_size)}")
    steps = data.get("steps")
    if not isinstance(steps, list):
        raise manifest_error(where, f"'steps' must be a list, not {_shown(steps)}")
    entries: list[StepFields | DamagedEntry] = []
    last = -1
    for index, entry in enumerate(steps):
        try:
            fields = _step_fields(entry, last)
        except ValueError as exc:
            step = entry.get("step") if isinstance(entry, dict) else None
            step = step if _is_int(step) else None
            entries.append(DamagedEntry(step, f"the manifest's entry steps[{index}]"
                                        + (f" (step {step})" if step is not None else "") + f" is damaged: {exc}"))
            continue
        entries.append(fields)
        last = fields.step
    return ManifestFields(world_size, tuple(entries))


def _step_fields(entry: Any, after: int) -> StepFields:
    """One entry's fields, or ValueError saying what is wrong with it."""
    if not isinstance(entry, dict):
        raise ValueError(f"{_kind(entry)}, not a JSON object")
    step = entry.get("step")
    if not _is_int(step) or step < 0:
        raise ValueError(f"'step' must be a whole number >= 0, not {_shown(step)}")
    if step <= after:
        raise ValueError(f"step {step} is listed after step {after} (steps are recorded in order)")
    ranks = _ranks(entry, "ranks")
    if ranks != tuple(range(len(ranks))):
        raise ValueError(f"'ranks' must be 0, 1, ... in order, not {list(ranks)}")
    strategy_ranks = _ranks(entry, "strategy_ranks")
    if not set(strategy_ranks) <= set(ranks):
        raise ValueError(f"'strategy_ranks' {list(strategy_ranks)} are not all among 'ranks' {list(ranks)}")
    world_size = entry.get("world_size", 0)
    if not _is_int(world_size) or world_size < 0:
        raise ValueError(f"'world_size' must be a whole number >= 0, not {_shown(world_size)}")
    checksums = entry.get("checksums", [])
    if not isinstance(checksums, list) or not all(isinstance(c, str) and _CHECKSUM.match(c) for c in checksums):
        raise ValueError(f"'checksums' must be a list of 'sha256:<64 hex digits>', not {_shown(checksums)}")
    if checksums and len(checksums) != len(ranks):
        raise ValueError(f"{len(checksums)} checksums for {len(ranks)} ranks")
    return StepFields(step, ranks, strategy_ranks, world_size, tuple(checksums))


def _ranks(entry: dict[str, Any], key: str) -> tuple[int, ...]:
    value = entry.get(key)
    if not isinstance(value, list) or not value or not all(_is_int(r) and r >= 0 for r in value):
        raise ValueError(f"{key!r} must be a non-empty list of whole numbers >= 0, not {_shown(value)}")
    return tuple(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is no rank


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", type(None): "null", bool: "a boolean"}.get(
        type(value), "a number")


def _shown(value: Any) -> str:
    text = json.dumps(value) if value is not None else "missing or null"
    return text if len(text) <= 60 else text[:57] + "..."
