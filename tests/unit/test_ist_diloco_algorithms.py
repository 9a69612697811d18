"""IST and DiLoCo on real gloo process groups (no Spark): the algorithms as ALGORITHMS.md writes them."""
from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gloo_world import run_world
from sparkdl.config import RunConfig, TrainConfig
from sparkdl.errors import ConfigError, ModelError
from sparkdl.strategies.ist import (extract_subnet, ist_layout, narrow_layers, partition, subnet_shapes,
                                    subnet_tensors, use_batch_statistics, write_back)


def mlp(bn: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, 12)] + ([nn.BatchNorm1d(12)] if bn else []) + [nn.ReLU(), nn.Linear(12, 10)]
    layers += ([nn.BatchNorm1d(10)] if bn else []) + [nn.Tanh(), nn.Dropout(0.0), nn.Linear(10, 3)]
    return nn.Sequential(*layers)


def batches(rank: int, steps: int, rows: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(50 + rank)
    return [(torch.randn(rows, 8, generator=generator), torch.randint(0, 3, (rows,), generator=generator))
            for _ in range(steps)]


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


# -- IST -----------------------------------------------------------------------------------------
def test_ist_rejects_what_it_cannot_partition() -> None:
    with pytest.raises(ModelError, match=r"layer 1 \(Conv1d\) cannot be partitioned by IST"):
        ist_layout(nn.Sequential(nn.Linear(4, 4), nn.Conv1d(1, 1, 1), nn.Linear(4, 2)), 2, 30, "scale", 0)
    with pytest.raises(ModelError, match="at least one hidden layer"):
        ist_layout(nn.Sequential(nn.Linear(4, 2)), 2, 30, "scale", 0)
    with pytest.raises(ModelError, match="nn.Sequential MLP, but the model is a Linear"):
        ist_layout(nn.Linear(4, 2), 2, 30, "scale", 0)
    with pytest.raises(ModelError, match=r"hidden layer\(s\) \[0, 1\].*have none"):
        ist_layout(mlp(), 2, 30, "batchnorm", 0)
    with pytest.raises(ModelError, match="normalises the output layer"):
        ist_layout(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2), nn.BatchNorm1d(2)), 2, 30, "scale", 0)
    with pytest.raises(ModelError, match="PReLU"):
        ist_layout(nn.Sequential(nn.Linear(4, 8), nn.PReLU(8), nn.Linear(8, 2)), 2, 30, "scale", 0)
    layout = ist_layout(mlp(), 2, 30, "scale", 0)
    assert narrow_layers(layout) == ["hidden layer 0 (12 neurons)", "hidden layer 1 (10 neurons)"]
    assert not narrow_layers(ist_layout(nn.Sequential(nn.Linear(4, 1024), nn.ReLU(), nn.Linear(1024, 2)), 2, 30,
                                        "scale", 0))


def test_partitions_are_disjoint_cover_and_change_every_round() -> None:
    layout = ist_layout(mlp(), 3, 30, "scale", 7)
    first, second = partition(layout, 0), partition(layout, 1)
    for groups, width in zip(first, layout.widths):
        assert sorted(torch.cat(groups).tolist()) == list(range(width))
    assert [g.tolist() for g in first[0]] != [g.tolist() for g in second[0]]
    assert [g.tolist() for g in partition(layout, 0)[0]] == [g.tolist() for g in first[0]]  # seed + round only


def test_subnet_blocks_are_the_diagonal_and_write_back_is_exact() -> None:
    model = mlp(bn=True)
    layout = ist_layout(model, 2, 30, "scale", 0)
    groups = partition(layout, 0)
    sub = extract_subnet(model, layout, groups, 1)
    rows0, rows1 = groups[0][1], groups[1][1]
    linears = [m for m in sub if isinstance(m, nn.Linear)]
    torch.testing.assert_close(linears[0].weight, model[0].weight[rows0])  # first layer: rows, all inputs
    torch.testing.assert_close(linears[1].weight, model[3].weight[rows1][:, rows0])  # diagonal block
    torch.testing.assert_close(linears[2].weight, model[7].weight[:, rows1])  # last layer: columns
    own, _ = subnet_tensors(sub)
    assert [tuple(t.shape) for t in own] == subnet_shapes(model, layout, groups, 1)
    changed = copy.deepcopy(model)
    write_back(changed, layout, groups, 1, [t.detach() + 1 for t in own])
    differing = sum(int((a != b).sum()) for a, b in zip(model.state_dict().values(), changed.state_dict().values()))
    assert differing == sum(t.numel() for t in own)  # exactly the subnet's entries, nothing else


