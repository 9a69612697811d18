"""A Hugging Face transformer cut into an ordered list of layers between its blocks.

`transformer_layers(model)` returns a `TransformerCut` (or None for a model of no known family):
`.layers`, run one after the other on the model's inputs, give exactly the model's own logits
(`model(input_ids, attention_mask=...).logits`): the embeddings first, one layer per decoder or
encoder block, the final norm and head last. Every layer holds the model's own submodules (no
copies), registered under their paths in the model, so a layer's `state_dict()` keys are the
model's own keys (`transformer.h.3.attn.c_attn.weight`). Pipeline stages (strategies/hybrid.py)
and layer-by-layer sharding reuse it.

Families are found from the module structure (the ModuleList of blocks and the modules beside it),
not from class names, in the model or the shallowest module under it (a PEFT model is cut under its
own keys, `base_model.model.transformer.h.0...`, its adapters inside the blocks):
- GPT-2: `wte`, `wpe`, `h`, `ln_f` (+ `lm_head` on the *LMHeadModel), at the top or under a child;
- Llama / Mistral / Qwen-style: `embed_tokens`, `layers`, `norm`, `rotary_emb` (+ `lm_head`);
- BERT-style encoders: `embeddings`, `encoder.layer` (+ `pooler`, `dropout`, `classifier`).

Between layers one float tensor travels: the hidden states (B, T, H) with the 2-D attention mask
appended as one more channel (B, T, H + 1). Each block rebuilds the attention mask (and rotary
position embeddings) from that channel exactly as the model's own forward does, so a pipeline
boundary still sends one tensor and every stage sees the mask. Position ids are always
0..T-1 (what the models use when none are given).

Tied weights (the LM head sharing the token embedding) are listed in `.tied`: groups of (layer
index, key) that are one tensor in the model. Where those layers train in different processes
the holders must sum the tensor's gradient (Megatron's rule) to stay equal.

`transformers` is imported lazily (inside forward), so this module loads without it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from sparkdl.errors import ModelError

LOOKED_FOR = ("a ModuleList of blocks at `h` beside `wte`, `wpe`, `ln_f` (GPT-2), at `layers` beside `embed_tokens`, "
              "`norm`, `rotary_emb` (Llama, Mistral, Qwen), or at `encoder.layer` beside `embeddings` (BERT), in the "
              "model or a module under it")
_HEADS = ("lm_head", "dropout", "classifier")  # top-level modules a cut knows how to apply after the blocks


class _Path(nn.Module):
    """A container standing for one level of the model's module path (never called)."""


def _register(owner: nn.Module, path: str, module: nn.Module) -> None:
    """`module` as a submodule of `owner` under the dotted `path` (containers made on the way), so
    state_dict keys come out as in the model."""
    *parents, leaf = path.split(".")
    node = owner
    for name in parents:
        child = node._modules.get(name)
        if child is None:
            child = _Path()
            node.add_module(name, child)
        node = child
    node.add_module(leaf, module)


class CutLayer(nn.Module):
    """One layer of a cut. `parts` (path in the model, module) are registered under their paths;
    `self._cut_parts` keeps them in order for forward (a tuple: not registered twice)."""

    def __init__(self, parts: Sequence[tuple[str, nn.Module | None]], hf_config: Any) -> None:
        super().__init__()
        present = [(path, module) for path, module in parts if module is not None]
        for path, module in present:
            _register(self, path, module)
        # Underscored names: a model path's first part (`layers`, `model`, ...) becomes a child's name.
        self._cut_paths = tuple(path for path, _ in present)
        self._cut_parts = tuple(module for _, module in parts)  # None kept: a missing optional part
        self._cut_config = hf_config


