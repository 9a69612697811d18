"""The checkpoint protocol without Spark: ranks simulated by threads sharing a tiny fake communicator
(rank, size, allgather_object). A step counts once every rank's write succeeded and rank 0 recorded it
in the manifest; pruning follows the manifest on every rank (host-local directories included); resume
reads only recorded steps, deletes the rest, and refuses another world size."""
from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from sparkdl.errors import CheckpointError
from sparkdl.executor import checkpoint_async
from sparkdl.executor.checkpoint import CheckpointStore, Position, find_resume
from sparkdl.executor.checkpoint_async import RunCheckpoints, snapshot


class FakeComm:
    """allgather_object between threads, in call order (as a real collective)."""

    def __init__(self, rank: int, size: int, shared: dict[str, Any]) -> None:
        self.rank, self.size, self._shared = rank, size, shared

    def allgather_object(self, obj: Any) -> list[Any]:
        slots, barrier = self._shared["slots"], self._shared["barrier"]
        slots[self.rank] = obj
        barrier.wait(timeout=30)
        gathered = list(slots)
        barrier.wait(timeout=30)  # nobody overwrites a slot before every rank has read it
        return gathered


class FakeStrategy:
    def __init__(self, replicated: bool, rank: int) -> None:
        self.replicated_state = replicated
        self.weight = torch.full((4,), float(rank))
        self.optimizer = {"state": {0: {"momentum": torch.zeros(4)}}, "param_groups": [{"lr": 0.1}]}

    def checkpoint_state(self) -> dict[str, Any]:
        return {"module": {"w": self.weight}, "optimizer": self.optimizer}  # live tensors, as strategies return

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        self.weight = state["module"]["w"]


def run_ranks(size: int, body: Callable[[int, FakeComm], Any]) -> list[Any]:
    """body(rank, comm) on `size` threads; their results, or the first exception raised."""
    shared = {"slots": [None] * size, "barrier": threading.Barrier(size)}
    results: list[Any] = [None] * size

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank, FakeComm(rank, size, shared))
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            results[rank] = exc  # a peer left waiting fails by the barrier's timeout

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def train_and_save(root: Callable[[int], str], steps: list[int], replicated: bool = True, keep: int = 2,
                   seen: dict[int, list[int]] | None = None) -> Callable[[int, FakeComm], Any]:
    """A rank that saves at `steps` (weights = the step, changed in place after each save) and finishes;
    `seen[rank]` collects the manifest's steps right after each save."""
    def body(rank: int, comm: FakeComm) -> Any:
        store = CheckpointStore(root(rank), "run", rank, keep)
        find_resume(store, comm)
        strategy = FakeStrategy(replicated, rank)
        checkpoints = RunCheckpoints(store, comm, strategy, every=3)
        for step in steps:
            strategy.weight.fill_(float(step))
            checkpoints.save(Position(0, step, step), {"loss_sum": float(step), "history": []})
            strategy.weight.fill_(-1.0)  # training goes on mutating the live tensor
            if seen is not None and rank == 0:
                seen.setdefault(rank, []).append([s.step for s in checkpoints._manifest.steps])
        checkpoints.finish()
        return checkpoints.timings
    return body


def manifest_steps(run_dir: Path) -> list[int]:
    return [s["step"] for s in json.loads((run_dir / "manifest.json").read_text())["steps"]]


