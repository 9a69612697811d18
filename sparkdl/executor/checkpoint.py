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
"""
from __future__ import annotations

import io
import json
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable

from sparkdl.storage import files as storage
from sparkdl.errors import CheckpointError

if TYPE_CHECKING:
    import torch

MANIFEST = "manifest.json"
FORMAT = 1  # the manifest's format version


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


@dataclass(frozen=True)
class Manifest:
    """The run's complete steps, oldest first, and the world size that wrote them."""

    world_size: int
    steps: tuple[StepRecord, ...] = field(default_factory=tuple)

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

    def to_json(self, run_id: str) -> str:
        return json.dumps({"format": FORMAT, "run_id": run_id, "world_size": self.world_size,
                           "steps": [{"step": s.step, "ranks": list(s.ranks), "strategy_ranks": list(s.strategy_ranks),
                                      "world_size": self.written_by(s)} for s in self.steps]}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        data = json.loads(text)
        if int(data.get("format", 0)) > FORMAT:
            raise CheckpointError(f"checkpoint manifest format {data.get('format')} is newer than this sparkdl reads "
                                  f"({FORMAT})", hint="resume with the sparkdl version that wrote the checkpoints")
        return cls(int(data["world_size"]), tuple(
            StepRecord(int(s["step"]), tuple(s["ranks"]), tuple(s["strategy_ranks"]), int(s.get("world_size", 0)))
            for s in data["steps"]))


class CheckpointStore:
    """One rank's view of a run's checkpoint files (storage/files.py locations: local, mounts, object stores)."""

    def __init__(self, uri: str, run_id: str, rank: int, keep: int = 2) -> None:
        self.run_id = run_id
        self.root = storage.locate(uri).child(run_id)
        self.rank = rank
        self.keep = max(1, keep)
        self.manifest: Manifest | None = None  # as agreed by find_resume; RunCheckpoints goes on from it

    # -- parts ----------------------------------------------------------------------------------
    def step_dir(self, step: int) -> storage.Location:
        return self.root.child(f"step-{step:09d}")

    def part(self, step: int, rank: int) -> storage.Location:
        return self.step_dir(step).child(f"rank-{rank}.pt")

    def write_part(self, step: int, state: dict[str, Any] | bytes | memoryview,
                   after_piece: Callable[[int], None] | None = None) -> None:
        """This rank's state for `step`, atomically. `after_piece(bytes so far)` runs between the
        pieces of the write (the file exists only under its temporary name then): a test seam."""
        import torch

        if isinstance(state, (bytes, bytearray, memoryview)):  # serialised already (checkpoint_async.serialize)
            view, written = memoryview(state), 0
        else:
            buffer = io.BytesIO()
            torch.save(state, buffer)
            view, written = buffer.getbuffer(), 0
        with storage.atomic_output(self.part(step, self.rank)) as stream:
            while written < len(view):
                piece = view[written: written + storage.WRITE_PIECE_BYTES]
                stream.write(piece)
                written += len(piece)
                if after_piece is not None:
                    after_piece(written)

    def read_part(self, step: int, rank: int) -> dict[str, Any]:
        import torch

        return torch.load(io.BytesIO(storage.read_all(self.part(step, rank))), map_location="cpu", weights_only=True)

    # -- the manifest ---------------------------------------------------------------------------
    def read_manifest(self) -> Manifest | None:
        where = self.root.child(MANIFEST)
        if not storage.exists(where):
            return None
        return Manifest.from_json(storage.read_all(where).decode("utf-8"))

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

    def apply(self, strategy: Any) -> None:
        import torch

        strategy.load_checkpoint_state(self.strategy_state)
        torch.set_rng_state(self.rng)


def open_store(spec: Any, rank: int) -> CheckpointStore | None:
    """This rank's checkpoint store for the run, or None when the run keeps no checkpoints."""
    train = spec.train
    if not train.checkpoint_dir:
        return None
    return CheckpointStore(train.checkpoint_dir, spec.run_id, rank, train.keep_checkpoints)


def find_resume(store: CheckpointStore, comm: Any, reshape: Callable[..., Resume] | None = None) -> Resume | None:
    """The latest complete checkpoint, or None when the run has none (a first attempt). One verdict
    for all ranks, from rank 0's reading of the manifest (a collective: every rank calls it); steps
    the manifest does not list are deleted (a killed attempt's half-written ones). A checkpoint of
    another world size is refused, unless `reshape` (executor/reshape.py, elastic runs) carries it over."""
    manifest = _agreed_manifest(store, comm)
    written_by = manifest.written_by(manifest.latest) if manifest is not None and manifest.latest else comm.size
    if written_by != comm.size and reshape is None:
        raise _world_size_error(store, manifest, comm.size)
    # New steps record this world; the earlier ones keep theirs.
    store.manifest = Manifest(comm.size, tuple(replace(s, world_size=manifest.written_by(s)) for s in manifest.steps)) \
        if manifest is not None and manifest.steps else Manifest(comm.size)
    recorded = {s.step for s in store.manifest.steps}
    store.delete_steps([s for s in store.step_dirs() if s not in recorded])
    latest = store.manifest.latest
    if latest is None:
        return None
    if written_by != comm.size:
        return reshape(store, latest, written_by, comm)
    own = store.read_part(latest.step, comm.rank)
    training = own.get("strategy")
    if training is None:  # replicated: one rank (rank 0) saved it for everyone
        training = store.read_part(latest.step, latest.strategy_ranks[0])["strategy"]
    epoch, step, global_step = own["position"]
    return Resume(Position(int(epoch), int(step), int(global_step)), dict(own["progress"]), training, own["rng"])


def _agreed_manifest(store: CheckpointStore, comm: Any) -> Manifest | None:
    """Rank 0's manifest, or the same CheckpointError on every rank when it cannot be read (a rank
    raising alone would leave the others waiting in the next collective)."""
    view: tuple[str | None, str | None] = (None, None)
    if comm.rank == 0:
        try:
            manifest = store.read_manifest()
            view = (manifest.to_json(store.run_id) if manifest else None, None)
        except (OSError, ValueError, KeyError, CheckpointError) as exc:
            view = (None, f"{type(exc).__name__}: {exc}")
    text, error = comm.allgather_object(view)[0]
    if error is not None:
        raise CheckpointError(f"cannot read the checkpoint manifest under {store.root.path!r}: {error}",
                              hint="check that checkpoint_dir is readable from every executor")
    return Manifest.from_json(text) if text else None


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