def _pack(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.cat([hidden, mask.to(hidden.dtype).unsqueeze(-1)], dim=-1)


def _unpack(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden states in the model's dtype, 2-D long attention mask). A bf16 pipeline boundary
    sends bf16; the residual stream continues in the model's own dtype, as in the whole model."""
    hidden = x[..., :-1]
    if hidden.dtype != dtype and hidden.is_floating_point():
        hidden = hidden.to(dtype)
    return hidden, (x[..., -1].detach() > 0.5).long()


def _dtype(module: nn.Module) -> torch.dtype:
    for param in module.parameters():
        return param.dtype
    return torch.float32


def _positions(hidden: torch.Tensor) -> torch.Tensor:
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


def _first_tensor(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


class Embeddings(CutLayer):
    """The first layer: the model's inputs (input_ids, attention_mask, token_type_ids) -> packed."""

    def __init__(self, parts: Sequence[tuple[str, nn.Module | None]], hf_config: Any, family: str) -> None:
        super().__init__(parts, hf_config)
        self._family = family

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, **unsupported: Any) -> torch.Tensor:
        if unsupported:
            raise ModelError(f"a transformer cut into pipeline layers takes input_ids, attention_mask and token_type_ids; "
                             f"it was also given {sorted(unsupported)}",
                             hint="drop those inputs from input_cols, or train with strategy='data_parallel'")
        if input_ids.dim() != 2:
            raise ModelError(f"input_ids must be (batch, tokens), got shape {list(input_ids.shape)}",
                             hint="give a column of token id arrays of one length per batch")
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.reshape(input_ids.shape)
        if self._family == "gpt2":
            wte, wpe, drop = self._cut_parts
            embeds = wte(input_ids)
            hidden = embeds + wpe(_positions(embeds)).to(embeds.device)
            if token_type_ids is not None:
                hidden = hidden + wte(token_type_ids.reshape(input_ids.shape))
            hidden = drop(hidden)
        elif self._family == "llama":
            (embed_tokens,) = self._cut_parts
            if token_type_ids is not None:
                raise ModelError("this model takes no token_type_ids", hint="drop the column from input_cols")
            hidden = embed_tokens(input_ids)
        else:
            (embeddings,) = self._cut_parts
            hidden = embeddings(input_ids=input_ids, token_type_ids=token_type_ids)
        return _pack(hidden, mask)


class Block(CutLayer):
    """One decoder or encoder block: packed -> packed, the attention mask rebuilt as the model does."""

    def __init__(self, parts: Sequence[tuple[str, nn.Module | None]], hf_config: Any, family: str, index: int) -> None:
        super().__init__(parts, hf_config)
        self._family, self._index = family, index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        block = self._cut_parts[0]
        hidden, mask = _unpack(x, _dtype(block))
        positions = _positions(hidden)
        attention = _mask_function(self._cut_config, self._family, self._index)(
            config=self._cut_config, inputs_embeds=hidden, attention_mask=mask, cache=None, position_ids=positions)
        if self._family == "gpt2":
            out = block(hidden, attention_mask=attention, use_cache=False, position_ids=positions)
        elif self._family == "llama":
            rotary = self._cut_parts[1]
            out = block(hidden, attention_mask=attention, position_ids=positions, use_cache=False,
                        position_embeddings=rotary(hidden, position_ids=positions))
        else:
            out = block(hidden, attention)
        return _pack(_first_tensor(out), mask)


class Head(CutLayer):
    """The last layer: packed -> the model's logits (final norm, pooler, dropout, head: those present)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        modules = [m for m in self._cut_parts if m is not None]
        hidden, _ = _unpack(x, _dtype(self) if modules else x.dtype)
        for module in modules:
            hidden = module(hidden)
        return hidden


def _mask_function(hf_config: Any, family: str, index: int) -> Callable[..., Any]:
    """The mask the model builds for block `index`: bidirectional for encoders, causal (sliding
    window where the config says so: per layer type, or a model-wide window) for decoders."""
    from transformers import masking_utils

    if family == "bert":
        return masking_utils.create_causal_mask if getattr(hf_config, "is_decoder", False) \
            else masking_utils.create_bidirectional_mask
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types:
        sliding = layer_types[index] == "sliding_attention"
    else:
        sliding = family == "llama" and getattr(hf_config, "sliding_window", None) is not None
    return masking_utils.create_sliding_window_causal_mask if sliding else masking_utils.create_causal_mask


@dataclass(frozen=True)
class TransformerCut:
    """`layers`: run in order they give the model's logits; `tied`: groups of (layer index, key)
    naming one tensor held by several layers (the token embedding and the LM head)."""

    family: str  # "gpt2", "llama" or "bert"
    layers: tuple[CutLayer, ...]
    tied: tuple[tuple[tuple[int, str], ...], ...]

    def sequential(self) -> nn.Sequential:
        """The layers as an nn.Sequential (its state_dict keys are prefixed by layer index; use
        `stage` for the model's own keys)."""
        return nn.Sequential(*self.layers)

    def stage(self, indices: Iterable[int]) -> "CutStage":
        return CutStage([self.layers[i] for i in indices])

    def keys(self, index: int) -> tuple[str, ...]:
        """The model's state_dict keys layer `index` holds."""
        return tuple(self.layers[index].state_dict(keep_vars=True))


class CutStage(nn.Module):
    """Consecutive layers of a cut as one module whose state_dict keys are the model's own: the
    layers' submodules registered under their model paths; forward runs the layers in order (the
    first takes the stage's inputs: the model's, or the previous stage's packed tensor)."""

    def __init__(self, layers: Sequence[CutLayer]) -> None:
        super().__init__()
        for layer in layers:
            for path, module in zip(layer._cut_paths, (m for m in layer._cut_parts if m is not None)):
                _register(self, path, module)
        self._cut_layers = tuple(layers)  # not registered: their modules are, above, under the model's paths

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        x = self._cut_layers[0](*args, **kwargs)
        for layer in self._cut_layers[1:]:
            x = layer(x)
        return x


def _blocks(base: nn.Module) -> tuple[str, str, nn.ModuleList] | None:
    """(family, path of the blocks under base, the blocks) by structure."""
    def has(*names: str) -> bool:
        return all(getattr(base, n, None) is not None for n in names)

    if isinstance(getattr(base, "h", None), nn.ModuleList) and has("wte", "wpe", "ln_f"):
        return "gpt2", "h", base.h
    if isinstance(getattr(base, "layers", None), nn.ModuleList) and has("embed_tokens", "norm", "rotary_emb"):
        return "llama", "layers", base.layers
    encoder = getattr(base, "encoder", None)
    if isinstance(getattr(encoder, "layer", None), nn.ModuleList) and has("embeddings"):
        return "bert", "encoder.layer", encoder.layer
    return None


def _find_base(model: nn.Module) -> tuple[str, nn.Module | None, str, nn.Module, tuple[str, str, nn.ModuleList]] | None:
    """(path prefix of the task model, the task model (None: the base is the model itself), path
    prefix of the base model, the base, its blocks): the shallowest module of a known family, so a
    wrapper (a PEFT model: base_model.model.transformer) is cut with its own keys."""
    found = None
    for name, module in model.named_modules():
        blocks = _blocks(module)
        if blocks is not None and (found is None or name.count(".") < found[0].count(".")):
            found = (name, module, blocks)
    if found is None:
        return None
    name, base, blocks = found
    if not name:
        return "", None, "", base, blocks
    parent = name.rpartition(".")[0]
    return (parent + "." if parent else ""), model.get_submodule(parent), name + ".", base, blocks


def transformer_layers(model: nn.Module) -> TransformerCut | None:
    """The cut of a model of a known family (module docstring), or None when no family matches.
    A model that matches but holds modules the cut would not run raises ModelError."""
    if isinstance(model, nn.Sequential):
        return None
    located = _find_base(model)
    if located is None:
        return None
    top_prefix, top, prefix, base, (family, blocks_path, blocks) = located
    hf_config = getattr(base, "config", None) or getattr(top, "config", None)
    if hf_config is None:
        raise ModelError(f"{type(model).__name__} looks like a {family} transformer but has no `config`",
                         hint="pass the Hugging Face model itself (a PreTrainedModel)")
    if top is not None:
        _check_known_children(top, prefix[len(top_prefix):-1], family)
    count = min(len(blocks), int(getattr(hf_config, "num_hidden_layers", len(blocks)) or len(blocks)))
    p = prefix
    if family == "gpt2":
        first = Embeddings([(p + "wte", base.wte), (p + "wpe", base.wpe), (p + "drop", base.drop)], hf_config, family)
        extra: list[tuple[str, nn.Module | None]] = []
        tail = [(p + "ln_f", base.ln_f)]
    elif family == "llama":
        first = Embeddings([(p + "embed_tokens", base.embed_tokens)], hf_config, family)
        extra = [(p + "rotary_emb", base.rotary_emb)]
        tail = [(p + "norm", base.norm)]
    else:
        first = Embeddings([(p + "embeddings", base.embeddings)], hf_config, family)
        extra = []
        classifier = getattr(top, "classifier", None) if top is not None else None
        tail = [(p + "pooler", getattr(base, "pooler", None) if classifier is not None else None)]
    if top is not None:  # the task head, applied after the base model as the *For* classes do
        tail += [(top_prefix + name, getattr(top, name, None)) for name in _HEADS]
    layers: list[CutLayer] = [first]
    layers += [Block([(f"{p}{blocks_path}.{i}", blocks[i]), *extra], hf_config, family, i) for i in range(count)]
    layers.append(Head(tail, hf_config))
    _check_coverage(model, layers)
    return TransformerCut(family=family, layers=tuple(layers), tied=_tied(layers))


def cut_transformer(model: nn.Module, purpose: str = "cut into pipeline stages") -> TransformerCut:
    """transformer_layers, or a ModelError naming what was looked for."""
    cut = transformer_layers(model)
    if cut is None:
        raise ModelError(f"{type(model).__name__} cannot be {purpose}: looked for {LOOKED_FOR}, found none",
                         hint="pass a GPT-2, Llama-style or BERT-style Hugging Face model, an nn.Sequential, or a "
                              "list of stage modules")
    return cut


def _check_known_children(top: nn.Module, base_name: str, family: str) -> None:
    """A module beside the base the cut does not know (GPT2DoubleHeadsModel's second head, a
    sequence classifier's `score` that reads input_ids) would silently be left out: refused by name."""
    unknown = [name for name, _ in top.named_children() if name != base_name and name not in _HEADS]
    if unknown:
        raise ModelError(f"{type(top).__name__} ({family} blocks under `{base_name}`) has head module(s) {unknown} a "
                         f"pipeline cut does not know how to run (it knows {list(_HEADS)})",
                         hint="train it with strategy='data_parallel' or 'sharded', or pass the base model with "
                              "your head as an nn.Sequential")


def _check_coverage(model: nn.Module, layers: Sequence[CutLayer]) -> None:
    """Every persistent tensor of the model lives in some layer (else training would drop it)."""
    held = {key for layer in layers for key in layer.state_dict(keep_vars=True)}
    missing = [key for key in model.state_dict(keep_vars=True) if key not in held]
    if missing:
        raise ModelError(f"{type(model).__name__} holds tensors outside the blocks, embeddings and head a pipeline "
                         f"cut runs: {missing[:5]}{' ...' if len(missing) > 5 else ''}",
                         hint="train it with strategy='data_parallel' or 'sharded'")


def _tied(layers: Sequence[CutLayer]) -> tuple[tuple[tuple[int, str], ...], ...]:
    """Parameters that are one tensor in several layers, as groups of (layer index, key)."""
    holders: dict[int, list[tuple[int, str]]] = {}
    for index, layer in enumerate(layers):
        for key, param in layer.named_parameters(remove_duplicate=False):
            entries = holders.setdefault(id(param), [])
            if all(i != index for i, _ in entries):
                entries.append((index, key))
    return tuple(tuple(entries) for entries in holders.values() if len(entries) > 1)


def check_cut(model: nn.Module, cut: TransformerCut, inputs: Any, atol: float = 1e-4) -> None:
    """The cut's output equals the model's own logits on `inputs` (a tensor of input_ids or a dict
    of the model's keyword inputs), in eval mode; a family variant the cut does not reproduce
    (an embedding scale, a logit cap) raises instead of training a different model."""
    from sparkdl.model.calling import call_model, primary_output

    if any(p.is_meta for p in model.parameters()):
        return  # weights loaded where the model trains: nothing to compare here
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            expected = primary_output(call_model(model, inputs))
            got = call_model(cut.sequential(), inputs)
    finally:
        model.train(was_training)
    if not isinstance(expected, torch.Tensor) or expected.shape != got.shape or \
            not torch.allclose(got.float(), expected.float(), atol=atol, rtol=1e-3):
        difference = float((got.float() - expected.float()).abs().max()) if isinstance(expected, torch.Tensor) and \
            expected.shape == got.shape else float("nan")
        raise ModelError(f"{type(model).__name__} cut into {cut.family} pipeline layers does not reproduce its own "
                         f"output (largest difference {difference:.3g})",
                         hint="this variant of the family is not supported by the cut: train it with "
                              "strategy='data_parallel' or 'sharded'")


def cut_if_known(model: nn.Module) -> TransformerCut | None:
    """transformer_layers, with a model the cut refuses taken as no transformer: for callers that
    then treat the model by its structure (the planner's layers, DiLoCo's fragments), not train it cut."""
    try:
        return transformer_layers(model)
    except Exception:  # noqa: BLE001 - any refusal (ModelError, or an odd module's own error) means "not one"
        return None