def test_a_step_is_recorded_at_the_next_save_once_every_rank_wrote_it(tmp_path: Path) -> None:
    seen: dict[int, list[int]] = {}
    results = run_ranks(2, train_and_save(lambda r: str(tmp_path), [3, 6, 9, 12], seen=seen))
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert seen[0] == [[], [3], [3, 6], [6, 9]]  # step N is recorded at the save after it
    run_dir = tmp_path / "run"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["format"] == 1
    checksums = [step.pop("checksums") for step in manifest["steps"]]  # each part's, as written
    assert manifest["steps"] == [{"step": 9, "ranks": [0, 1], "strategy_ranks": [0], "world_size": 2},
                                 {"step": 12, "ranks": [0, 1], "strategy_ranks": [0], "world_size": 2}]
    assert checksums == [["sha256:" + hashlib.sha256((run_dir / f"step-{step:09d}" / f"rank-{r}.pt").read_bytes())
                          .hexdigest() for r in (0, 1)] for step in (9, 12)]
    # pruned consistently: only the kept steps' directories, each with both ranks' parts
    assert sorted(p.name for p in run_dir.iterdir()) == ["manifest.json", "step-000000009", "step-000000012"]
    assert sorted(p.name for p in (run_dir / "step-000000012").iterdir()) == ["rank-0.pt", "rank-1.pt"]


def test_a_save_copies_the_state_and_writes_in_the_background(tmp_path: Path) -> None:
    release, writing = threading.Event(), threading.Event()

    def hold(step: int, written: int) -> None:  # the write is paused mid-file until the test lets it go
        writing.set()
        assert release.wait(30)

    checkpoint_async.WRITE_HOOK = hold
    try:
        store = CheckpointStore(str(tmp_path), "run", 0)
        comm = FakeComm(0, 1, {"slots": [None], "barrier": threading.Barrier(1)})
        find_resume(store, comm)
        strategy = FakeStrategy(False, 0)
        strategy.weight.fill_(7.0)
        checkpoints = RunCheckpoints(store, comm, strategy, every=1)
        checkpoints.save(Position(0, 1, 1), {"history": [{"epoch": 0}]})  # returns with the write held
        assert writing.wait(30) and list((tmp_path / "run" / "step-000000001").glob("rank-0.pt.tmp-*"))
        strategy.weight.fill_(-1.0)
        strategy.optimizer["state"][0]["momentum"].fill_(5.0)
        release.set()
        checkpoints.finish()
    finally:
        checkpoint_async.WRITE_HOOK = None
        release.set()
    part = store.read_part(1, 0)
    assert torch.equal(part["strategy"]["module"]["w"], torch.full((4,), 7.0))
    assert torch.equal(part["strategy"]["optimizer"]["state"][0]["momentum"], torch.zeros(4))
    assert manifest_steps(tmp_path / "run") == [1]


def test_snapshot_copies_nested_state() -> None:
    live = {"a": [torch.ones(2), {"b": torch.zeros(1)}], "n": 3, "h": [{"loss": 1.0}]}
    copied = snapshot(live)
    live["a"][0].add_(1)
    live["a"][1]["b"].add_(1)
    live["h"].append({"loss": 2.0})
    assert torch.equal(copied["a"][0], torch.ones(2)) and torch.equal(copied["a"][1]["b"], torch.zeros(1))
    assert copied["h"] == [{"loss": 1.0}] and copied["n"] == 3


def test_a_failed_write_on_one_rank_fails_every_rank_and_is_never_recorded(tmp_path: Path) -> None:
    def body(rank: int, comm: FakeComm) -> Any:
        store = CheckpointStore(str(tmp_path), "run", rank)
        find_resume(store, comm)
        if rank == 1:
            original = store.write_part

            def flaky(step: int, state: dict[str, Any], after_piece: Any = None) -> None:
                if step == 6:
                    raise OSError("No space left on device")
                original(step, state, after_piece)
            store.write_part = flaky  # type: ignore[method-assign]
        checkpoints = RunCheckpoints(store, comm, FakeStrategy(True, rank), every=3)
        for step in (3, 6, 9):
            checkpoints.save(Position(0, step, step), {})
        checkpoints.finish()

    results = run_ranks(2, body)
    for result in results:  # the same verdict on both ranks, at the save after the failed write
        assert isinstance(result, CheckpointError) and "rank 1's part of step 6" in str(result), results
        assert "No space left" in str(result) and "HINT" in str(result)
    assert manifest_steps(tmp_path / "run") == [3]


