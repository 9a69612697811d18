"""Checkpoints of a training run, so a retried barrier stage resumes instead of starting over.

Layout under `train.checkpoint_dir` (a local path, a shared mount or any pyarrow filesystem URI:
s3://bucket/prefix?endpoint_override=..., gs://, abfs://, hdfs://), through sparkdl/storage/files.py:
    <dir>/<run id>/step-<global step, 9 digits>/rank-<r>.pt   one file per rank
    <dir>/<run id>/manifest.json                              the complete steps, written by rank 0
A rank's file is written in the background (executor/checkpoint_async.py) to a temporary name and
renamed (a local disk; fsynced) or uploaded as one object (an object store makes it visible only
once complete). A step is complete only once every rank reported its write durable and rank 0
recorded it in the manifest (itself written atomically); a step directory the manifest does not list
is never loaded, and is deleted when an attempt resumes (a killed attempt's half-written steps).
The manifest keeps the last `keep_checkpoints` steps; each rank deletes its own files of the steps
it drops and rank 0 the step directories, so host-local directories are pruned too.

Files hold only tensors and plain Python values and are read with torch.load(weights_only=True):
loading a checkpoint cannot run code. The run id is the same for every attempt of one fit (the
driver resubmits the same spec), so an attempt finds what the previous one wrote.

World size: the manifest records, per step, the world size that wrote it, the ranks that wrote a
part and those whose part holds the strategy's state. A replicated strategy (data parallel with
allreduce) has its whole state in rank 0's part (`read_part(step, 0)`). Per-rank states (DiLoCo
replicas, hybrid stages, IST subnets, sharded data parallel) are each rank's own. Resuming at the
same world size continues exactly (positions within the epoch, running sums and RNG states are per
rank); at another one it is refused with a CheckpointError, unless the run may change size
(launch.min_workers / max_workers), when executor/reshape.py carries the state over.
The format before the manifest (a COMPLETE marker per step) is not read: run ids
are new for every fit, so no fit resumes another version's checkpoints.

Integrity: the manifest records each part's SHA-256, taken while the part is written, and every
read checks it (executor/checkpoint_verify.py); the manifest is read strictly (types, ranges), and
the same text by every rank. When the newest recorded step cannot be read by every rank (a part
truncated, changed or missing, a damaged entry), all ranks agree to resume from the newest older
step that all can read (executor/checkpoint_fallback.py), and say so in the history and MLflow.
A read the storage
refused or did not answer (any OSError but a missing file) is no damage: every rank raises the same
retryable error and nothing is skipped. Skipped steps are not deleted: rank 0 first rewrites the
manifest without them (so no later resume picks them, or a step the resumed run saves again under
the same number before recording it), then their directories are moved aside to
damaged-step-<9 digits> (never loaded, never pruned), for whoever wants to look or restore them.
Manifests written before checksums are read as before (no checksums, no check).
"""
from __future__ import annotations

import io
import json
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable

from sparkdl.storage import files as storage
from sparkdl.errors import CheckpointError, SparkdlError
from sparkdl.executor.checkpoint_fallback import (Skipped, TransientCheckpointError, fallback_fields, fallback_line,
                                                  first_readable, record_without_damaged, set_aside, transient_error)
from sparkdl.executor.checkpoint_verify import FORMAT, PartDigest, StepFields, manifest_error, parse_manifest, verify

if TYPE_CHECKING:
    import torch

MANIFEST = "manifest.json"
__all__ = ["FORMAT", "MANIFEST", "CheckpointStore", "Manifest", "Position", "Resume", "StepRecord", "find_resume"]


@dataclass(frozen=True)
class Position:
    """Where a run stands: the next step to train is step `step` of epoch `epoch`."""

    epoch: int
    step: int
    global_step: int


@dataclass(frozen=True)
class StepRecord:
    """One complete step: the ranks that wrote a part, and those whose part holds strategy state."""

    step: int
    ranks: tuple[int, ...]
    strategy_ranks: tuple[int, ...]
    world_size: int = 0  # the world that wrote it (0: the manifest's, as before elastic runs)
    checksums: tuple[str, ...] = ()  # "sha256:<hex>" of each rank's part, as `ranks` (none before checksums)


