"""Spot-safe runs without Spark: checkpoints carried to another world size (executor/reshape.py,
strategies' loaders) on real gloo worlds, and the driver's rules (driver/elastic.py, config)."""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gloo_world import run_world
from sparkdl.config import RunConfig, TrainConfig
from sparkdl.errors import ConfigError, TrainingError
from sparkdl.executor.checkpoint import Manifest, StepRecord
from sparkdl.driver.elastic import MembershipChange, Resizing, grown_world, kept_batch, shrunk_world
from sparkdl.executor.reshape import gathered_shards

pytestmark = pytest.mark.timeout(180)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    # 8*13+13 = 117 and 13*3+3 = 42 parameters: neither divides by 2 or 3 (padding on both sides)
    return nn.Sequential(nn.Linear(8, 13), nn.ReLU(), nn.Linear(13, 3))


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def _train_and_save(comm: Any, options: dict[str, Any], directory: str, steps: int) -> dict[str, Any]:
    from sparkdl.strategies.data_parallel import DataParallel
    from sparkdl.strategies.sharded import Sharded

    cls = Sharded if options.get("strategy") == "sharded" else DataParallel
    strategy = cls(comm, None, TrainConfig(**options))
    strategy.setup(mlp(), adamw, F.cross_entropy)
    generator = torch.Generator().manual_seed(10 + comm.rank)
    for _ in range(steps):
        strategy.train_step(torch.randn(5, 8, generator=generator), torch.randint(0, 3, (5,), generator=generator))
    buffer = io.BytesIO()
    torch.save(strategy.checkpoint_state(), buffer)
    Path(directory, f"rank-{comm.rank}.pt").write_bytes(buffer.getvalue())
    result = strategy.result_state() or {}
    if cls is DataParallel and options.get("sync") == "diloco":
        strategy._outer_sync.close()  # noqa: SLF001 - the attempt ends here
        result = {"global": [p.numpy().copy() for p in strategy._outer_sync.global_params]}  # noqa: SLF001
    return {k: (v.numpy().copy() if torch.is_tensor(v) else v) for k, v in result.items()}


def _load(comm: Any, options: dict[str, Any], directory: str, written_by: int) -> dict[str, Any]:
    from sparkdl.strategies.data_parallel import DataParallel
    from sparkdl.strategies.sharded import Sharded

    parts = [torch.load(Path(directory, f"rank-{r}.pt"), weights_only=True) for r in range(written_by)]
    sharded = options.get("strategy") == "sharded"
    strategy = (Sharded if sharded else DataParallel)(comm, None, TrainConfig(**options))
    strategy.setup(mlp(), adamw, F.cross_entropy)
    state = gathered_shards(parts) if sharded else {**parts[0], "restart_from_global": True}
    strategy.load_checkpoint_state(state)
    out: dict[str, Any] = {"result": {k: v.numpy().copy() for k, v in (strategy.result_state() or {}).items()}}
    if sharded:
        state = strategy._optimizer.state  # noqa: SLF001
        out["moments"] = [state[shard]["exp_avg"].numpy().copy() for shard in strategy._params  # noqa: SLF001
                          if shard in state]
    else:
        out["local"] = [p.detach().numpy().copy() for p in strategy.module().parameters()]
        strategy._outer_sync.close()  # noqa: SLF001
    return out


def _moments(directory: str, written_by: int) -> list[np.ndarray]:
    parts = [torch.load(Path(directory, f"rank-{r}.pt"), weights_only=True) for r in range(written_by)]
    return [np.concatenate([p["optimizer"]["state"][i]["exp_avg"].numpy() for p in parts])
            for i in sorted(parts[0]["optimizer"]["state"])]  # the layers with parameters (not the ReLU)


@pytest.mark.parametrize("before,after", [(3, 2), (2, 3)])
def test_sharded_shards_are_re_cut_for_another_world(tmp_path: Path, before: int, after: int) -> None:
    """3 -> 2 (a host lost) and 2 -> 3 (grown back): the whole parameters and Adam's moments are
    those the old world held, only cut differently."""
    options = {"strategy": "sharded"}
    written = run_world(before, _train_and_save, options, str(tmp_path), 3)
    whole = {k: v for rank in written for k, v in rank.items()}
    loaded = run_world(after, _load, options, str(tmp_path), before)
    again = {k: v for rank in loaded for k, v in rank["result"].items()}
    assert sorted(again) == sorted(whole) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    for name, value in whole.items():
        np.testing.assert_array_equal(again[name], value, err_msg=name)
    sizes = [117, 42]
    old = _moments(str(tmp_path), before)
    for layer, size in enumerate(sizes):
        new = np.concatenate([rank["moments"][layer] for rank in loaded])
        np.testing.assert_array_equal(new[:size], old[layer][:size])
        assert np.all(new[size:] == 0)  # the new world's padding


def test_diloco_replicas_restart_from_the_global_model_on_another_world(tmp_path: Path) -> None:
    options = {"sync": "diloco", "sync_every": 4}
    written = run_world(3, _train_and_save, options, str(tmp_path), 6)  # 2 steps past the last sync
    loaded = run_world(2, _load, options, str(tmp_path), 3)
    for rank in loaded:
        for local, shared in zip(rank["local"], written[0]["global"]):
            np.testing.assert_array_equal(local, shared)


