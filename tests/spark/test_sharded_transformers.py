"""Hugging Face causal LMs under sharded data parallel on local-cluster (2 ranks): a tiny GPT-2 and
a tiny Llama (both with the LM head tied to the token embedding), given as they are (their forward
returns a ModelOutput), cut at their blocks and trained with strategy="sharded", end with the
weights of a single-process loop on the same rows and seed, and come back tied; data parallel and
DiLoCo return the tied model tied too."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparkdl import TorchEstimator
from sparkdl.datasets import synthetic_tokens_dataframe

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, ROWS, STEPS, LR = 256, 12, 32, 3, 0.5


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=32, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))  # no dropout: two ranks draw other masks than one process


def llama() -> nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        tie_word_embeddings=True))  # as Llama 3.2's small models


MODELS = {"gpt2": (gpt2, ("transformer.wte", "lm_head")), "llama": (llama, ("model.embed_tokens", "lm_head"))}


@pytest.fixture(scope="module")
def tokens(spark):  # type: ignore[no-untyped-def]
    rows = synthetic_tokens_dataframe(spark, rows=ROWS, seq_len=SEQ, vocab=VOCAB, seed=1).collect()
    return spark.createDataFrame(rows).repartition(2).cache()


def fit(df, model: nn.Module, **options):  # type: ignore[no-untyped-def]
    # One batch per rank holds all its rows, so each epoch is one step on every row: the same step as
    # one process's full batch, whatever rows each rank was given.
    settings = dict(model=model, input_cols=["tokens"], label_col="targets", loss="cross_entropy", epochs=STEPS,
                    batch_size=ROWS // 2, num_workers=2, optimizer="sgd", lr=LR, shuffle=False, seed=3,
                    tracking=False, progress=False)
    settings.update(options)
    return TorchEstimator(**settings).fit(df)


def single_process(df, build) -> nn.Module:  # type: ignore[no-untyped-def]
    """Hugging Face's model trained in this process on every row, STEPS full-batch SGD steps."""
    table = df.toArrow()
    x = torch.tensor(table.column("tokens").to_pylist())
    y = torch.tensor(table.column("targets").to_pylist())
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(STEPS):
        optimizer.zero_grad()
        F.cross_entropy(model(input_ids=x).logits.reshape(-1, VOCAB), y.reshape(-1)).backward()
        optimizer.step()
    return model


def tied(model: nn.Module, embedding: str, head: str) -> bool:
    return model.get_submodule(head).weight is model.get_submodule(embedding).weight


def assert_same_weights(trained: nn.Module, reference: nn.Module, what: str) -> None:
    state = trained.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, atol=1e-5, rtol=1e-5, msg=f"{what}: {key}")


@pytest.mark.parametrize("family", list(MODELS))
def test_a_sharded_causal_lm_equals_one_process_and_comes_back_tied(tokens, family: str) -> None:  # type: ignore[no-untyped-def]
    build, (embedding, head) = MODELS[family]
    start = build()
    trained = fit(tokens, start, strategy="sharded")
    module = trained.torch_module()
    assert tied(module, embedding, head)
    reference = single_process(tokens, build)
    assert_same_weights(module, reference, family)
    assert not torch.allclose(module.get_submodule(embedding).weight, start.get_submodule(embedding).weight)
    # cut at its blocks (embeddings, 2 blocks, norm + head): each rank keeps about half of the weights
    whole = sum(p.numel() * 4 for p in reference.parameters())
    assert trained.history[-1]["max_param_bytes_per_rank"] < 0.55 * whole


@pytest.mark.parametrize("sync", ["data_parallel", "diloco"])
def test_data_parallel_and_diloco_return_a_tied_model_tied(tokens, sync: str) -> None:  # type: ignore[no-untyped-def]
    extra = {"sync": "diloco", "sync_every": 2} if sync == "diloco" else {}
    trained = fit(tokens, gpt2(), strategy="data_parallel", **extra)
    module = trained.torch_module()
    assert tied(module, "transformer.wte", "lm_head")
    if sync == "data_parallel":
        assert_same_weights(module, single_process(tokens, gpt2), sync)
    else:
        assert not torch.allclose(module.transformer.wte.weight, gpt2().transformer.wte.weight)
