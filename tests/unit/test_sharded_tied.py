"""Tied weights under sharded data parallel on real gloo ranks: a token embedding that the output
layer reuses lives in one shard, gradients from both uses are summed, the steps equal data
parallel's (and so a single process's), checkpoints resume, and the driver's merge of the pieces
gives back a model whose layers are still tied."""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gloo_world import run_world
from sparkdl.config import TrainConfig
from sparkdl.data.epochs import Accumulation

pytestmark = pytest.mark.timeout(300)

VOCAB, WIDTH, ROWS, TOKENS = 23, 8, 4, 5


class Embed(nn.Module):
    """Token ids -> (hidden, keep): a tuple crosses the cut, one float tensor and one bool."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, WIDTH), nn.Embedding(TOKENS, WIDTH)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens(ids) + self.positions.weight[: ids.shape[1]], ids > 0


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.mix = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, carried: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, keep = carried
        return hidden + torch.tanh(self.mix(self.norm(hidden))) * keep.unsqueeze(-1), keep


class Head(nn.Module):
    """The output layer, tied to the token embedding (its weight is that Parameter)."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB, bias=False)
        self.out.weight = embedding.weight

    def forward(self, carried: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.out(self.norm(carried[0]))


class TinyLM(nn.Module):
    """The same layers as one module (not an nn.Sequential: sharded trains it as one layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = Embed()
        self.blocks = nn.Sequential(Block(), Block())
        self.head = Head(self.embed.tokens)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(ids)))


def tied_model(sequential: bool) -> nn.Module:
    torch.manual_seed(0)
    lm = TinyLM()
    return nn.Sequential(lm.embed, lm.blocks[0], lm.blocks[1], lm.head) if sequential else lm


def _loss(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, VOCAB), labels.reshape(-1))


def _batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + rank)
    return [(torch.randint(0, VOCAB, (ROWS, TOKENS), generator=generator),
             torch.randint(0, VOCAB, (ROWS, TOKENS), generator=generator)) for _ in range(steps)]


def _train(comm: Any, name: str, options: dict[str, Any], sequential: bool, steps: int,
           resume_at: int = -1) -> dict[str, Any]:
    from sparkdl.model.objectives import build_optimizer
    from sparkdl.strategies import strategy_class

    train = TrainConfig(**options)

    def build() -> Any:
        strategy = strategy_class(name)(comm, None, train)
        strategy.setup(tied_model(sequential), lambda params: build_optimizer(train, params), _loss)
        return strategy

    strategy = build()
    for step, (ids, labels) in enumerate(_batches(comm.rank, steps)):
        if step == resume_at:
            saved = copy.deepcopy(strategy.checkpoint_state())
            strategy = build()
            strategy.load_checkpoint_state(saved)
        strategy.train_step(ids, labels, None, Accumulation(step % train.accumulate_steps, train.accumulate_steps))
    sums = strategy.evaluate(iter(_batches(50 + comm.rank, 1)), _loss, True)
    out: dict[str, Any] = {"state": {k: v.tolist() for k, v in (strategy.result_state() or {}).items()},
                           "validation": sums.tolist(), "param_bytes": strategy.epoch_metrics()["param_bytes"]}
    if name == "sharded":
        out["shards"] = len(strategy._params)  # noqa: SLF001 - how many shards the optimizer steps
    return out


CASES = {"sgd": {"optimizer": "sgd", "lr": 0.5},
         "adam_clip_accumulate": {"optimizer": "adam", "lr": 0.01, "grad_clip": 0.05, "accumulate_steps": 2}}


def _every_case(comm: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case, options in CASES.items():
        for sequential in (True, False):
            for name in ("sharded", "data_parallel"):
                out[f"{name}.{case}.{sequential}"] = _train(comm, name, options, sequential, 4)
    adam = {"optimizer": "adam", "lr": 0.01}
    out["straight"] = _train(comm, "sharded", adam, True, 4)
    out["resumed"] = _train(comm, "sharded", adam, True, 4, resume_at=2)
    out["gpt2"] = _train_gpt2(comm)
    return out


def gpt2() -> nn.Module:
    import transformers  # the test extra

    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=8, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _train_gpt2(comm: Any) -> dict[str, Any]:
    """Hugging Face's GPT-2 as it is (a ModelOutput), cut at its blocks, its head tied to wte."""
    from sparkdl.strategies.sharded import Sharded

    strategy = Sharded(comm, None, TrainConfig(optimizer="sgd", lr=0.5))
    strategy.setup(gpt2(), lambda params: torch.optim.SGD(params, lr=0.5), _loss)
    for ids, labels in _batches(comm.rank, 3):
        strategy.train_step(*_padded(ids, labels))
    sums = strategy.evaluate(iter([_padded(*_batches(60 + comm.rank, 1)[0])]), _loss, True)
    return {"state": {k: v.tolist() for k, v in (strategy.result_state() or {}).items()}, "validation": sums.tolist(),
            "layers": [type(layer.module).__name__ for layer in strategy._layers],  # noqa: SLF001
            "shared": [len(layer.shared) for layer in strategy._layers]}  # noqa: SLF001


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_world(2, _every_case, timeout=280)


def _merged(results: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(v) for result in results for k, v in result["state"].items()}


def _single_process(options: dict[str, Any], sequential: bool) -> nn.Module:
    """Both ranks' batches, one process, torch's own optimizer: what the two ranks must equal."""
    model = tied_model(sequential)
    optimizer = (torch.optim.SGD(model.parameters(), lr=options["lr"]) if options["optimizer"] == "sgd"
                 else torch.optim.Adam(model.parameters(), lr=options["lr"]))
    accumulate = options.get("accumulate_steps", 1)
    for step, ((x0, y0), (x1, y1)) in enumerate(zip(_batches(0, 4), _batches(1, 4))):
        (_loss(model(torch.cat([x0, x1])), torch.cat([y0, y1])) / accumulate).backward()
        if (step + 1) % accumulate == 0:
            if options.get("grad_clip"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), options["grad_clip"])
            optimizer.step()
            optimizer.zero_grad()
    return model


