"""Pretrained weights where they live: `sparkdl.pretrained(path)` names a Hugging Face model
directory every executor can read (shared storage, a Databricks Volume, a local cache laid out
alike on every host) instead of handing over a loaded model.

Only the path and the options travel in the task closures. Each rank reads the weights itself
(`from_pretrained`, under the run seed, so an adapter added on top starts alike everywhere). The
driver builds the architecture from the directory's config (`from_config`: its weights are not
read) to probe the model on sample rows and plan; the trained weights come back from the ranks as
for any model. Frozen parameters (a PEFT adapter's base) are never sent back, so for such a model
the driver reads the weights from the path once, for the returned model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from sparkdl.errors import ModelError

AUTO_CLASSES = {"causal_lm": "AutoModelForCausalLM", "sequence_classification": "AutoModelForSequenceClassification",
                "token_classification": "AutoModelForTokenClassification", "masked_lm": "AutoModelForMaskedLM",
                "embedding": "AutoModel", "seq2seq_lm": "AutoModelForSeq2SeqLM"}


@dataclass(frozen=True)
class Pretrained:
    """A model to load from `path` where it trains (a zero-argument factory, as model= takes)."""

    path: str
    task: str = "causal_lm"  # AUTO_CLASSES key, or a transformers class name ("GPT2LMHeadModel")
    options: tuple[tuple[str, Any], ...] = ()  # from_pretrained / from_config keyword options (num_labels=2, ...)
    adapter: Any = None  # a peft config (LoraConfig(...)): get_peft_model on top of the loaded model

    def __call__(self) -> nn.Module:
        """The model with its weights read from the path (ranks)."""
        try:
            model = self._class().from_pretrained(self.path, **dict(self.options))
        except (OSError, ValueError) as exc:
            raise ModelError(f"the pretrained model at {self.path!r} cannot be loaded here: {exc}",
                             hint="the path must be readable by every executor (shared storage, a Volume, or the "
                                  "same local directory on every host)") from None
        return self._adapted(model)

    def skeleton(self) -> nn.Module:
        """The architecture from the path's config, weights not read (the driver's copy)."""
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(self.path, **dict(self.options))
        except (OSError, ValueError) as exc:
            raise ModelError(f"no model config at {self.path!r} (read on the driver): {exc}",
                             hint="pass the directory save_pretrained wrote (config.json beside the weights)") from None
        return self._adapted(self._class().from_config(config))

    def driver_copy(self) -> nn.Module:
        """The driver's copy: the skeleton, unless some parameters are frozen (an adapter's base, or
        layers the model freezes): those never come back from the ranks, so the driver reads the
        weights once, for the returned model."""
        skeleton = self.skeleton()
        if all(p.requires_grad for p in skeleton.parameters()):
            return skeleton
        del skeleton
        return self()

    def model_class(self) -> Any:
        """The transformers class the path loads into (an Auto class resolved from the config)."""
        found = self._class()
        if found.__name__.startswith("Auto"):
            from transformers import AutoConfig

            try:
                config = AutoConfig.from_pretrained(self.path)
                return found._model_mapping[type(config)]
            except (OSError, ValueError, KeyError):
                return found
        return found

    def _class(self) -> Any:
        import transformers

        name = AUTO_CLASSES.get(self.task, self.task)
        found = getattr(transformers, name, None)
        if found is None:
            raise ModelError(f"pretrained task {self.task!r} names no transformers class",
                             hint=f"use one of {sorted(AUTO_CLASSES)} or a class name such as 'GPT2LMHeadModel'")
        return found

    def _adapted(self, model: nn.Module) -> nn.Module:
        if self.adapter is None:
            return model
        from peft import get_peft_model

        return get_peft_model(model, self.adapter)


def pretrained(path: str, task: str = "causal_lm", adapter: Any = None, **options: Any) -> Pretrained:
    """model= for a Hugging Face model saved at `path`, loaded on the executors (module docstring)."""
    if not isinstance(path, str) or not path:
        raise ModelError(f"pretrained() needs the model directory's path, got {path!r}")
    return Pretrained(path=path, task=task, options=tuple(sorted(options.items())), adapter=adapter)


def driver_model(model: Any) -> Any:
    """What the driver builds for `model` (build_model's argument): a Pretrained's driver_copy
    factory; anything else as it is."""
    return model.driver_copy if isinstance(model, Pretrained) else model
