"""Streaming DiLoCo (strategies/diloco.py) on real gloo process groups: the update rule against
ALGORITHMS.md's pseudo-code done by hand in one process, quantized syncs, and an exact resume from a
checkpoint taken while a fragment's sync is in flight."""
from __future__ import annotations

import copy
import io
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gloo_world import run_world
from sparkdl.config import RunConfig, TrainConfig
from sparkdl.errors import ConfigError
from sparkdl.strategies.diloco import OuterSchedule, fragment_indices, layer_groups

pytestmark = pytest.mark.timeout(180)
WORLD = 2


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 10), nn.Tanh(), nn.Linear(10, 10), nn.ReLU(),
                         nn.Linear(10, 3))


def batches(rank: int, steps: int, rows: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(50 + rank)
    return [(torch.randn(rows, 8, generator=generator), torch.randint(0, 3, (rows,), generator=generator))
            for _ in range(steps)]


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=4e-3, weight_decay=0.1, betas=(0.9, 0.95))


def test_the_schedule_staggers_fragments_evenly_and_lands_them_tau_steps_later() -> None:
    schedule = OuterSchedule(every=6, fragments=3, delay=1)
    starts = {t: schedule.starting(t) for t in range(1, 13)}
    assert {t: f for t, f in starts.items() if f} == {2: [0], 4: [1], 6: [2], 8: [0], 10: [1], 12: [2]}
    lands = {t: f for t in range(1, 14) if (f := schedule.landing(t))}
    assert lands == {3: [0], 5: [1], 7: [2], 9: [0], 11: [1], 13: [2]}
    assert OuterSchedule(every=4).starting(4) == [0] and OuterSchedule(every=4).starting(3) == []  # plain DiLoCo


def test_fragments_are_strided_top_level_layers() -> None:
    class Blocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(5, 4)
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
            self.norm = nn.LayerNorm(4)
            self.head = nn.Linear(4, 5)

    model = Blocks()
    assert len(layer_groups(model)) == 7  # embed, 4 blocks, norm, head
    params = list(model.parameters())
    groups = fragment_indices(model, params, 3)
    names = [n for n, _ in model.named_parameters()]
    assert [[names[i].split(".weight")[0].split(".bias")[0] for i in g][::2] for g in groups] == \
        [["embed", "blocks.2", "head"], ["blocks.0", "blocks.3"], ["blocks.1", "norm"]]
    assert sorted(i for g in groups for i in g) == list(range(len(params)))
    with pytest.raises(ValueError, match="fragments=8, but the model has 7 top-level layer"):
        fragment_indices(model, params, 8)