@pytest.mark.parametrize("sequential", [True, False], ids=["sequential", "one_module"])
@pytest.mark.parametrize("case", list(CASES))
def test_tied_weights_train_as_one_tensor(ranks: list[dict[str, Any]], case: str, sequential: bool) -> None:
    sharded = [r[f"sharded.{case}.{sequential}"] for r in ranks]
    data_parallel = [r[f"data_parallel.{case}.{sequential}"] for r in ranks]
    merged = _merged(sharded)
    reference = _single_process(CASES[case], sequential)
    names = dict(reference.named_parameters())  # each tensor once, under its first name
    assert sorted(merged) == sorted(set(reference.state_dict()) - {"3.out.weight", "head.out.weight"})
    assert set(sharded[0]["state"]).isdisjoint(sharded[1]["state"])  # each piece comes from one rank
    for key, value in names.items():
        torch.testing.assert_close(merged[key], value.detach(), atol=1e-5, rtol=1e-5, msg=key)
        torch.testing.assert_close(merged[key], torch.tensor(data_parallel[0]["state"][key]), atol=1e-5, rtol=1e-5)
    whole = sum(p.numel() * 4 for p in reference.parameters())  # the tied tensor counted once
    assert all(r["param_bytes"] <= whole / 2 + 4 * 5 for r in sharded)
    if sequential:  # 4 layers' own shards and one for the tied tensor: not two copies of it
        assert sharded[0]["shards"] == 5
    for mine, theirs in zip(sharded, data_parallel):
        assert mine["validation"] == pytest.approx(theirs["validation"], rel=1e-5, abs=1e-6)


def test_a_checkpoint_with_a_shared_shard_resumes_exactly(ranks: list[dict[str, Any]]) -> None:
    straight, resumed = _merged([r["straight"] for r in ranks]), _merged([r["resumed"] for r in ranks])
    assert straight.keys() == resumed.keys()
    for key, value in straight.items():
        torch.testing.assert_close(resumed[key], value, atol=0, rtol=0)


