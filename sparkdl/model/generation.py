"""What a language model gives back besides its logits: generated text and pooled embeddings.
Used by transform (tracking/inference.py) and the MLflow model (tracking/serving.py) alike, batch
by batch on the executors (a GPU when the task has one).

Generation follows the model's own `generate` where it has one (Hugging Face and PEFT models),
else a plain loop over model/calling's output rule (greedy, or sampling from the softmax). Batches
arrive right-padded (data/text.py); a decoder generates from left-padded rows, so each row's
tokens are moved to the right end first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sparkdl.errors import ConfigError
from sparkdl.model.calling import forward_parameters, output_of


@dataclass(frozen=True)
class Generation:
    """transform's text output: up to max_new_tokens per row, greedy unless do_sample (seeded)."""

    max_new_tokens: int = 32
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def validate(self) -> None:
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature > 0:
            raise ConfigError(f"temperature must be a positive number, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0: off), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")


def left_padded(input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded rows moved to the right end (what a decoder generates from)."""
    lengths = attention_mask.sum(dim=1)
    width = input_ids.shape[1]
    ids = torch.full_like(input_ids, pad_id)
    mask = torch.zeros_like(attention_mask)
    for row, length in enumerate(lengths.tolist()):
        ids[row, width - length:] = input_ids[row, :length]
        mask[row, width - length:] = 1
    return ids, mask


def generate_ids(module: Any, inputs: dict[str, torch.Tensor], settings: Generation, pad_id: int,
                 eos_id: int | None, batch_index: int = 0) -> list[list[int]]:
    """The new tokens of each row (the prompt left out), stopping at end-of-text."""
    ids, mask = left_padded(inputs["input_ids"], inputs.get("attention_mask", torch.ones_like(inputs["input_ids"])),
                            pad_id)
    generator_seed = settings.seed + batch_index
    torch.manual_seed(generator_seed)
    if hasattr(module, "generate"):
        options: dict[str, Any] = {"max_new_tokens": settings.max_new_tokens, "do_sample": settings.do_sample,
                                   "pad_token_id": pad_id}
        if eos_id is not None:
            options["eos_token_id"] = eos_id
        if settings.do_sample:
            options.update(temperature=settings.temperature, top_k=settings.top_k or None, top_p=settings.top_p)
        out = module.generate(input_ids=ids, attention_mask=mask, **options)
    else:
        out = _plain_generate(module, ids, mask, settings, eos_id)
    new = out[:, ids.shape[1]:].tolist()
    return [_until_end(row, eos_id, pad_id) for row in new]


def _plain_generate(module: Any, ids: torch.Tensor, mask: torch.Tensor, settings: Generation,
                    eos_id: int | None) -> torch.Tensor:
    """A model without `generate`: one forward per new token over the whole sequence."""
    keywords = _takes_mask(module)
    done = torch.zeros(ids.shape[0], dtype=torch.bool)
    for _ in range(settings.max_new_tokens):
        inputs = {"input_ids": ids, "attention_mask": mask} if keywords else ids
        logits = output_of(module, inputs)[:, -1, :].float()
        if settings.do_sample:
            probabilities = torch.softmax(logits / settings.temperature, dim=-1)
            token = torch.multinomial(probabilities, 1).squeeze(1)
        else:
            token = logits.argmax(dim=-1)
        if eos_id is not None:
            token = torch.where(done, torch.full_like(token, eos_id), token)
            done |= token == eos_id
        ids = torch.cat([ids, token[:, None]], dim=1)
        mask = torch.cat([mask, torch.ones_like(token)[:, None]], dim=1)
        if bool(done.all()):
            break
    return ids


def _takes_mask(module: Any) -> bool:
    names, varkw = forward_parameters(module)
    return "input_ids" in names and ("attention_mask" in names or varkw)


def _until_end(row: list[int], eos_id: int | None, pad_id: int) -> list[int]:
    if eos_id is not None and eos_id in row:
        row = row[: row.index(eos_id)]
    return row


def pooled_embeddings(module: Any, inputs: dict[str, torch.Tensor] | Any) -> torch.Tensor:
    """One vector per row: the last hidden states averaged over the row's real tokens (the
    attention mask), as sentence embedders pool; a model whose output is already (B, d) as it is."""
    mask = inputs.get("attention_mask") if isinstance(inputs, dict) else None
    encoder = _encoder(module)
    if isinstance(inputs, dict):
        names, varkw = forward_parameters(encoder)
        out = encoder(**{k: v for k, v in inputs.items() if varkw or k in names})
    else:
        out = encoder(inputs)
    hidden = _last_hidden(out)
    if hidden.dim() == 2:
        return hidden.float()
    if mask is None:
        return hidden.float().mean(dim=1)
    weights = mask.to(hidden.dtype).unsqueeze(-1)
    return ((hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1)).float()


def _encoder(module: Any) -> Any:
    """The model under its head, whose output is the hidden states (a Hugging Face model's
    `base_model`, inside a PEFT wrapper's `get_base_model()`, adapters included); the model itself
    where it has none. (Asking the whole model for output_hidden_states instead leaves capture hooks
    on it that no longer pickle.)"""
    inner = module.get_base_model() if callable(getattr(module, "get_base_model", None)) else module
    base = getattr(inner, "base_model", None)
    return base if isinstance(base, torch.nn.Module) and base is not inner else inner


def _last_hidden(output: Any) -> torch.Tensor:
    from collections.abc import Mapping

    from sparkdl.model.calling import primary_output

    if isinstance(output, Mapping):
        if "last_hidden_state" in output:
            return output["last_hidden_state"]
        states = output.get("hidden_states")
        if states:
            return states[-1]
    return primary_output(output)
