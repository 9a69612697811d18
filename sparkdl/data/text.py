"""Text columns into token tensors on the executors (`data.tokenizer`): no tokenizing pass through
Spark first. Runs wherever batches are assembled (training ranks, the driver's probe, transform
and the MLflow model), as the first step of the batch's transform.

- A string (or binary UTF-8) input column is tokenized per batch: truncated to `max_length`,
  padded to the batch's longest row; its ids go to the column's forward keyword (`input_ids`),
  the attention mask (and token type ids where the tokenizer makes them and the model takes them)
  beside it.
- A column of variable-length integer arrays (tokens already) is padded per batch the same way.
- `packing` (causal language models): the batch's rows are joined, each ended by the end-of-text
  token, and cut into blocks of `max_length` tokens; the last block is padded and its padding
  masked. A batch of B rows becomes ceil(tokens / max_length) blocks: nothing is lost or repeated.
- Without a label column the labels are the ids themselves, padding set to IGNORE_INDEX (the
  model, or the causal_lm loss, shifts them).

The tokenizer is a `transformers` tokenizer object, a `tokenizers.Tokenizer`, or a path (a
`tokenizer.json` file, or a directory `AutoTokenizer.from_pretrained` reads) loaded on the
executors the first time a batch needs it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

from sparkdl.errors import ConfigError, ModelError

IGNORE_INDEX = -100
TOKEN_LABELS = "__sparkdl_token_labels"  # the labels the texts give when the run has no label column
DEFAULT_MAX_LENGTH = 512


@dataclass
class Tokenization:
    """The batch transform that turns text (or ragged token) columns into model inputs. Picklable:
    a path travels as its text and is loaded once per process."""

    tokenizer: Any  # tokenizer object or path
    columns: tuple[str, ...]  # the input columns it encodes (their source names)
    keys: tuple[str, ...]  # the forward keyword each column's ids go to
    max_length: int = DEFAULT_MAX_LENGTH
    packing: bool = False
    extra_outputs: tuple[str, ...] = ("attention_mask",)  # tokenizer outputs the model takes besides the ids
    labels_from_tokens: bool = False
    inner: Callable[[dict], dict] | None = None  # the user's transform_fn, run after tokenizing
    _loaded: Any = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if isinstance(self.tokenizer, str):
            state["_loaded"] = None  # a path is loaded again where it is used
        return state

    def __call__(self, raw: dict[str, Any]) -> dict[str, Any]:
        out = dict(raw)
        for column, key in zip(self.columns, self.keys):
            values = raw[column]
            if values and isinstance(values[0], (str, bytes)):
                ids = self.encode([v.decode("utf-8") if isinstance(v, bytes) else v for v in values])
            else:
                ids = [np.asarray(v, dtype=np.int64) for v in values]
            tensors = self._packed(ids) if self.packing else self._padded(ids)
            out[column] = tensors["input_ids"]
            for name in self.extra_outputs:
                if name in tensors and self._makes(name):
                    out[name] = tensors[name]
            if self.labels_from_tokens and column == self.columns[0]:
                labels = tensors["input_ids"].copy()
                labels[tensors["attention_mask"] == 0] = IGNORE_INDEX
                out[TOKEN_LABELS] = labels
        return self.inner(out) if self.inner is not None else out

    def for_scoring(self) -> "Tokenization":
        """The same tokenizing for transform and serving: one row in, one row out (no packing), no
        labels from the texts."""
        return replace(self, packing=False, labels_from_tokens=False, _loaded=self._loaded)

    # -- the tokenizer ---------------------------------------------------------------------------
    def _makes(self, name: str) -> bool:
        """Whether the tokenizer gives `name` (its model_input_names, as Hugging Face): GPT-2's gives no
        token_type_ids, and zeros would add wte(0) at every position. The driver applies this rule to a
        tokenizer object (driver/model_inputs.py); a path's tokenizer is first known here, loaded."""
        if name == "attention_mask" or self.tokenizer is None:
            return True
        # A tokenizer that does not say (a tokenizers.Tokenizer, a tokenizer.json) gives none: models
        # take absent token type ids as zeros (BERT) or not at all (GPT-2).
        gives = getattr(self.loaded(), "model_input_names", None)
        return gives is not None and name in gives

    def loaded(self) -> Any:
        if self._loaded is None:
            self._loaded = load_tokenizer(self.tokenizer)
        return self._loaded

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        tok = self.loaded()
        limit = None if self.packing else self.max_length
        if hasattr(tok, "encode_batch"):  # tokenizers.Tokenizer
            encoded = [e.ids for e in tok.encode_batch(texts)]
        else:  # a transformers tokenizer
            encoded = tok(texts, add_special_tokens=True, truncation=False)["input_ids"]
        return [np.asarray(ids[:limit] if limit else ids, dtype=np.int64) for ids in encoded]

    def pad_id(self) -> int:
        tok = self.loaded() if self.tokenizer is not None else None
        for name in ("pad_token_id", "eos_token_id"):
            value = getattr(tok, name, None)
            if isinstance(value, int):
                return value
        if tok is not None and hasattr(tok, "token_to_id"):
            for token in ("<pad>", "[PAD]", "<|endoftext|>", "</s>", "<eos>"):
                found = tok.token_to_id(token)
                if found is not None:
                    return int(found)
        return 0

    def eos_id(self) -> int | None:
        tok = self.loaded() if self.tokenizer is not None else None
        value = getattr(tok, "eos_token_id", None)
        if isinstance(value, int):
            return value
        if tok is not None and hasattr(tok, "token_to_id"):
            for token in ("<|endoftext|>", "</s>", "<eos>", "[SEP]"):
                found = tok.token_to_id(token)
                if found is not None:
                    return int(found)
        return None

    # -- shapes ----------------------------------------------------------------------------------
    def _padded(self, ids: list[np.ndarray]) -> dict[str, np.ndarray]:
        ids = [row[: self.max_length] for row in ids]
        width = max((len(row) for row in ids), default=0) or 1
        out = np.full((len(ids), width), self.pad_id(), dtype=np.int64)
        mask = np.zeros((len(ids), width), dtype=np.int64)
        for i, row in enumerate(ids):
            out[i, : len(row)] = row
            mask[i, : len(row)] = 1
        return {"input_ids": out, "attention_mask": mask, "token_type_ids": np.zeros_like(out)}

    def _packed(self, ids: list[np.ndarray]) -> dict[str, np.ndarray]:
        eos = self.eos_id()
        pieces = [np.append(row, eos) if eos is not None and (not len(row) or row[-1] != eos) else row for row in ids]
        stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
        block = self.max_length
        blocks = max(1, -(-len(stream) // block))
        out = np.full(blocks * block, self.pad_id(), dtype=np.int64)
        mask = np.zeros(blocks * block, dtype=np.int64)
        out[: len(stream)] = stream
        mask[: len(stream)] = 1
        shape = (blocks, block)
        return {"input_ids": out.reshape(shape), "attention_mask": mask.reshape(shape),
                "token_type_ids": np.zeros(shape, dtype=np.int64)}


def rows_keep_one_shape(tokenizer: Any, layout: Any) -> bool:
    """Whether every batch's rows have the shape the layout says (what moving rows between ranks
    needs): not with a tokenizer (each batch padded or packed to its own) or ragged columns."""
    from sparkdl.data.layout import RAGGED

    return tokenizer is None and not any(c.kind == RAGGED for c in (getattr(layout, "inputs", ()) or ()))


def load_tokenizer(tokenizer: Any) -> Any:
    """A tokenizer object as it is; a path loaded (tokenizer.json with `tokenizers`, a directory with
    transformers' AutoTokenizer)."""
    if not isinstance(tokenizer, str):
        return tokenizer
    import os

    try:
        if os.path.isdir(tokenizer):
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(tokenizer)
        from tokenizers import Tokenizer

        return Tokenizer.from_file(tokenizer)
    except Exception as exc:  # noqa: BLE001 - missing file, wrong format, library absent
        raise ModelError(f"data.tokenizer {tokenizer!r} cannot be loaded here: {type(exc).__name__}: {exc}",
                         hint="pass a tokenizer.json file or a tokenizer directory every executor can read (shared "
                              "storage), or the tokenizer object itself") from None


def check_tokenizer(tokenizer: Any) -> None:
    """data.tokenizer: an object that tokenizes, or a path (checked on the driver where it can read it)."""
    if tokenizer is None or isinstance(tokenizer, str):
        return
    if not (callable(tokenizer) or hasattr(tokenizer, "encode_batch")):
        raise ConfigError(f"data.tokenizer must be a transformers tokenizer, a tokenizers.Tokenizer or a path, got "
                          f"{type(tokenizer).__name__}", hint="for example tokenizer=AutoTokenizer.from_pretrained(dir)")
