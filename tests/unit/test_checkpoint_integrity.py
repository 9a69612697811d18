"""Damaged checkpoints (issue 44): real parts and manifests written by the real code (RunCheckpoints
on ranks simulated by threads), then damaged on disk and read back by find_resume. Checksums are in
the manifest; a truncated, bit-flipped or missing part of the latest step, or a damaged entry, sends
every rank back to the previous complete step together; a manifest with bad types is the same clear
CheckpointError on every rank; nothing readable is a clear error naming the directory. A read the
storage refuses (an OSError other than a missing file) is no damage: every rank raises the same
retryable error and every step stays where it is."""
from __future__ import annotations

import hashlib
import json
import struct
import threading
from pathlib import Path
from typing import Any, Callable

import fsspec
import pytest
import torch
from pyarrow.fs import FSSpecHandler, PyFileSystem

from sparkdl.comm.object_codec import decode_object, encode_object
from sparkdl.driver.attempts import retryable
from sparkdl.errors import CheckpointError
from sparkdl.executor.checkpoint import CheckpointStore, Manifest, Position, Resume, StepRecord, find_resume
from sparkdl.executor.checkpoint_async import RunCheckpoints
from sparkdl.executor.checkpoint_fallback import TransientCheckpointError
from sparkdl.executor.failures import report_error
from sparkdl.storage.files import Location
from sparkdl.executor.checkpoint_report import fallback_report


class ThreadComm:
    """allgather_object between threads, in call order, as a real collective; what crosses goes
    through the ranks' real typed encoding (comm/object_codec.py: no pickle between ranks)."""

    def __init__(self, rank: int, size: int, shared: dict[str, Any]) -> None:
        self.rank, self.size, self._shared = rank, size, shared
        self.gathers = 0

    def allgather_object(self, obj: Any) -> list[Any]:
        slots, barrier = self._shared["slots"], self._shared["barrier"]
        slots[self.rank] = encode_object(obj)
        barrier.wait(timeout=20)  # a rank that raised alone leaves the other here: BrokenBarrierError
        gathered = [decode_object(sent) for sent in slots]
        barrier.wait(timeout=20)
        self.gathers += 1
        return gathered


def run_ranks(size: int, body: Callable[[int, ThreadComm], Any]) -> list[Any]:
    """body(rank, comm) on `size` threads: each rank's result or the exception it raised."""
    shared = {"slots": [None] * size, "barrier": threading.Barrier(size)}
    results: list[Any] = [None] * size

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank, ThreadComm(rank, size, shared))
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


class Weights:
    """A strategy whose weight tensor is the step it was saved at."""

    def __init__(self, replicated: bool) -> None:
        self.replicated_state = replicated
        self.weight = torch.zeros(4)

    def checkpoint_state(self) -> dict[str, Any]:
        return {"module": {"w": self.weight}}

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        self.weight = state["module"]["w"]


def save_steps(roots: Callable[[int], Path], steps: list[int], replicated: bool = True, keep: int = 3) -> None:
    """Two ranks that save at `steps` through the real writer and agreement, then finish."""
    def body(rank: int, comm: ThreadComm) -> None:
        store = CheckpointStore(str(roots(rank)), "run", rank, keep)
        find_resume(store, comm)
        strategy = Weights(replicated)
        checkpoints = RunCheckpoints(store, comm, strategy, every=3)
        for step in steps:
            strategy.weight.fill_(float(step))
            checkpoints.save(Position(0, step, step), {"loss_sum": float(step), "history": [{"epoch": 0}]})
        checkpoints.finish()
    results = run_ranks(2, body)
    assert results == [None, None], results


def resume_all(roots: Callable[[int], Path], keep: int = 3) -> list[Any]:
    return run_ranks(2, lambda rank, comm: find_resume(CheckpointStore(str(roots(rank)), "run", rank, keep), comm))


def part(root: Path, step: int, rank: int) -> Path:
    return root / "run" / f"step-{step:09d}" / f"rank-{rank}.pt"


