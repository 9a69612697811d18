"""config: the run's options as frozen sections (data, train, launch, input, output, model, tracking),
their values and the rules each section's options obey on their own.

Owns: sections.py (the dataclasses, RunConfig, TOML and `a.b=c` overrides, flat keywords),
values.py (parsers of sizes, literals, choices), training.py (training-essential options),
elastic.py (spot-safe runs), sparse.py (data.sparse_cols: categorical inputs and their tables),
embeddings.py (the embeddings section: how those tables train),
merging.py (rules over several sections: the one merge of option values into a section, the data/train/launch checks, the train section a kept plan trains with).
May import: sparkdl.errors only. Imported by everything above it.
`from sparkdl.config import RunConfig` is the public path.
"""
from __future__ import annotations

from sparkdl.config.sections import (BACKENDS, LOSSES, OPTIMIZERS, STRATEGIES, DataConfig, InputConfig, LaunchConfig,
                                     ModelConfig, OutputConfig, RunConfig, TrackingConfig, TrainConfig, option_owners,
                                     parse_bytes, parse_literal, suggest)
from sparkdl.config.merging import merged_section, train_with
from sparkdl.config.sparse import SparseInput
from sparkdl.config.embeddings import EmbeddingConfig

__all__ = ["DataConfig", "TrainConfig", "LaunchConfig", "TrackingConfig", "InputConfig", "OutputConfig",
           "ModelConfig", "RunConfig", "SparseInput", "EmbeddingConfig", "merged_section", "train_with", "option_owners", "parse_bytes", "parse_literal", "suggest",
           "BACKENDS", "LOSSES", "OPTIMIZERS", "STRATEGIES"]
