"""driver/model_inputs.py: a text column's tokenizer outputs go to the forward as Hugging Face passes
them: token_type_ids only where the tokenizer makes them. GPT-2's forward takes token_type_ids and
adds the token embedding of their ids at every position, so zeros it was never given change its
logits (benchmarks/llm_finetune.py found a GPT-2 fitted from a text column off the Trainer's loss)."""
from __future__ import annotations

import pytest
import torch

from sparkdl.config import DataConfig, TrainConfig
from sparkdl.driver.model_inputs import bind_model_inputs

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
TEXTS = ["the cat sat on the mat", "a dog ran far away", "cats and dogs", "the end"]


def _tokenizer(model_input_names: list[str] | None = None):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator(TEXTS, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "<|endoftext|>"]))
    extra = {"model_input_names": model_input_names} if model_input_names else {}
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="[PAD]", eos_token="<|endoftext|>", **extra)


def _gpt2(vocab: int):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=vocab, n_positions=16, n_embd=16,
                                                                 n_layer=1, n_head=2))


def test_gpt2_with_its_kind_of_tokenizer_gets_no_token_type_ids() -> None:
    tokenizer = _tokenizer()
    assert "token_type_ids" not in tokenizer(TEXTS[:1])  # what Hugging Face would pass: none
    model = _gpt2(len(tokenizer))
    data = bind_model_inputs(DataConfig(input_cols=["text"], tokenizer=tokenizer, packing=True, max_length=8),
                             TrainConfig(loss="causal_lm"), model)
    batch = data.transform_fn({"text": TEXTS})
    assert "token_type_ids" not in batch and "attention_mask" in batch
    ids = torch.from_numpy(batch["text"])
    model.eval()
    with torch.no_grad():  # why it matters: zeros are not the same as none for GPT-2
        assert not torch.allclose(model(input_ids=ids).logits, model(input_ids=ids, token_type_ids=torch.zeros_like(ids)).logits)


def test_a_tokenizer_that_makes_token_type_ids_still_passes_them() -> None:
    tokenizer = _tokenizer(["input_ids", "token_type_ids", "attention_mask"])
    assert "token_type_ids" in tokenizer(TEXTS[:1])
    data = bind_model_inputs(DataConfig(input_cols=["text"], tokenizer=tokenizer, max_length=8),
                             TrainConfig(loss="causal_lm"), _gpt2(len(tokenizer)))
    assert "token_type_ids" in data.transform_fn({"text": TEXTS[:2]})