def flip_a_weight_bit(path: Path, step: int) -> None:
    """One bit of the saved weight tensor's bytes: torch.load still reads the file, with another value."""
    data = bytearray(path.read_bytes())
    at = data.find(struct.pack("<f", float(step)) * 4)
    assert at > 0
    data[at + 1] ^= 0x10
    path.write_bytes(bytes(data))
    loaded = torch.load(path, weights_only=True)["strategy"]["module"]["w"]
    assert not torch.equal(loaded, torch.full((4,), float(step)))


def assert_fell_back(results: list[Any], to: int, skipped: int, says: str) -> None:
    for rank, resume in enumerate(results):
        assert isinstance(resume, Resume), results
        assert resume.position.global_step == to
        assert torch.equal(resume.strategy_state["module"]["w"], torch.full((4,), float(to))), rank
        fields = resume.history_fields()
        assert fields["checkpoint_fallback_from_step"] == skipped and says in fields["checkpoint_fallback"], fields
    assert results[0].history_fields() == results[1].history_fields()  # one verdict


# -- checksums ---------------------------------------------------------------------------------------
def test_the_manifest_records_each_parts_checksum_as_written(tmp_path: Path) -> None:
    save_steps(lambda r: tmp_path, [3, 6])
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    for entry in manifest["steps"]:
        assert entry["checksums"] == ["sha256:" + hashlib.sha256(part(tmp_path, entry["step"], r).read_bytes())
                                      .hexdigest() for r in (0, 1)]
    parsed = CheckpointStore(str(tmp_path), "run", 0).read_manifest()
    assert parsed is not None and Manifest.from_json(parsed.to_json("run")) == parsed  # round trip
    assert parsed.steps[1].checksums == tuple(manifest["steps"][1]["checksums"])


def test_write_part_returns_the_checksum_of_what_it_wrote(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), "run", 1)
    written = store.write_part(5, {"w": torch.arange(3.0)})
    assert written == "sha256:" + hashlib.sha256(part(tmp_path, 5, 1).read_bytes()).hexdigest()


def test_a_manifest_without_checksums_is_read_as_before(tmp_path: Path) -> None:
    save_steps(lambda r: tmp_path, [3, 6])
    where = tmp_path / "run" / "manifest.json"
    old = json.loads(where.read_text())
    for entry in old["steps"]:
        del entry["checksums"]  # as written before checksums
    where.write_text(json.dumps(old))
    results = resume_all(lambda r: tmp_path)
    assert [r.position.global_step for r in results] == [6, 6] and results[0].history_fields() == {}


