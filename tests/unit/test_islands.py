"""Islands (strategies/islands.py): data parallel inside each island, DiLoCo across, on real gloo
process groups. With H = 1, outer lr 1 and no momentum the update is data parallel's over all ranks."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gloo_world import run_world
from sparkdl.config import RunConfig, TrainConfig
from sparkdl.errors import ConfigError
from sparkdl.strategies.islands import island_ranks

pytestmark = pytest.mark.timeout(180)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def batches(rank: int, steps: int, rows: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(70 + rank)
    return [(torch.randn(rows, 8, generator=generator), torch.randint(0, 3, (rows,), generator=generator))
            for _ in range(steps)]


def plain_sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _train(comm: Any, options: dict[str, Any], steps: int) -> dict[str, Any]:
    from sparkdl.strategies.data_parallel import DataParallel

    strategy = DataParallel(comm, None, TrainConfig(**options))
    strategy.setup(mlp(), plain_sgd, F.cross_entropy)
    before = comm.bytes_sent
    for features, labels in batches(comm.rank, steps):
        strategy.train_step(features, labels)
    strategy.finish()
    return {"state": {k: v.numpy() for k, v in strategy.module().state_dict().items()},
            "bytes": comm.bytes_sent - before}


def test_island_ranks_follow_the_declared_hosts_or_executors() -> None:
    hosts = ("a", "a", "b", "c")
    assert island_ranks((("a",), ("b", "c")), hosts) == [[0, 1], [2, 3]]
    assert island_ranks((("a:1", "b"), ("a:2", "c")), hosts, ("a:1", "a:2", "b:1", "c:1")) == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match=r"rank 3 on \['c'\] is in no island"):
        island_ranks((("a",), ("b",)), hosts)
    with pytest.raises(ValueError, match=r"no rank runs on \[\['d'\]\]"):
        island_ranks((("a",), ("b", "c"), ("d",)), hosts)


def _train_cases(comm: Any, cases: dict[str, tuple[dict[str, Any], int]]) -> dict[str, Any]:
    """Every case in one world: spawning ranks costs seconds, a case a fraction of one."""
    return {name: _train(comm, options, steps) for name, (options, steps) in cases.items()}


H1 = {"sync": "diloco", "sync_every": 1, "outer_lr": 1.0, "outer_momentum": 0.0}
STREAMED = {"sync": "diloco", "sync_every": 8, "fragments": 2, "fragment_sync_delay": 1, "sync_dtype": "int4",
            "islands": (("e0", "e1"), ("e2", "e3"))}


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    cases = {"data parallel": ({}, 5), "islands h1": ({**H1, "islands": (("e0", "e2"), ("e1", "e3"))}, 5),
             "islands streamed": (STREAMED, 16), "flat streamed": ({**STREAMED, "islands": 0}, 16),
             # int8 and fp16 travel a ring over the cross-island group (its send/recv)
             "islands int8": ({**STREAMED, "sync_dtype": "int8"}, 16),
             "islands fp16": ({**STREAMED, "sync_dtype": "fp16", "fragment_sync_delay": 0}, 16)}
    return run_world(4, _train_cases, cases, executors=("e0", "e1", "e2", "e3"), timeout=170)


def test_islands_with_h1_plain_averaging_equal_data_parallel(four_ranks: list[dict[str, Any]]) -> None:
    """Unequal islands (2 + 1: weighted by size, one rank per island averages across) and equal ones
    whose islands interleave the ranks (2 + 2: the average sharded over two cross-island pairs)."""
    three = run_world(3, _train_cases, {"data parallel": ({}, 5),
                                        "islands h1": ({**H1, "islands": (("e0", "e1"), ("e2",))}, 5)},
                      executors=("e0", "e1", "e2"))
    for results in (three, four_ranks):
        reference = results[0]["data parallel"]["state"]
        for rank, result in enumerate(results):
            for key, value in reference.items():
                np.testing.assert_allclose(result["islands h1"]["state"][key], value, atol=1e-6,
                                           err_msg=f"{len(results)} ranks: rank {rank} {key}")


def test_islands_stream_quantized_syncs_and_every_rank_ends_the_same(four_ranks: list[dict[str, Any]]) -> None:
    """4 ranks in 2 islands, H=8, 2 fragments overlapped by a step, int4 across: every rank ends with
    the same model, which is not flat DiLoCo's over the 4 ranks."""
    first = four_ranks[0]["islands streamed"]["state"]
    for rank in range(1, 4):
        for key, value in first.items():
            np.testing.assert_array_equal(four_ranks[rank]["islands streamed"]["state"][key], value,
                                          err_msg=f"{rank} {key}")
    flat = four_ranks[0]["flat streamed"]["state"]
    assert not all(np.array_equal(flat[k], v) for k, v in first.items())
    for case in ("islands int8", "islands fp16"):
        reference = four_ranks[0][case]["state"]
        for rank in range(1, 4):
            for key, value in reference.items():
                np.testing.assert_array_equal(four_ranks[rank][case]["state"][key], value, err_msg=f"{case} {rank}")
        for key, value in reference.items():  # 8 and 16 bits land near the 4-bit run
            np.testing.assert_allclose(value, first[key], atol=0.05, err_msg=f"{case} {key}")


def test_islands_options_are_checked() -> None:
    def config(**options: Any) -> None:
        RunConfig.from_kwargs(feature_cols=["a"], **options).validate()

    with pytest.raises(ConfigError, match="train.islands=1: one island is plain data parallel"):
        config(sync="diloco", islands=1)
    with pytest.raises(ConfigError, match="at least two non-empty groups"):
        config(sync="diloco", islands=[["a", "b"]])
    with pytest.raises(ConfigError, match=r"names \['a'\] in two islands"):
        config(sync="diloco", islands=[["a", "b"], ["a"]])
    with pytest.raises(ConfigError, match="islands shape DiLoCo's outer synchronisation, but train.strategy='ist'"):
        config(strategy="ist", islands=2)
    from sparkdl.driver.checks import check_backend

    horovod = RunConfig.from_kwargs(feature_cols=["a"], strategy="data_parallel", sync="diloco", islands=2,
                                    backend="horovod")
    with pytest.raises(ConfigError, match="train.islands needs a process group per island.*'horovod'"):
        check_backend(horovod.train, horovod.launch)