@dataclass(frozen=True)
class Manifest:
    """The run's complete steps, oldest first, and the world size that wrote them."""

    world_size: int
    steps: tuple[StepRecord, ...] = field(default_factory=tuple)
    # Entries that cannot be used, each after this many of `steps` (resuming falls back past them).
    damaged: tuple[tuple[int, Skipped], ...] = ()

    @property
    def latest(self) -> StepRecord | None:
        return self.steps[-1] if self.steps else None

    def written_by(self, record: StepRecord) -> int:
        """The world size that wrote `record` (an elastic run's steps may differ)."""
        return record.world_size or self.world_size

    def with_step(self, record: StepRecord, keep: int) -> tuple["Manifest", list[int]]:
        """(the manifest with `record` added and only the last `keep` steps, the steps it drops)."""
        steps = (*self.steps, record)
        return Manifest(self.world_size, steps[-keep:]), [s.step for s in steps[:-keep]]

    def newest_first(self) -> list[StepRecord | Skipped]:
        """The steps to try when resuming, newest first, damaged entries where they stood."""
        order: list[StepRecord | Skipped] = []
        for count in range(len(self.steps), -1, -1):
            order += [skipped for after, skipped in reversed(self.damaged) if after == count]
            if count:
                order.append(self.steps[count - 1])
        return order

    def to_json(self, run_id: str) -> str:
        return json.dumps({"format": FORMAT, "run_id": run_id, "world_size": self.world_size,
                           "steps": [_entry(s, self.written_by(s)) for s in self.steps]}, indent=1)

    @classmethod
    def from_json(cls, text: str, where: str = MANIFEST) -> "Manifest":
        """The manifest in `text`, strictly checked (checkpoint_verify.parse_manifest): a damaged
        top level is a CheckpointError naming `where`, a damaged entry one of `damaged`."""
        try:
            parsed = parse_manifest(text, where)
        except SparkdlError:
            raise
        except Exception as exc:  # noqa: BLE001 - never a bare TypeError: every rank must raise the same error
            raise manifest_error(where, f"{type(exc).__name__}: {exc}") from None
        steps: list[StepRecord] = []
        damaged: list[tuple[int, Skipped]] = []
        for entry in parsed.entries:
            if isinstance(entry, StepFields):
                steps.append(StepRecord(entry.step, entry.ranks, entry.strategy_ranks, entry.world_size,
                                        entry.checksums))
            else:
                damaged.append((len(steps), Skipped(entry.step, entry.reason)))
        return cls(parsed.world_size, tuple(steps), tuple(damaged))


def _entry(record: StepRecord, world_size: int) -> dict[str, Any]:
    entry: dict[str, Any] = {"step": record.step, "ranks": list(record.ranks),
                             "strategy_ranks": list(record.strategy_ranks), "world_size": world_size}
    if record.checksums:
        entry["checksums"] = list(record.checksums)
    return entry


class CheckpointStore:
    """One rank's view of a run's checkpoint files (storage/files.py locations: local, mounts, object stores)."""

    def __init__(self, uri: str, run_id: str, rank: int, keep: int = 2) -> None:
        self.run_id = run_id
        self.root = storage.locate(uri).child(run_id)
        self.rank = rank
        self.keep = max(1, keep)
        self.manifest: Manifest | None = None  # as agreed by find_resume; RunCheckpoints goes on from it
        self.checksums: dict[tuple[int, int], str] = {}  # (step, rank) -> what the agreed manifest recorded

    # -- parts ----------------------------------------------------------------------------------
    def step_dir(self, step: int) -> storage.Location:
        return self.root.child(f"step-{step:09d}")

    def part(self, step: int, rank: int) -> storage.Location:
        return self.step_dir(step).child(f"rank-{rank}.pt")

    def write_part(self, step: int, state: dict[str, Any] | bytes | memoryview,
                   after_piece: Callable[[int], None] | None = None) -> str:
        """This rank's state for `step`, atomically; returns its checksum for the manifest, taken
        piece by piece as the bytes are written. `after_piece(bytes so far)` runs between the
        pieces of the write (the file exists only under its temporary name then): a test seam."""
        import torch

        if isinstance(state, (bytes, bytearray, memoryview)):  # serialised already (checkpoint_async.serialize)
            view, written = memoryview(state), 0
        else:
            buffer = io.BytesIO()
            torch.save(state, buffer)
            view, written = buffer.getbuffer(), 0
        digest = PartDigest()
        with storage.atomic_output(self.part(step, self.rank)) as stream:
            while written < len(view):
                piece = view[written: written + storage.WRITE_PIECE_BYTES]
                stream.write(piece)
                digest.update(piece)
                written += len(piece)
                if after_piece is not None:
                    after_piece(written)
        return digest.value

    def read_part(self, step: int, rank: int) -> dict[str, Any]:
        """A part, its checksum checked when the agreed manifest recorded one (a CheckpointError
        naming the file when it does not match), read with weights_only=True."""
        import torch

        where = self.part(step, rank)
        try:
            data = storage.read_all(where)
        except FileNotFoundError:
            raise  # damage: a part recorded complete is gone
        except OSError as exc:  # the storage did not answer: the part may be good (checkpoint_fallback.py)
            raise transient_error(where.path, exc) from exc
        expected = self.checksums.get((step, rank))
        if expected is not None:
            verify(data, expected, repr(where.path))
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)

    # -- the manifest ---------------------------------------------------------------------------
    def read_manifest_text(self) -> str | None:
        """The manifest's text as stored, or None when the run has none."""
        where = self.root.child(MANIFEST)
        if not storage.exists(where):
            return None
        return storage.read_all(where).decode("utf-8")

    def read_manifest(self) -> Manifest | None:
        text = self.read_manifest_text()
        return None if text is None else Manifest.from_json(text, self.root.child(MANIFEST).path)

    def write_manifest(self, manifest: Manifest) -> None:
        storage.write_atomic(self.root.child(MANIFEST), manifest.to_json(self.run_id).encode("utf-8"))

    # -- deleting -------------------------------------------------------------------------------
    def step_dirs(self) -> list[int]:
        """Steps with a directory, complete or not (on a host-local path: this host's)."""
        names = storage.list_names(self.root)
        return sorted(int(n[5:]) for n in names if n.startswith("step-") and n[5:].isdigit())

    def delete_steps(self, steps: list[int]) -> None:
        """This rank's files of `steps` (temporary ones of a killed write included); rank 0 also
        deletes the directories (all of them on shared storage; on host-local paths each rank's
        directory is its own, removed once empty). Best effort: a leftover is never loaded."""
        own = f"rank-{self.rank}.pt"
        for step in steps:
            directory = self.step_dir(step)
            try:
                for name in storage.list_names(directory):
                    if name == own or name.startswith(own + ".tmp-"):
                        storage.delete_tree(directory.child(name))
                if self.rank == 0:
                    storage.delete_tree(directory)
                else:
                    storage.remove_empty_dir(directory)
            except OSError:
                pass  # another rank removed the directory first (shared storage)