# -- a damaged latest step: every rank falls back together -----------------------------------------
def test_a_truncated_latest_part_resumes_every_rank_from_the_previous_step(tmp_path: Path) -> None:
    save_steps(lambda r: tmp_path, [3, 6, 9])
    latest = part(tmp_path, 9, 1)
    latest.write_bytes(latest.read_bytes()[: latest.stat().st_size // 2])
    results = resume_all(lambda r: tmp_path)
    assert_fell_back(results, to=6, skipped=9, says="rank-1.pt' does not match its checksum")
    assert "rank 1: " in results[0].history_fields()["checkpoint_fallback"]  # only rank 1 reads its own part
    # Moved aside, not deleted, and no longer recorded: never loaded again, the run saves step 9 anew.
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["damaged-step-000000009", "manifest.json",
                                                                   "step-000000003", "step-000000006"]
    assert (tmp_path / "run" / "damaged-step-000000009" / "rank-0.pt").stat().st_size > 0
    assert [s["step"] for s in json.loads((tmp_path / "run" / "manifest.json").read_text())["steps"]] == [3, 6]


def test_a_bit_flipped_latest_part_is_found_by_its_checksum(tmp_path: Path) -> None:
    save_steps(lambda r: tmp_path, [3, 6, 9])
    flip_a_weight_bit(part(tmp_path, 9, 0), 9)  # rank 0's: the replicated state every rank reads
    results = resume_all(lambda r: tmp_path)
    assert_fell_back(results, to=6, skipped=9, says="rank-0.pt' does not match its checksum")
    reason = results[0].history_fields()["checkpoint_fallback"]
    assert "rank 0: " in reason and "rank 1: " in reason


def test_a_missing_latest_part_resumes_from_the_previous_step(tmp_path: Path) -> None:
    save_steps(lambda r: tmp_path, [3, 6, 9])
    part(tmp_path, 9, 1).unlink()
    assert_fell_back(resume_all(lambda r: tmp_path), to=6, skipped=9, says="FileNotFoundError")


def test_one_host_local_rank_that_cannot_read_its_part_sends_every_rank_back(tmp_path: Path) -> None:
    roots = {0: tmp_path / "host0", 1: tmp_path / "host1"}  # each rank sees only its own disk
    save_steps(lambda r: roots[r], [3, 6], replicated=False)
    flip_a_weight_bit(part(roots[1], 6, 1), 6)
    results = resume_all(lambda r: roots[r])
    assert_fell_back(results, to=3, skipped=6, says="rank 1: ")
    assert "rank 0: " not in results[0].history_fields()["checkpoint_fallback"]  # rank 0 read its own step 6
    for root in roots.values():  # each host's directory of the step is moved aside on that host
        assert not (root / "run" / "step-000000006").exists()
        assert (root / "run" / "damaged-step-000000006").is_dir()


def test_a_damaged_latest_entry_falls_back_past_it(tmp_path: Path) -> None:
    save_steps(lambda r: tmp_path, [3, 6, 9])
    where = tmp_path / "run" / "manifest.json"
    manifest = json.loads(where.read_text())
    manifest["steps"][-1]["ranks"] = "01"  # a type the old reader turned into ('0', '1')
    where.write_text(json.dumps(manifest))
    results = resume_all(lambda r: tmp_path)
    assert_fell_back(results, to=6, skipped=9, says="'ranks' must be a non-empty list of whole numbers")


def test_the_fallback_is_reported_to_the_driver_from_the_history_record() -> None:
    record = {"epoch": 1, "resumed_from_step": 6, "checkpoint_fallback_from_step": 9,
              "checkpoint_fallback": "step 9: rank 1: 'x/rank-1.pt' does not match its checksum"}
    report = fallback_report(record)
    assert report is not None and "resumed from the checkpoint of step 6, not the newest (step 9)" in report.line
    assert report.tags["checkpoint_fallback_from_step"] == "9" and report.tags["checkpoint_fallback_to_step"] == "6"
    assert report.artifact == "checkpoint_fallback_step_6.txt"
    assert fallback_report({"epoch": 1, "resumed_from_step": 6}) is None


# -- nothing usable: one clear error on every rank ---------------------------------------------------
def test_no_readable_step_is_one_clear_error_naming_the_directory(tmp_path: Path) -> None:
    save_steps(lambda r: tmp_path, [3, 6], keep=2)
    part(tmp_path, 6, 1).write_bytes(b"")
    flip_a_weight_bit(part(tmp_path, 3, 0), 3)
    results = resume_all(lambda r: tmp_path, keep=2)
    messages = {str(r) for r in results}
    assert all(isinstance(r, CheckpointError) for r in results) and len(messages) == 1, results
    message = messages.pop()
    assert f"no complete checkpoint under {str(tmp_path / 'run')!r} can be read" in message
    assert "step 6: rank 1: " in message and "step 3: rank 0: " in message and "HINT" in message
    assert (tmp_path / "run" / "step-000000006").exists() and (tmp_path / "run" / "step-000000003").exists()


BAD_MANIFESTS = {
    "step null": ('{"format": 1, "world_size": 2, "steps": [{"step": null, "ranks": [0, 1], "strategy_ranks": [0]}]}',
                  "no complete checkpoint"),
    "world_size a string": ('{"format": 1, "world_size": "two", "steps": []}', "'world_size' must be a whole number"),
    "world_size null": ('{"format": 1, "world_size": null, "steps": []}', "'world_size' must be a whole number"),
    "steps an object": ('{"format": 1, "world_size": 2, "steps": {"step": 3}}', "'steps' must be a list"),
    "a list": ('[1, 2]', "holds a list, not a JSON object"),
    "format a list": ('{"format": [1], "world_size": 2, "steps": []}', "'format' must be a whole number"),
    "not JSON": ('{"format": 1, "world_si', "not valid JSON"),
    "checksum not hex": ('{"format": 1, "world_size": 2, "steps": [{"step": 3, "ranks": [0, 1], "strategy_ranks": [0],'
                         ' "checksums": ["md5:1", "md5:2"]}]}', "'checksums' must be a list of 'sha256:"),
}


@pytest.mark.parametrize("name", list(BAD_MANIFESTS))
def test_a_manifest_with_bad_types_is_the_same_clear_error_on_every_rank(tmp_path: Path, name: str) -> None:
    text, says = BAD_MANIFESTS[name]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "manifest.json").write_text(text)
    results = resume_all(lambda r: tmp_path)
    assert all(isinstance(r, CheckpointError) for r in results), results  # no TypeError, no broken barrier
    assert len({str(r) for r in results}) == 1 and says in str(results[1])
    assert str(tmp_path / "run") in str(results[0])


def test_a_single_rank_falls_back_from_a_step_whose_checksum_does_not_match(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), "run", 0)
    good = store.write_part(1, {"position": [0, 1, 1], "progress": {}, "rng": torch.get_rng_state(),
                                "strategy": {"module": {"w": torch.ones(4)}}})
    store.write_part(2, {"position": [0, 2, 2], "progress": {}, "rng": torch.get_rng_state(),
                         "strategy": {"module": {"w": torch.ones(4)}}})
    wrong = "sha256:" + "0" * 64
    store.write_manifest(Manifest(1, (StepRecord(1, (0,), (0,), 1, (good,)), StepRecord(2, (0,), (0,), 1, (wrong,)))))
    (found,) = run_ranks(1, lambda rank, comm: find_resume(CheckpointStore(str(tmp_path), "run", 0), comm))
    assert found.position.global_step == 1 and found.history_fields()["checkpoint_fallback_from_step"] == 2


