"""data/text.py: text and ragged token columns into padded or packed batches, with a tokenizer
trained here (nothing downloaded); model/generation.py's left padding."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from sparkdl.data.text import IGNORE_INDEX, TOKEN_LABELS, Tokenization
from sparkdl.model.generation import left_padded

tokenizers = pytest.importorskip("tokenizers")
TEXTS = ["the cat sat", "a dog ran far away", "cats and dogs", "the end"]


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXTS, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "<|endoftext|>"]))
    return tok


def test_texts_are_padded_to_the_batchs_longest_row(tokenizer) -> None:  # type: ignore[no-untyped-def]
    tokenize = Tokenization(tokenizer, ("text",), ("input_ids",), max_length=4, labels_from_tokens=True)
    out = tokenize({"text": TEXTS[:2]})
    ids, mask = out["text"], out["attention_mask"]
    assert ids.shape == (2, 4) and mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]  # truncated to max_length
    assert ids[0, 3] == tokenizer.token_to_id("[PAD]")
    assert out[TOKEN_LABELS][0].tolist()[-1] == IGNORE_INDEX and out[TOKEN_LABELS][1].tolist() == ids[1].tolist()


def test_packing_joins_rows_and_loses_nothing(tokenizer) -> None:  # type: ignore[no-untyped-def]
    tokenize = Tokenization(tokenizer, ("text",), ("input_ids",), max_length=5, packing=True, labels_from_tokens=True)
    out = tokenize({"text": TEXTS})
    words = sum(len(t.split()) for t in TEXTS)
    eos = tokenizer.token_to_id("<|endoftext|>")
    assert out["text"].shape == (-(-(words + len(TEXTS)) // 5), 5)
    assert int(out["attention_mask"].sum()) == words + len(TEXTS)  # every token and one end-of-text per row
    assert int((out["text"] == eos).sum()) == len(TEXTS)
    scoring = tokenize.for_scoring()
    assert scoring({"text": TEXTS})["text"].shape[0] == len(TEXTS) and TOKEN_LABELS not in scoring({"text": TEXTS})


def test_ragged_token_arrays_are_padded_alike(tokenizer) -> None:  # type: ignore[no-untyped-def]
    tokenize = Tokenization(tokenizer, ("tokens",), ("input_ids",), max_length=8)
    out = tokenize({"tokens": [np.array([3, 4, 5]), np.array([6])]})
    assert out["tokens"].tolist() == [[3, 4, 5], [6, 0, 0]] and out["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_a_tokenizer_path_is_loaded_where_it_is_used(tokenizer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    tokenize = Tokenization(str(tmp_path / "tokenizer.json"), ("text",), ("input_ids",))
    first = tokenize({"text": TEXTS})["text"]
    again = pickle.loads(pickle.dumps(tokenize))  # the loaded tokenizer does not travel
    assert again._loaded is None
    assert np.array_equal(again({"text": TEXTS})["text"], first)


def test_a_tokenizer_directory_gives_token_type_ids_only_where_its_tokenizer_makes_them(tokenizer, tmp_path  # type: ignore[no-untyped-def]
                                                                                      ) -> None:
    """A path's tokenizer is known only once loaded: as a tokenizer object on the driver, GPT-2's kind
    (model_input_names without token_type_ids) passes none, a BERT-style one passes them."""
    transformers = pytest.importorskip("transformers")
    for names, expected in ((["input_ids", "attention_mask"], False),
                            (["input_ids", "token_type_ids", "attention_mask"], True)):
        wrapped = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]",
                                                       model_input_names=names)
        wrapped.save_pretrained(tmp_path / str(expected))
        tokenize = Tokenization(str(tmp_path / str(expected)), ("text",), ("input_ids",),
                                extra_outputs=("attention_mask", "token_type_ids"))
        out = tokenize({"text": TEXTS})
        assert ("token_type_ids" in out) is expected and "attention_mask" in out


def test_rows_move_to_the_right_for_generation() -> None:
    ids = torch.tensor([[5, 6, 0], [7, 0, 0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    moved, moved_mask = left_padded(ids, mask, pad_id=0)
    assert moved.tolist() == [[0, 5, 6], [0, 0, 7]] and moved_mask.tolist() == [[0, 1, 1], [0, 0, 1]]


def test_a_model_without_generate_continues_greedily_and_pools() -> None:
    from torch import nn

    from sparkdl.model.generation import Generation, generate_ids, pooled_embeddings

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embed, self.head = nn.Embedding(10, 8), nn.Linear(8, 10)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> dict:
            hidden = self.embed(input_ids).cumsum(dim=1)
            return {"logits": self.head(hidden), "last_hidden_state": hidden}

    model = Tiny().eval()
    prompt = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        new = generate_ids(model, {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)},
                           Generation(max_new_tokens=4), pad_id=0, eos_id=None)
        ids = prompt
        for _ in range(4):  # the same greedy loop by hand
            ids = torch.cat([ids, model(ids)["logits"][:, -1].argmax(-1, keepdim=True)], dim=1)
        assert new == [ids[0, 3:].tolist()]
        batch = {"input_ids": torch.tensor([[1, 2, 0]]), "attention_mask": torch.tensor([[1, 1, 0]])}
        torch.testing.assert_close(pooled_embeddings(model, batch), model(batch["input_ids"])["last_hidden_state"][:, :2].mean(1))
    with pytest.raises(Exception, match="max_new_tokens"):
        Generation(max_new_tokens=0).validate()


def test_a_tokenizer_that_does_not_say_gives_no_token_type_ids(tokenizer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A tokenizers.Tokenizer (object or tokenizer.json) has no model_input_names: no token type ids
    (BERT-style models take absent ones as zeros; GPT-2 would add wte(0) for zeros)."""
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    for given in (tokenizer, str(tmp_path / "tokenizer.json")):
        out = Tokenization(given, ("text",), ("input_ids",), extra_outputs=("attention_mask", "token_type_ids"))(
            {"text": TEXTS})
        assert "token_type_ids" not in out and "attention_mask" in out