def reference(steps: int, every: int, fragments: int, delay: int, alpha: float) -> dict[str, np.ndarray]:
    """ALGORITHMS.md's Streaming DiLoCo in one process, W inner AdamW replicas, fp32 throughout."""
    model = mlp()
    global_model = copy.deepcopy(model)
    replicas = [copy.deepcopy(model) for _ in range(WORLD)]
    inner = [adamw(m.parameters()) for m in replicas]
    outer = torch.optim.SGD(global_model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    data = [batches(rank, steps) for rank in range(WORLD)]
    layer_names = [["0.weight", "0.bias"], ["2.weight", "2.bias"], ["4.weight", "4.bias"], ["6.weight", "6.bias"]]
    owned = [[n for layer in layer_names[p::fragments] for n in layer] for p in range(fragments)]
    offsets = [(p + 1) * every // fragments % every for p in range(fragments)]
    pending: dict[int, dict[str, torch.Tensor]] = {}
    last_start = [0] * fragments

    def start(p: int, t: int) -> None:
        with torch.no_grad():
            g = dict(global_model.named_parameters())
            pending[p] = {n: torch.stack([g[n] - dict(m.named_parameters())[n] for m in replicas]).mean(0)
                          for n in owned[p]}
        last_start[p] = t

    def land(p: int, mix: float) -> None:
        g = dict(global_model.named_parameters())
        for param in global_model.parameters():
            param.grad = None
        for n, delta in pending.pop(p).items():
            g[n].grad = delta
        outer.step()  # parameters without a gradient are left alone, momentum included
        with torch.no_grad():
            for m in replicas:
                local = dict(m.named_parameters())
                for n in owned[p]:
                    local[n].copy_(mix * local[n] + (1 - mix) * g[n])

    for t in range(1, steps + 1):
        for rank in range(WORLD):
            features, labels = data[rank][t - 1]
            inner[rank].zero_grad()
            F.cross_entropy(replicas[rank](features), labels).backward()
            inner[rank].step()
        for p in range(fragments):
            if (t - offsets[p]) % every == 0:
                start(p, t)
        for p in range(fragments):
            if t - delay >= 1 and (t - delay - offsets[p]) % every == 0:
                land(p, alpha)
    for p in sorted(pending):
        land(p, alpha)
    for p in range(fragments):
        if not (last_start[p] == steps and delay == 0 and alpha == 0):
            start(p, steps)
            land(p, 0.0)
    return {k: v.detach().numpy() for k, v in global_model.state_dict().items()}


def _train(comm: Any, options: dict[str, Any], steps: int, stop_at: int | None = None) -> dict[str, Any]:
    """`steps` inner steps; with `stop_at`, a checkpoint at that step is saved, loaded into a fresh
    strategy (as a resumed attempt would) and training goes on from there."""
    from sparkdl.strategies.data_parallel import DataParallel

    def build() -> DataParallel:
        strategy = DataParallel(comm, None, TrainConfig(**options))
        strategy.setup(mlp(), adamw, F.cross_entropy)
        return strategy

    before = comm.bytes_sent
    strategy = build()
    data = batches(comm.rank, steps)
    for step, (features, labels) in enumerate(data, start=1):
        strategy.train_step(features, labels)
        if step == stop_at:
            buffer = io.BytesIO()
            torch.save(strategy.checkpoint_state(), buffer)
            strategy._outer_sync.close()  # noqa: SLF001 - the attempt ends here
            strategy = build()
            buffer.seek(0)
            strategy.load_checkpoint_state(torch.load(buffer, weights_only=True))
    strategy.finish()
    return {"state": {k: v.numpy() for k, v in strategy.module().state_dict().items()},
            "bytes": comm.bytes_sent - before}


def _train_cases(comm: Any, cases: dict[str, tuple[dict[str, Any], int, int | None]]) -> dict[str, Any]:
    """Every case in one world: spawning ranks costs seconds, a case a fraction of one."""
    return {name: _train(comm, options, steps, stop_at) for name, (options, steps, stop_at) in cases.items()}


STREAMED = [(2, 0, 0.0), (4, 1, 0.0), (2, 2, 0.5)]
RESUME = {"sync": "diloco", "sync_every": 8, "fragments": 2, "fragment_sync_delay": 2, "fragment_update_alpha": 0.5,
          "sync_dtype": "int4"}
BYTES = {"sync": "diloco", "sync_every": 8, "fragments": 2, "fragment_sync_delay": 1}
CASES: dict[str, tuple[dict[str, Any], int, int | None]] = {
    **{f"streamed {p} {d} {a}": ({"sync": "diloco", "sync_every": 8, "fragments": p, "fragment_sync_delay": d,
                                  "fragment_update_alpha": a, "outer_lr": 0.7, "outer_momentum": 0.9}, 19, None)
       for p, d, a in STREAMED},
    "plain": ({"sync": "diloco", "sync_every": 4, "outer_lr": 0.7, "outer_momentum": 0.9}, 10, None),
    # H=8, P=2, tau=2: fragment 0 starts at steps 4, 12 (lands 6, 14), fragment 1 at 8, 16 (lands 10,
    # 18). Checkpoints at 9 (fragment 1 in flight), 10 (it lands that step), 12 (fragment 0 starts).
    "straight": (RESUME, 19, None),
    **{f"resumed at {k}": (RESUME, 19, k) for k in (9, 10, 12)},
    "bytes fp32": (BYTES, 16, None),
    "bytes int4": ({**BYTES, "sync_dtype": "int4"}, 16, None),
}


@pytest.fixture(scope="module")
def trained() -> list[dict[str, Any]]:
    return run_world(WORLD, _train_cases, CASES, timeout=170)


@pytest.mark.parametrize("fragments,delay,alpha", STREAMED)
def test_streaming_diloco_follows_the_published_update_rule(trained: list[dict[str, Any]], fragments: int,
                                                            delay: int, alpha: float) -> None:
    expected = reference(19, 8, fragments, delay, alpha)
    for result in trained:
        for key, value in expected.items():
            np.testing.assert_allclose(result[f"streamed {fragments} {delay} {alpha}"]["state"][key], value,
                                       atol=1e-5, err_msg=key)


def test_one_fragment_without_delay_is_plain_diloco(trained: list[dict[str, Any]]) -> None:
    expected = reference(10, 4, 1, 0, 0.0)
    for key, value in expected.items():
        np.testing.assert_allclose(trained[0]["plain"]["state"][key], value, atol=1e-5, err_msg=key)


@pytest.mark.parametrize("stop_at", [9, 10, 12])
def test_resume_mid_period_is_exact_with_a_sync_in_flight(trained: list[dict[str, Any]], stop_at: int) -> None:
    """Continued from a checkpoint, to the uninterrupted run's weights bit for bit (int4 with error
    feedback: the residuals and the mean in flight are part of the checkpoint)."""
    for rank in range(WORLD):
        for key, value in trained[rank]["straight"]["state"].items():
            np.testing.assert_array_equal(trained[rank][f"resumed at {stop_at}"]["state"][key], value,
                                          err_msg=f"rank {rank} {key}")


def test_int4_streaming_sends_an_eighth_of_fp32_diloco_and_every_rank_ends_the_same(
        trained: list[dict[str, Any]]) -> None:
    fp32, int4 = [r["bytes fp32"] for r in trained], [r["bytes int4"] for r in trained]
    for key, value in int4[0]["state"].items():
        np.testing.assert_array_equal(int4[1]["state"][key], value, err_msg=key)  # replicas agree exactly
        np.testing.assert_allclose(value, fp32[0]["state"][key], atol=0.02, err_msg=key)
    # Rank 1 sends no initial broadcast: its bytes are the syncs alone. 4 bits + a bf16 scale per 128.
    ratio = fp32[1]["bytes"] / int4[1]["bytes"]
    assert 7.0 < ratio <= 8.0, ratio


def test_streaming_options_are_checked() -> None:
    def config(**options: Any) -> None:
        RunConfig.from_kwargs(feature_cols=["a"], **options).validate()

    with pytest.raises(ConfigError, match="sync_every=10 is not a multiple of train.fragments=3"):
        config(sync="diloco", sync_every=10, fragments=3)
    with pytest.raises(ConfigError, match="fragment_sync_delay=5 must be below sync_every / fragments = 5"):
        config(sync="diloco", sync_every=10, fragments=2, fragment_sync_delay=5)
    with pytest.raises(ConfigError, match="fragment_update_alpha must be in"):
        config(sync="diloco", fragment_update_alpha=1.5)
    with pytest.raises(ConfigError, match="shape DiLoCo's outer synchronisation, but train.strategy='hybrid'"):
        config(strategy="hybrid", sync_dtype="int4")
    with pytest.raises(ConfigError, match="train.sync_dtype"):
        config(sync="diloco", sync_dtype="int2")
    from sparkdl.driver.checks import check_backend, check_fragments

    horovod = RunConfig.from_kwargs(feature_cols=["a"], strategy="data_parallel", sync="diloco", sync_every=4,
                                    fragment_sync_delay=1, backend="horovod")
    with pytest.raises(ConfigError, match="fragment_sync_delay=1 overlaps .* launch.backend='horovod' cannot"):
        check_backend(horovod.train, horovod.launch)
    with pytest.raises(ConfigError, match="fragments=5, but the model has 4 top-level layer"):
        check_fragments(mlp(), RunConfig.from_kwargs(feature_cols=["a"], sync="diloco", sync_every=10, fragments=5).train)


def test_a_transformers_fragments_are_its_blocks_and_a_lora_its_adapters() -> None:
    """Streaming DiLoCo deals a Hugging Face transformer's cut (embeddings, blocks, head) into
    fragments; under a PEFT adapter only the adapter's tensors, block by block."""
    import pytest

    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from sparkdl.strategies.diloco import fragment_indices, layer_groups

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=64))
    groups = layer_groups(model)
    assert len(groups) == 5  # embeddings (wte tied with the head: counted there), 3 blocks, final norm
    assert sum(len(g) for g in groups) == len([p for p in model.parameters() if p.requires_grad])
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["c_attn"]))
    params = [p for p in lora.parameters() if p.requires_grad]
    fragments = fragment_indices(lora, params, 3)
    assert sorted(i for f in fragments for i in f) == list(range(len(params)))  # each adapter tensor once