# -- a read the storage refuses is no damage: every rank raises, nothing is skipped or moved ---------
class RefusingReads(FSSpecHandler):
    """fsspec's local filesystem behind pyarrow's PyFileSystem (an object store's code paths in
    storage/files.py: not this host's LocalFileSystem), whose reads of `refused` paths fail as an
    S3 or NFS read that timed out does."""

    def __init__(self, refused: set[str]) -> None:
        super().__init__(fsspec.filesystem("file"))
        self.refused = refused

    def open_input_stream(self, path: str) -> Any:
        if path in self.refused:
            raise TimeoutError(110, f"read of {path} timed out (test)")
        return super().open_input_stream(path)


class RemoteStore(CheckpointStore):
    """The real store, its files reached through RefusingReads."""

    def __init__(self, root: Path, rank: int, refused: set[str]) -> None:
        super().__init__(str(root), "run", rank, keep=3)
        self.root = Location(PyFileSystem(RefusingReads(refused)), self.root.path, local=False)


def snapshot_tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def assert_one_retryable_error(results: list[Any], *says: str) -> None:
    assert all(isinstance(r, TransientCheckpointError) for r in results), results  # no hang, no fall-back
    assert len({str(r) for r in results}) == 1, results
    assert all(r.retryable is True for r in results)
    for text in (*says, "no step was skipped or deleted", "sparkdl retries the attempt"):
        assert text in str(results[0]), str(results[0])


def test_a_part_that_is_a_directory_fails_every_rank_alike_and_keeps_every_step(tmp_path: Path) -> None:
    save_steps(lambda r: tmp_path, [3, 6, 9])
    latest = part(tmp_path, 9, 1)
    kept_bytes = latest.read_bytes()
    latest.unlink()
    latest.mkdir()  # pyarrow: a plain OSError ("is a directory"), as for an unreadable file
    before = snapshot_tree(tmp_path)
    results = resume_all(lambda r: tmp_path)
    assert_one_retryable_error(results, "cannot read the checkpoint of step 9", "rank 1: ", "OSError",
                               "rank-1.pt")
    assert snapshot_tree(tmp_path) == before and latest.is_dir()  # nothing deleted, moved or rewritten
    latest.rmdir()
    latest.write_bytes(kept_bytes)  # the storage answers again: the retried attempt resumes the newest step
    results = resume_all(lambda r: tmp_path)
    assert [r.position.global_step for r in results] == [9, 9] and results[0].history_fields() == {}


