"""strategy="hybrid" on Hugging Face causal LMs through the estimator on local-cluster: the model is
cut between its blocks into 2 stages (embeddings first, head last), and the fit ends with the
weights of a single-process training loop on the same rows; tied weights come back tied."""
from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparkdl import TorchEstimator

transformers = pytest.importorskip("transformers")

V, T, H, ROWS, EPOCHS, LR = 128, 12, 32, 32, 3, 0.5


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=H, n_head=2, vocab_size=V, n_positions=T, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def llama() -> nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=V, max_position_embeddings=T))


def token_table(padded: bool) -> dict[str, np.ndarray]:
    """ids, mask and labels of ROWS rows; with `padded`, rows end in padding (mask 0, label -100)
    and labels are the next tokens; without, labels are the ids (a causal LM shifts them itself)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, V, size=(ROWS, T))
    mask = np.ones_like(ids)
    if not padded:
        return {"ids": ids, "mask": mask, "labels": ids.copy()}
    lengths = rng.integers(T // 2, T + 1, size=ROWS)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.int64)
    labels = np.concatenate([ids[:, 1:], np.full((ROWS, 1), -100)], axis=1)
    labels[mask == 0] = -100
    return {"ids": ids, "mask": mask, "labels": labels}


def frame(spark: Any, table: dict[str, np.ndarray], partitions: int) -> Any:  # type: ignore[no-untyped-def]
    arrow = pa.table({name: pa.array(list(values.astype(np.int32)), pa.list_(pa.int32()))
                      for name, values in table.items()})
    return spark.createDataFrame(arrow).coalesce(1).repartition(partitions).cache()


def one_process(model: nn.Module, table: dict[str, np.ndarray], loss: str) -> nn.Module:
    """A plain loop: EPOCHS full-batch SGD steps on every row (what each of the fit's epochs is:
    one step of batch_size rows on every rank), the loss Hugging Face's or the token mean."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ids, mask, labels = (torch.tensor(table[c], dtype=torch.long) for c in ("ids", "mask", "labels"))
    for _ in range(EPOCHS):
        if loss == "causal_lm":
            objective = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        else:
            logits = model(input_ids=ids, attention_mask=mask).logits
            objective = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100)
        optimizer.zero_grad()
        objective.backward()
        optimizer.step()
    return model


def fit_hybrid(model: nn.Module, df: Any, workers: int, loss: str) -> Any:  # type: ignore[no-untyped-def]
    return TorchEstimator(model=model, input_cols={"input_ids": "ids", "attention_mask": "mask"}, label_col="labels",
                          loss=loss, strategy="hybrid", stages=2, microbatches=2, num_workers=workers,
                          batch_size=ROWS // workers, epochs=EPOCHS, optimizer="sgd", lr=LR, shuffle=False, seed=0,
                          tracking=False, progress=False).fit(df)


def assert_same_weights(trained: nn.Module, reference: nn.Module, start: nn.Module) -> None:
    got, expected = trained.state_dict(), reference.state_dict()
    assert set(got) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, atol=1e-5, rtol=0, msg=key)
    moved = [k for k, v in start.state_dict().items() if v.is_floating_point() and not torch.equal(v, expected[k])]
    assert len(moved) > len(expected) // 2  # it trained


@pytest.mark.parametrize("workers", [4, 2])
def test_gpt2_two_stages_give_the_weights_of_one_process_and_stay_tied(spark, workers: int) -> None:  # type: ignore[no-untyped-def]
    """2 stages x 2 replicas (and x 1): padded rows, next-token labels with -100, the token mean."""
    table = token_table(padded=True)
    start = gpt2()
    trained = fit_hybrid(start, frame(spark, table, workers), workers, "cross_entropy")
    grid = trained.history[0]["hybrid_grid"]
    assert len(grid) == workers // 2 and all(len(ranks) == 2 for ranks in grid)
    model = trained.torch_module()
    assert_same_weights(model, one_process(start, table, "cross_entropy"), start)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied, as given


def test_llama_two_stages_with_the_causal_lm_loss(spark) -> None:  # type: ignore[no-untyped-def]
    """loss="causal_lm" (labels shifted as Hugging Face's own loss does) against the model's own loss."""
    table = token_table(padded=False)
    start = llama()
    trained = fit_hybrid(start, frame(spark, table, 2), 2, "causal_lm")
    assert_same_weights(trained.torch_module(), one_process(start, table, "causal_lm"), start)