@dataclass(frozen=True)
class Resume:
    """Where a retried attempt picks up: the latest complete checkpoint as this rank saved it.
    Read before the strategy exists (the batch shares the run started with decide how the context
    is built); applied to the strategy once it is set up."""

    position: Position
    progress: dict[str, Any]  # this rank's running sums, rank 0's history, the batch shares
    strategy_state: dict[str, Any]
    rng: "torch.Tensor"  # torch's CPU generator state (torch.get_rng_state())
    written_by: int = 0  # another world size that wrote it (executor/reshape.py); 0: this one
    skipped: tuple[Skipped, ...] = ()  # newer steps no rank could use (checkpoint_fallback.py)

    def apply(self, strategy: Any) -> None:
        import torch

        strategy.load_checkpoint_state(self.strategy_state)
        torch.set_rng_state(self.rng)

    def history_fields(self) -> dict[str, Any]:
        """What the resumed epoch's history record says of a fall-back past damaged steps."""
        return fallback_fields(self.skipped)


def open_store(spec: Any, rank: int) -> CheckpointStore | None:
    """This rank's checkpoint store for the run, or None when the run keeps no checkpoints."""
    train = spec.train
    if not train.checkpoint_dir:
        return None
    return CheckpointStore(train.checkpoint_dir, spec.run_id, rank, train.keep_checkpoints)


def find_resume(store: CheckpointStore, comm: Any, reshape: Callable[..., Resume] | None = None) -> Resume | None:
    """The newest complete checkpoint every rank can read, or None when the run has none (a first
    attempt). A collective (every rank calls it), with one verdict for all ranks: the manifest is
    rank 0's text, parsed alike everywhere; a step some rank finds damaged (checksums checked) sends
    every rank back to the previous one (checkpoint_fallback.first_readable), a read the storage
    refused fails every rank alike (retryable). Damaged steps are moved aside once the manifest no
    longer lists them; other steps the manifest does not keep are deleted (a killed attempt's
    half-written ones). A checkpoint of another world size is refused, unless `reshape`
    (executor/reshape.py, elastic runs) carries it over."""
    manifest = _agreed_manifest(store, comm)
    if manifest is None or not manifest.newest_first():
        store.manifest = Manifest(comm.size)
        store.delete_steps(store.step_dirs())
        return None
    if manifest.latest is not None and manifest.written_by(manifest.latest) != comm.size and reshape is None:
        raise _world_size_error(store, manifest, comm.size)
    store.checksums = {(s.step, rank): c for s in manifest.steps for rank, c in zip(s.ranks, s.checksums)}
    chosen, resume, skipped = first_readable(comm, manifest.newest_first(),
                                             lambda record: _load(store, manifest, record, comm, reshape),
                                             store.root.path)
    # New steps record this world; the earlier ones keep theirs. Steps after the chosen one are dropped.
    kept = tuple(replace(s, world_size=manifest.written_by(s)) for s in manifest.steps if s.step <= chosen.step)
    store.manifest = Manifest(comm.size, kept)
    aside, damaged = _damaged_steps(manifest, skipped, kept), bool(skipped or manifest.damaged)  # alike on all ranks
    if damaged:
        record_without_damaged(store, comm)
        moved = set_aside(store, aside)
        if moved and comm.rank == 0:
            print(f"sparkdl: the unusable checkpoint steps were moved aside, not deleted: {', '.join(moved)}",
                  flush=True)
    store.delete_steps([s for s in store.step_dirs() if s not in {k.step for k in kept} and s not in aside])
    if damaged:  # a rank that trains on (DiLoCo: no collective for a while) must not save into a step being moved
        comm.allgather_object(None)
    if skipped and comm.rank == 0:
        print(fallback_line(skipped, store.root.path, chosen.step), flush=True)
    return replace(resume, skipped=skipped)