def test_host_local_directories_are_pruned_by_their_own_rank(tmp_path: Path) -> None:
    roots = {0: tmp_path / "host0", 1: tmp_path / "host1"}  # each rank sees only its own disk
    results = run_ranks(2, train_and_save(lambda r: str(roots[r]), [3, 6, 9], replicated=False, keep=1))
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert sorted(p.name for p in (roots[0] / "run").iterdir()) == ["manifest.json", "step-000000009"]
    assert sorted(p.name for p in (roots[1] / "run").iterdir()) == ["step-000000009"]
    assert [p.name for p in (roots[1] / "run" / "step-000000009").iterdir()] == ["rank-1.pt"]

    def resume(rank: int, comm: FakeComm) -> Any:
        found = find_resume(CheckpointStore(str(roots[rank]), "run", rank, 1), comm)
        return found.position, found.strategy_state["module"]["w"]
    results = run_ranks(2, resume)
    assert [(pos.global_step, float(w[0])) for pos, w in results] == [(9, 9.0), (9, 9.0)]


def test_resume_loads_only_recorded_steps_and_deletes_the_rest(tmp_path: Path) -> None:
    results = run_ranks(2, train_and_save(lambda r: str(tmp_path), [3, 6]))
    assert not [r for r in results if isinstance(r, BaseException)]
    run_dir = tmp_path / "run"
    # a killed attempt's leftovers: a part of step 9 on rank 0, half a file on rank 1
    (run_dir / "step-000000009").mkdir()
    (run_dir / "step-000000009" / "rank-0.pt").write_bytes((run_dir / "step-000000006" / "rank-0.pt").read_bytes())
    (run_dir / "step-000000009" / "rank-1.pt.tmp-dead").write_bytes(b"half a file")
    results = run_ranks(2, lambda rank, comm: find_resume(CheckpointStore(str(tmp_path), "run", rank), comm))
    assert [r.position.global_step for r in results] == [6, 6]
    assert torch.equal(results[1].strategy_state["module"]["w"], torch.full((4,), 6.0))  # rank 0's, replicated
    assert not (run_dir / "step-000000009").exists()


def test_a_resume_at_another_world_size_is_a_clear_error(tmp_path: Path) -> None:
    results = run_ranks(2, train_and_save(lambda r: str(tmp_path), [3, 6], replicated=False))
    assert not [r for r in results if isinstance(r, BaseException)]
    results = run_ranks(3, lambda rank, comm: find_resume(CheckpointStore(str(tmp_path), "run", rank), comm))
    for result in results:
        assert isinstance(result, CheckpointError), results
        assert "written by 2 ranks, this attempt has 3" in str(result) and "num_workers=2" in str(result)
    assert (tmp_path / "run" / "step-000000006" / "rank-1.pt").exists()  # nothing deleted


def test_a_manifest_from_a_newer_format_is_refused(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "manifest.json").write_text(json.dumps({"format": 99, "world_size": 1, "steps": []}))
    results = run_ranks(1, lambda rank, comm: find_resume(CheckpointStore(str(tmp_path), "run", rank), comm))
    assert isinstance(results[0], CheckpointError) and "newer" in str(results[0])


@pytest.mark.parametrize("steps, keep, kept", [([3], 2, [3]), ([3, 6, 9, 12, 15], 3, [9, 12, 15])])
def test_finish_records_the_last_save(tmp_path: Path, steps: list[int], keep: int, kept: list[int]) -> None:
    results = run_ranks(2, train_and_save(lambda r: str(tmp_path), steps, keep=keep))
    assert not [r for r in results if isinstance(r, BaseException)]
    assert manifest_steps(tmp_path / "run") == kept
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.is_dir()) == [f"step-{s:09d}" for s in kept]
    assert results[0].saves == len(steps) and results[0].write_s > 0
