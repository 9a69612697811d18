"""Rules over more than one section: merging option values into a section (coerced, unknown names
refused with a suggestion), the checks that tie data, train and launch together, and the train
section a resolved plan trains with. Used by RunConfig and by the driver's planning stage, which
works on sections, never on a whole RunConfig."""
from __future__ import annotations

from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any, Mapping, TypeVar

from sparkdl.config.elastic import check_elastic
from sparkdl.config.training import check_spool
from sparkdl.config.values import coerce, suggest
from sparkdl.errors import ConfigError

if TYPE_CHECKING:
    from sparkdl.config.sections import DataConfig, LaunchConfig, TrainConfig

Section = TypeVar("Section")  # one of the frozen section dataclasses


def merged_section(name: str, part: Section, values: Mapping[str, Any]) -> Section:
    """`part` (the section called `name`) with `values` applied and coerced; unknown names raise
    with a suggestion. The one merge rule: RunConfig.merged and the planner's stages use it."""
    if not isinstance(values, Mapping):
        raise ConfigError(f"config section {name!r} must be a table of options, got {values!r}")
    names = [f.name for f in fields(part)]
    for key in values:
        if key not in names:
            raise ConfigError(f"unknown option {name}.{key}", hint=suggest(key, names))
    return replace(part, **{k: coerce(part, k, v) for k, v in values.items()})


def check_across_sections(data: DataConfig, train: TrainConfig, launch: LaunchConfig) -> None:
    """The rules that tie the data, train and launch sections together (each section's own rules
    are its `validate`)."""
    stages, workers = train.stages, launch.num_workers
    hybrid = train.implied_strategy == "hybrid"
    if hybrid and stages and workers % stages:
        divisors = [k for k in range(2, workers + 1) if workers % k == 0]
        raise ConfigError(f"train.stages={stages} does not divide launch.num_workers={workers}: hybrid runs "
                          "stages x replicas ranks",
                          hint=f"use stages in {divisors}" if divisors else "use num_workers >= 2")
    check_spool(data.spool, train)
    check_elastic(launch, train)
    if train.batch_balance == "dynamic" and data.tokenizer is not None:
        raise ConfigError("train.batch_balance='dynamic' moves rows between ranks as tensors of one shape, but "
                          "data.tokenizer pads (or packs) each batch to its own shape",
                          hint="use batch_balance='equal' (or 'speed': shares fixed at the start)")
    if train.batch_balance == "dynamic" and launch.backend == "horovod":
        raise ConfigError("train.batch_balance='dynamic' moves rows between ranks point to point, which "
                          "launch.backend='horovod' cannot", hint="use backend='torch' (gloo/NCCL)")
    if hybrid and workers < 2:
        raise ConfigError("strategy='hybrid' needs num_workers >= 2 (one rank per pipeline stage)",
                          hint="raise num_workers, or use strategy='data_parallel'")


def train_with(data: DataConfig, train: TrainConfig, launch: LaunchConfig, values: Mapping[str, Any]) -> TrainConfig:
    """The train section with `values` merged in and checked, on its own and against data and launch."""
    merged = merged_section("train", train, values)
    merged.validate()  # types and finiteness included
    check_across_sections(data, merged, launch)
    return merged