def test_kept_batch_keeps_the_global_batch_or_the_nearest_below() -> None:
    assert kept_batch(12, 1, 2) == 6 and kept_batch(12, 1, 3) == 4 and kept_batch(12, 2, 3) == 2
    assert kept_batch(16, 1, 3) == 5  # 15: the change record shows it
    assert kept_batch(4, 1, 8) == 1


def test_the_world_after_a_loss_is_the_slots_there_are_down_to_min_workers() -> None:
    launch = RunConfig.from_kwargs(feature_cols=["a"], num_workers=3, min_workers=2, checkpoint_dir="/x").launch
    assert shrunk_world(launch, 2, 3, ["h3"], 30) == 2
    assert shrunk_world(launch, 5, 3, [], 30) == 3  # never more than the run had
    with pytest.raises(TrainingError, match=r"lost host\(s\) h2, h3: 1 slot\(s\) found after waiting "
                                            r"launch.replacement_wait_s=30 s .* fewer than launch.min_workers=2"):
        shrunk_world(launch, 1, 3, ["h2", "h3"], 30)
    grow = RunConfig.from_kwargs(feature_cols=["a"], num_workers=3, min_workers=2, max_workers=4, grow_workers=True,
                                 checkpoint_dir="/x").launch
    assert grown_world(grow, 5, 2) == 4 and grown_world(grow, 2, 2) == 2
    assert grown_world(launch, 5, 2) == 2  # grow_workers off


def test_elastic_options_are_checked() -> None:
    def config(**options: Any) -> RunConfig:
        return RunConfig.from_kwargs(feature_cols=["a"], **options).validate()

    with pytest.raises(ConfigError, match="min_workers=4 exceeds launch.num_workers=3"):
        config(num_workers=3, min_workers=4, checkpoint_dir="/x")
    with pytest.raises(ConfigError, match="max_workers=2 is below launch.num_workers=3"):
        config(num_workers=3, max_workers=2, checkpoint_dir="/x")
    with pytest.raises(ConfigError, match="need train.checkpoint_dir"):
        config(num_workers=3, min_workers=2)
    with pytest.raises(ConfigError, match="strategy='hybrid' cannot change its world size"):
        config(num_workers=4, min_workers=2, strategy="hybrid", checkpoint_dir="/x")
    with pytest.raises(ConfigError, match="strategy='ist' cannot change"):
        config(num_workers=3, min_workers=2, strategy="ist", checkpoint_dir="/x")
    with pytest.raises(ConfigError, match="grow_workers=True, but the run cannot change size"):
        config(num_workers=3, grow_workers=True, checkpoint_dir="/x")
    with pytest.raises(ConfigError, match="resume_run='abc' continues that run's checkpoints"):
        config(resume_run="abc")
    with pytest.raises(ConfigError, match="replacement_wait_s must be a number of seconds"):
        config(num_workers=3, min_workers=2, checkpoint_dir="/x", replacement_wait_s=-1)
    assert config(num_workers=3, min_workers=2, checkpoint_dir="/x", sync="diloco").launch.min_workers == 2


def test_the_manifest_keeps_each_steps_world_size() -> None:
    manifest = Manifest(2, (StepRecord(4, (0, 1, 2), (0,), 3), StepRecord(8, (0, 1), (0,))))
    back = Manifest.from_json(manifest.to_json("run"))
    assert [back.written_by(s) for s in back.steps] == [3, 2]
    old = Manifest.from_json('{"format": 1, "world_size": 2, "steps": [{"step": 1, "ranks": [0, 1], '
                             '"strategy_ranks": [0]}]}')  # written before elastic runs
    assert old.written_by(old.steps[0]) == 2


def test_changes_are_recorded_on_the_first_epoch_after_them() -> None:
    class Spec:
        world_size = 3  # a stand-in for the TrainSpec's sections
        launch = RunConfig.from_kwargs(feature_cols=["a"], num_workers=3, min_workers=2, checkpoint_dir="/x").launch
        train = TrainConfig(epochs=4)

    resizing = Resizing(None, lambda workers, change: (None, None), None, Spec, None)
    change = MembershipChange(1.0, 3, 2, ("h3",), (), "hosts lost", 6, 12)
    resizing.changes.append(change)
    history = [{"epoch": 0, "workers": 3}, {"epoch": 1, "workers": 2, "resized_from_workers": 3},
               {"epoch": 2, "workers": 2}]
    resizing.annotate(history)
    assert history[1]["membership"] == [{"time": 1.0, "from_workers": 3, "to_workers": 2, "hosts_left": ["h3"],
                                         "hosts_joined": [], "reason": "hosts lost", "per_rank_batch": 6,
                                         "global_batch": 12}]
    assert "membership" not in history[0] and "membership" not in history[2]
    # Grown back, then a host lost again before the grown attempt finished an epoch: both changes
    # go with the next record.
    grown, lost = (MembershipChange(2.0, 2, 3, (), ("h3",), "slots returned", 4, 12),
                   MembershipChange(3.0, 3, 2, ("h2",), (), "hosts lost", 6, 12))
    resizing.changes[:] = [change, grown, lost]
    history = [{"epoch": 0, "workers": 3}, {"epoch": 1, "workers": 2, "resized_from_workers": 3},
               {"epoch": 2, "workers": 2, "resized_from_workers": 3}]
    resizing.annotate(history)
    assert [c["time"] for c in history[1]["membership"]] == [1.0]
    assert [c["time"] for c in history[2]["membership"]] == [2.0, 3.0]
    assert "workers 3 -> 2 (hosts lost; left: h3)" in change.line()