def _damaged_steps(manifest: Manifest, skipped: tuple[Skipped, ...], kept: tuple[StepRecord, ...]) -> list[int]:
    """The recorded steps resuming could not use (skipped, or a damaged manifest entry's)."""
    steps = {s.step for s in skipped if s.step is not None} | {s.step for _, s in manifest.damaged if s.step is not None}
    return sorted(steps - {k.step for k in kept})


def _load(store: CheckpointStore, manifest: Manifest, record: StepRecord, comm: Any,
          reshape: Callable[..., Resume] | None) -> Resume:
    """This rank's Resume from `record`'s parts (an exception when any cannot be read)."""
    written_by = manifest.written_by(record)
    if written_by != comm.size:
        if reshape is None:  # an older step of an elastic run's other size
            raise _world_size_error(store, Manifest(manifest.world_size, (record,)), comm.size)
        return reshape(store, record, written_by, comm)
    own = _read(store, record.step, comm.rank)
    training = own.get("strategy")
    if training is None:  # replicated: one rank (rank 0) saved it for everyone
        training = _read(store, record.step, record.strategy_ranks[0])["strategy"]
    epoch, step, global_step = own["position"]
    return Resume(Position(int(epoch), int(step), int(global_step)), dict(own["progress"]), training, own["rng"])


def _read(store: CheckpointStore, step: int, rank: int) -> dict[str, Any]:
    """A part, any failure to read it named with the file."""
    try:
        return store.read_part(step, rank)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch.load's errors do not say which file
        raise CheckpointError(f"{store.part(step, rank).path!r}: {type(exc).__name__}: {exc}") from None


def _agreed_manifest(store: CheckpointStore, comm: Any) -> Manifest | None:
    """Rank 0's manifest, parsed by every rank from the same text (the same Manifest, or the same
    CheckpointError, everywhere: a rank raising alone would leave the others waiting in the next
    collective)."""
    view: tuple[str | None, str | None, bool] = (None, None, False)
    if comm.rank == 0:
        try:
            view = (store.read_manifest_text(), None, False)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            view = (None, f"{type(exc).__name__}: {exc}", isinstance(exc, OSError))
    text, error, transient = comm.allgather_object(view)[0]
    where = store.root.child(MANIFEST).path
    if error is not None and transient:  # the storage did not answer: the attempt is worth retrying
        raise TransientCheckpointError(f"cannot read the checkpoint manifest {where!r}: {error}")
    if error is not None:
        raise CheckpointError(f"cannot read the checkpoint manifest {where!r}: {error}",
                              hint="check that checkpoint_dir is readable from every executor")
    return Manifest.from_json(text, where) if text is not None else None


def _world_size_error(store: CheckpointStore, manifest: Manifest, world_size: int) -> CheckpointError:
    latest = manifest.latest
    written_by = manifest.written_by(latest) if latest is not None else manifest.world_size
    replicated = latest is not None and tuple(latest.strategy_ranks) == (0,)
    readable = (f"its strategy state is rank 0's alone (replicated), readable at any world size with "
                f"CheckpointStore(dir, {store.run_id!r}, 0).read_part({latest.step}, 0)['strategy']"
                if replicated and latest else "its strategy state is per rank and needs that world size")
    return CheckpointError(
        f"the checkpoints under {store.root.path!r} were written by {written_by} ranks, this attempt "
        f"has {world_size}: {readable}; resuming needs the same world size (positions, running sums and "
        f"RNG states are per rank)",
        hint=f"resume with num_workers={written_by}, or let the run change size (launch.min_workers / max_workers), "
             "or start a fresh run (another checkpoint_dir)")
