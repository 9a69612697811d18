"""Binding a run's input columns to the model's forward() (driver, before data preparation).

- A tokenizer (`data.tokenizer`) makes its columns' ids the `input_ids` keyword (or the keyword the
  user gave) and adds the attention mask (and token type ids) where forward() takes them; the
  tokenizing itself runs per batch wherever batches are made (data/text.Tokenization, which
  becomes the run's transform_fn, the user's own transform_fn after it).
- input_cols given as a list is bound by name when every column is named after a forward
  parameter, or onto the first parameters when the model computes its own loss (loss="model":
  its labels go by keyword); model/calling.bound_inputs holds that rule.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from sparkdl.config import DataConfig, TrainConfig
from sparkdl.config.values import input_columns
from sparkdl.errors import ConfigError

_TOKENIZER_OUTPUTS = ("attention_mask", "token_type_ids")


def bind_model_inputs(data: DataConfig, train: TrainConfig, model: Any) -> DataConfig:
    """`data` with input_cols bound to the model's keywords and, with a tokenizer, the tokenizing
    transform in place of transform_fn."""
    if data.input_cols is None:
        return data
    from torch import nn

    from sparkdl.model.calling import bound_inputs, forward_parameters
    from sparkdl.model.pretrained import Pretrained

    module = model if isinstance(model, nn.Module) else None
    if isinstance(model, Pretrained):  # its class's forward: the weights are not read on the driver
        module = model.model_class()
    if data.tokenizer is not None:
        return _with_tokenizer(data, train, module)
    if isinstance(data.input_cols, dict) or module is None:
        if train.loss == "model" and not isinstance(data.input_cols, dict) and module is None:
            raise ConfigError("loss='model' passes the labels to forward() by keyword, so the inputs need keywords too",
                              hint='pass input_cols as a dict, e.g. {"input_ids": "tokens", "attention_mask": "mask"}')
        return data
    bound = bound_inputs(module, tuple(data.input_cols), train.loss == "model")
    if bound is None and train.loss == "model":
        names, _ = forward_parameters(module)
        raise ConfigError(f"loss='model' passes the labels to forward() by keyword, and input_cols "
                          f"{list(data.input_cols)} cannot be bound to forward{names}",
                          hint="pass input_cols as a dict {forward keyword: column}")
    return replace(data, input_cols=bound) if bound is not None else data


def _with_tokenizer(data: DataConfig, train: TrainConfig, module: Any) -> DataConfig:
    from sparkdl.data.text import Tokenization
    from sparkdl.model.calling import forward_parameters

    columns = input_columns(data)
    if isinstance(data.input_cols, dict):
        keys = tuple(data.input_cols)
    elif len(columns) == 1:
        keys = ("input_ids",)
    else:
        raise ConfigError(f"data.tokenizer with several input columns {columns} needs to know each one's forward "
                          "keyword", hint='pass input_cols as a dict, e.g. {"input_ids": "text"}')
    names, varkw = forward_parameters(module) if module is not None else ((), True)
    extra = tuple(o for o in _TOKENIZER_OUTPUTS if varkw or o in names) if names or varkw else ("attention_mask",)
    if module is None:
        extra = ("attention_mask",)
    gives = getattr(data.tokenizer, "model_input_names", None)
    if gives is not None and "token_type_ids" not in gives:  # as Hugging Face: a tokenizer that makes none (GPT-2's)
        extra = tuple(o for o in extra if o != "token_type_ids")  # passes none (GPT-2 adds wte(0) for zeros)
    tokenize = Tokenization(tokenizer=data.tokenizer, columns=columns, keys=keys, max_length=data.max_length,
                            packing=data.packing, extra_outputs=extra, labels_from_tokens=data.label_col is None,
                            inner=data.transform_fn)
    return replace(data, input_cols=dict(zip(keys, columns)), transform_fn=tokenize)