def _ist_rank(comm: Any, steps: int, scale: str, bn: bool) -> dict[str, Any]:
    from sparkdl.strategies.ist import Ist

    layout = ist_layout(mlp(bn), comm.size, 3, scale, 11)
    strategy = Ist(comm, layout, TrainConfig())
    strategy.setup(mlp(bn), sgd, F.cross_entropy)
    for features, labels in batches(comm.rank, steps):
        strategy.train_step(features, labels)
    strategy.finish()
    return {"state": {k: v.numpy() for k, v in strategy.module().state_dict().items()}, "bytes": comm.bytes_sent}


def _ist_reference(world: int, steps: int, scale: str, bn: bool) -> dict[str, np.ndarray]:
    """IST by hand in one process: each round every rank's subnet trained on its rows, written back,
    the output bias averaged."""
    model = mlp(bn)
    if scale == "batchnorm":
        use_batch_statistics(model)
    layout = ist_layout(model, world, 3, scale, 11)
    data = [batches(rank, steps) for rank in range(world)]
    for round_number, start in enumerate(range(0, steps, 3)):
        groups = partition(layout, round_number)
        trained, biases = [], []
        for rank in range(world):
            sub = extract_subnet(model, layout, groups, rank)
            optimizer = sgd(sub.parameters())
            for features, labels in data[rank][start: start + 3]:
                sub.train()
                optimizer.zero_grad()
                F.cross_entropy(sub(features), labels).backward()
                optimizer.step()
            own, shared = subnet_tensors(sub)
            trained.append([t.detach() for t in own])
            biases.append(shared[0].detach())
        for rank in range(world):
            write_back(model, layout, groups, rank, trained[rank])
        with torch.no_grad():
            model[layout.linears[-1]].bias.copy_(torch.stack(biases).mean(0))
    return {k: v.numpy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("world,steps,scale,bn", [(2, 7, "scale", False), (3, 6, "batchnorm", True)])
def test_ist_equals_the_algorithm_done_by_hand(world: int, steps: int, scale: str, bn: bool) -> None:
    results = run_world(world, _ist_rank, steps, scale, bn)
    expected = _ist_reference(world, steps, scale, bn)
    for result in results:  # every rank holds the same full model after the last write-back
        assert sorted(result["state"]) == sorted(expected)
        for key, value in expected.items():
            np.testing.assert_allclose(result["state"][key], value, atol=1e-5, err_msg=key)
    # Traffic of a rank that is not the broadcast root: per round one allgather of the (padded)
    # subnet and one allreduce of the shared output bias, from tensor sizes.
    model = mlp(bn)
    if scale == "batchnorm":
        use_batch_statistics(model)  # no running statistics to send
    layout = ist_layout(model, world, 3, scale, 11)
    expected_bytes = 0
    for round_number in range(-(-steps // 3)):
        groups = partition(layout, round_number)
        padded = max(sum(int(np.prod(s)) for s in subnet_shapes(model, layout, groups, r)) for r in range(world))
        expected_bytes += (world - 1) * padded * 4 + 2 * (world - 1) * (3 * 4) // world
    assert results[1]["bytes"] == expected_bytes
    assert expected_bytes < -(-steps // 3) * sum(v.nbytes for v in expected.values())


# -- DiLoCo --------------------------------------------------------------------------------------
def _dp_rank(comm: Any, options: dict[str, Any], steps: int) -> dict[str, Any]:
    from sparkdl.strategies.data_parallel import DataParallel

    strategy = DataParallel(comm, None, TrainConfig(**options))
    strategy.setup(mlp(), sgd if options.get("optimizer") != "adamw" else
                   (lambda p: torch.optim.AdamW(p, lr=4e-3, weight_decay=0.1, betas=(0.9, 0.95))), F.cross_entropy)
    for features, labels in batches(comm.rank, steps):
        strategy.train_step(features, labels)
    strategy.finish()
    return {"state": {k: v.numpy() for k, v in strategy.module().state_dict().items()}, "bytes": comm.bytes_sent}


def test_diloco_with_h1_plain_averaging_is_data_parallel() -> None:
    """H = 1, outer lr 1, no momentum, SGD inner without momentum: the average of one local step from
    the same weights is one data-parallel step."""
    reference = run_world(2, _dp_rank_with, {}, plain, 4)
    diloco = run_world(2, _dp_rank_with, {"sync": "diloco", "sync_every": 1, "outer_lr": 1.0, "outer_momentum": 0.0},
                       plain, 4)
    for key, value in reference[0]["state"].items():
        np.testing.assert_allclose(diloco[0]["state"][key], value, atol=1e-6, err_msg=key)


def plain(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _dp_rank_with(comm: Any, options: dict[str, Any], make_optimizer: Any, steps: int) -> dict[str, Any]:
    from sparkdl.strategies.data_parallel import DataParallel

    strategy = DataParallel(comm, None, TrainConfig(**options))
    strategy.setup(mlp(), make_optimizer, F.cross_entropy)
    for features, labels in batches(comm.rank, steps):
        strategy.train_step(features, labels)
    strategy.finish()
    return {"state": {k: v.numpy() for k, v in strategy.module().state_dict().items()}, "bytes": comm.bytes_sent}


def _diloco_reference(world: int, steps: int, every: int, outer_lr: float, momentum: float) -> dict[str, np.ndarray]:
    """ALGORITHMS.md's pseudo-code in one process: W inner AdamW copies, outer Nesterov SGD."""
    model = mlp()
    global_model = copy.deepcopy(model)
    locals_ = [copy.deepcopy(model) for _ in range(world)]
    inner = [torch.optim.AdamW(m.parameters(), lr=4e-3, weight_decay=0.1, betas=(0.9, 0.95)) for m in locals_]
    outer = torch.optim.SGD(global_model.parameters(), lr=outer_lr, momentum=momentum, nesterov=momentum > 0)
    data = [batches(rank, steps) for rank in range(world)]

    def sync() -> None:
        with torch.no_grad():
            for name, param in global_model.named_parameters():
                deltas = [param - dict(m.named_parameters())[name] for m in locals_]
                param.grad = torch.stack(deltas).mean(0)
        outer.step()
        for m in locals_:
            m.load_state_dict(global_model.state_dict())

    done = 0
    for step in range(steps):
        for rank in range(world):
            features, labels = data[rank][step]
            inner[rank].zero_grad()
            F.cross_entropy(locals_[rank](features), labels).backward()
            inner[rank].step()
        done += 1
        if done == every:
            sync()
            done = 0
    if done:
        sync()
    return {k: v.numpy() for k, v in global_model.state_dict().items()}


@pytest.mark.parametrize("sync_dtype,atol", [("fp32", 1e-5), ("fp16", 2e-3), ("bf16", 1e-2)])
def test_diloco_follows_the_published_algorithm(sync_dtype: str, atol: float) -> None:
    options = {"sync": "diloco", "sync_every": 3, "outer_lr": 0.7, "outer_momentum": 0.9, "optimizer": "adamw",
               "sync_dtype": sync_dtype}
    results = run_world(2, _dp_rank, options, 7)
    expected = _diloco_reference(2, 7, 3, 0.7, 0.9)
    for result in results:
        for key, value in expected.items():
            np.testing.assert_allclose(result["state"][key], value, atol=atol, err_msg=key)
    every_step = run_world(2, _dp_rank, {"optimizer": "adamw"}, 7)
    # 3 synchronisations (steps 3, 6 and the last partial round) against 7 allreduces of the gradients.
    ratio = every_step[1]["bytes"] / results[1]["bytes"]  # rank 1: no initial broadcast to send
    # (fp16 carries a bf16 scale per block of 128 values besides its 2 bytes a value.)
    assert ratio == pytest.approx(7 / 3 * (1 if sync_dtype == "fp32" else 2), rel=0.02)


def test_diloco_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="train.sync='diloco' is a synchronisation mode of data parallel"):
        RunConfig.from_kwargs(feature_cols=["a"], sync="diloco", strategy="hybrid").validate()
    with pytest.raises(ConfigError, match="train.outer_momentum must be in"):
        RunConfig.from_kwargs(feature_cols=["a"], outer_momentum=1.0).validate()
    with pytest.raises(ConfigError, match="train.sync_every must be a positive integer"):
        RunConfig.from_kwargs(feature_cols=["a"], sync_every=0).validate()