def test_a_read_that_times_out_on_one_rank_fails_every_rank_alike_and_keeps_the_step(tmp_path: Path) -> None:
    save_steps(lambda r: tmp_path, [3, 6, 9])
    before = snapshot_tree(tmp_path)
    refused = {str(part(tmp_path, 9, 1))}
    results = run_ranks(2, lambda rank, comm: find_resume(RemoteStore(tmp_path, rank, refused), comm))
    assert_one_retryable_error(results, "rank 1: cannot read", "rank-1.pt': TimeoutError", "timed out (test)")
    assert "rank 0: " not in str(results[0])
    assert snapshot_tree(tmp_path) == before
    results = run_ranks(2, lambda rank, comm: find_resume(RemoteStore(tmp_path, rank, set()), comm))
    assert [r.position.global_step for r in results] == [9, 9]


def test_a_manifest_read_that_times_out_is_the_same_retryable_error_on_every_rank(tmp_path: Path) -> None:
    save_steps(lambda r: tmp_path, [3, 6])
    refused = {str(tmp_path / "run" / "manifest.json")}
    results = run_ranks(2, lambda rank, comm: find_resume(RemoteStore(tmp_path, rank, refused), comm))
    assert all(isinstance(r, TransientCheckpointError) for r in results) and len({str(r) for r in results}) == 1
    assert all(getattr(r, "retryable", False) is True for r in results)  # the driver tries another attempt
    assert "cannot read the checkpoint manifest" in str(results[1]) and "TimeoutError" in str(results[1])
    assert (tmp_path / "run" / "step-000000006" / "rank-1.pt").is_file()


def test_the_driver_retries_an_attempt_whose_ranks_raised_a_retryable_error() -> None:
    class Recorder:
        def __init__(self) -> None:
            self.sent: list[dict[str, Any]] = []

        def send_now(self, kind: str, **fields: Any) -> bool:
            self.sent.append({"kind": kind, **fields})
            return True

    client = Recorder()
    report_error(client, TransientCheckpointError("cannot read 'x/rank-1.pt': TimeoutError: read timed out"))
    report_error(client, CheckpointError("no complete checkpoint can be read"))
    assert [m["retryable"] for m in client.sent] == [True, False]
    assert retryable({0: client.sent[0], 1: client.sent[0]})  # "timed out" in its text notwithstanding
    assert not retryable({0: client.sent[1], 1: client.sent[0]})


# -- damaged steps are moved aside, never deleted, never loaded again ---------------------------------
def test_damaged_steps_on_an_object_store_are_moved_aside_and_a_later_resume_skips_nothing(tmp_path: Path) -> None:
    save_steps(lambda r: tmp_path, [3, 6, 9])
    latest = part(tmp_path, 9, 0)
    latest.write_bytes(latest.read_bytes()[:50])
    results = run_ranks(2, lambda rank, comm: find_resume(RemoteStore(tmp_path, rank, set()), comm))
    assert_fell_back(results, to=6, skipped=9, says="rank-0.pt' does not match its checksum")
    aside = tmp_path / "run" / "damaged-step-000000009"
    assert sorted(p.name for p in aside.iterdir()) == ["rank-0.pt", "rank-1.pt"]  # moved object by object
    assert not (tmp_path / "run" / "step-000000009").exists()
    results = run_ranks(2, lambda rank, comm: find_resume(RemoteStore(tmp_path, rank, set()), comm))
    assert [r.position.global_step for r in results] == [6, 6] and results[0].history_fields() == {}
    assert aside.is_dir()  # a later resume neither loads nor prunes it


def test_a_step_skipped_again_is_moved_aside_under_another_name(tmp_path: Path) -> None:
    save_steps(lambda r: tmp_path, [3, 6, 9])
    (tmp_path / "run" / "damaged-step-000000009").mkdir()  # an earlier attempt's
    part(tmp_path, 9, 1).write_bytes(b"")
    assert_fell_back(resume_all(lambda r: tmp_path), to=6, skipped=9, says="rank 1: ")
    assert sorted(p.name for p in (tmp_path / "run" / "damaged-step-000000009.2").iterdir()) == ["rank-0.pt",
                                                                                                "rank-1.pt"]