def test_the_driver_ties_the_merged_pieces_back(ranks: list[dict[str, Any]], tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The pieces as the driver receives them (one file per rank) into the model's skeleton."""
    from sparkdl.model.tensor_files import write_tensors
    from sparkdl.model.trained import module_from_files, skeleton_bytes

    files = []
    for rank, result in enumerate(ranks):
        files.append(str(tmp_path / f"part-{rank}.safetensors"))
        with open(files[-1], "wb") as out:
            write_tensors(out, {k: torch.tensor(v) for k, v in result["sharded.sgd.True"]["state"].items()})
    rebuilt = module_from_files(skeleton_bytes(tied_model(True)), files)
    assert rebuilt[3].out.weight is rebuilt[0].tokens.weight
    torch.testing.assert_close(rebuilt[0].tokens.weight.detach(), _single_process(CASES["sgd"], True)[0].tokens.weight,
                               atol=1e-5, rtol=1e-5)


def test_the_layers_are_cut_where_tensors_are_shared() -> None:
    from sparkdl.strategies.layer_shards import gathered_numels, shared_groups

    model = tied_model(True)
    groups = shared_groups(list(model))
    assert [(users, [p is model[0].tokens.weight for p in params]) for users, params in groups] == [((0, 3), [True])]
    assert shared_groups([TinyLM()]) == []  # a tie inside one layer is that layer's own
    # the head gathers the tied embedding with its own norm: the largest layer a rank holds whole
    assert gathered_numels(list(model)) == [VOCAB * WIDTH + TOKENS * WIDTH, 2 * WIDTH + WIDTH * WIDTH + WIDTH,
                                            2 * WIDTH + WIDTH * WIDTH + WIDTH, 2 * WIDTH + VOCAB * WIDTH]


def _padded(ids: torch.Tensor, labels: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Keyword inputs whose first row is right-padded (mask 0, label -100): the mask crosses every cut."""
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask}, labels.masked_fill(mask == 0, -100)


def test_a_hugging_face_gpt2_is_cut_at_its_blocks_and_its_tied_head_trains(ranks: list[dict[str, Any]]) -> None:
    results = [r["gpt2"] for r in ranks]
    assert results[0]["layers"] == ["Embeddings", "Block", "Block", "Head"]
    assert results[0]["shared"] == [1, 0, 0, 1]  # wte's shard, gathered by the embeddings and the head
    merged = _merged(results)
    reference = gpt2()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for batch0, batch1 in zip(_batches(0, 3), _batches(1, 3)):
        (inputs0, y0), (inputs1, y1) = _padded(*batch0), _padded(*batch1)
        optimizer.zero_grad()  # each rank's mean loss over its rows, averaged: equal counts of labels here
        ((_loss(reference(**inputs0).logits, y0) + _loss(reference(**inputs1).logits, y1)) / 2).backward()
        optimizer.step()
    assert sorted(merged) == sorted(set(reference.state_dict()) - {"lm_head.weight"})
    for key, value in reference.named_parameters():
        torch.testing.assert_close(merged[key], value.detach(), atol=1e-5, rtol=1e-5, msg=key)
    reference.eval()
    with torch.no_grad():  # validation through the gathered layers: the trained model's loss on its rows
        for rank, result in enumerate(results):
            inputs, labels = _padded(*_batches(60 + rank, 1)[0])
            expected = float(_loss(reference(**inputs).logits, labels)) * ROWS
            assert result["validation"][0] == pytest.approx(expected, rel=1e-5)


def test_a_transformer_computing_its_own_loss_stays_whole() -> None:
    """loss="model" passes the labels to the model's forward, which only the whole model takes."""
    from sparkdl.model.calling import ModelLoss
    from sparkdl.strategies.sharded import model_layers

    model = gpt2()
    assert [type(m).__name__ for m in model_layers(model)] == ["Embeddings", "Block", "Block", "Head"]
    assert model_layers(model, ModelLoss()) == [model]
