"""Value parsers and validators of the run configuration: sizes, TOML literals, choices, names.

Split from config.py (which keeps the dataclasses and their loading); like it, imports nothing from
sparkdl but errors, so every layer may use them.
"""
from __future__ import annotations

import difflib
import math

try:
    import tomllib
except ImportError:  # Python 3.10 (Databricks runtimes before 15)
    import tomli as tomllib  # type: ignore[no-redef]
from dataclasses import fields, is_dataclass
from typing import Any, Sequence

from sparkdl.errors import ConfigError

_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30}


def parse_bytes(value: Any, key: str = "size") -> int:
    """Bytes from an int or a string such as "512MB", "2GiB" or "1.5g" (k/m/g: powers of 1024)."""
    import re

    if isinstance(value, int) and not isinstance(value, bool):
        number, unit = float(value), ""
    elif isinstance(value, str) and (match := re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)):
        number, unit = float(match.group(1)), match.group(2).lower()
    else:
        raise ConfigError(f"{key} must be a number of bytes or a size such as '512MB' or '2GiB', got {value!r}")
    if unit not in _BYTE_UNITS:
        raise ConfigError(f"{key} has an unknown unit {unit!r} in {value!r}",
                          hint="use B, KB, MB, GB, KiB, MiB or GiB")
    size = int(number * _BYTE_UNITS[unit])
    if size <= 0:
        raise ConfigError(f"{key} must be positive, got {value!r}")
    return size


def parse_literal(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def plain(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):  # data.sparse_cols' SparseInput values
        return {f.name: plain(getattr(value, f.name)) for f in fields(value)}
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', repr(value))}"
    if isinstance(value, (tuple, list)):
        return [plain(v) for v in value]  # metrics/callbacks may hold callables
    return value


def suggest(name: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    listing = ", ".join(sorted(known))
    return f"did you mean {close[0]!r}? Known: {listing}" if close else f"known: {listing}"


def positive_int(key: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{key} must be a positive integer, got {value!r}")


def check_batch_size(batch_size: Any, key: str = "data.batch_size") -> None:
    """The batch-size half of the epoch rule (data/epochs.py asks it too): at least one row per step."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ConfigError(f"{key} must be at least 1, got {batch_size!r}",
                          hint="set a positive per-worker batch_size in the training config")


def boolean(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be True or False, got {value!r}")


def choice(key: str, value: Any, allowed: Sequence[str], callable_ok: bool = False) -> None:
    if callable_ok and callable(value):
        return
    if value not in allowed:
        extra = " or a callable" if callable_ok else ""
        raise ConfigError(f"{key} must be one of {', '.join(map(repr, allowed))}{extra}; got {value!r}",
                          hint=suggest(str(value), allowed))


_SIMPLE_TYPES: dict[str, tuple[type, ...]] = {
    "bool": (bool,), "int": (int,), "float": (int, float), "str": (str,),
}


def check_types(section: str, part: Any) -> None:
    """Options read from TOML or `--set` arrive untyped: check each against its annotation."""
    for f in fields(part):
        annotation = str(f.type).replace(" ", "")
        optional = annotation.endswith("|None")
        base = annotation[: -len("|None")] if optional else annotation
        allowed = _SIMPLE_TYPES.get(base)
        value = getattr(part, f.name)
        if allowed is None:  # a table or a list: its numbers are options too
            check_finite(f"{section}.{f.name}", value)
            continue
        if value is None and optional:
            continue
        bad_bool = isinstance(value, bool) and base != "bool"
        if bad_bool or not isinstance(value, allowed):
            expected = base + (" or None" if optional else "")
            raise ConfigError(f"{section}.{f.name} must be of type {expected}, got {value!r}",
                              hint=f"see conf/defaults.toml for {section}.{f.name}")
        check_finite(f"{section}.{f.name}", value)
    if section == "train":
        for key in ("momentum", "weight_decay"):
            if getattr(part, key) < 0:
                raise ConfigError(f"train.{key} must be >= 0, got {getattr(part, key)!r}")


# Numbers whose infinity means something (approximate_min_speedup=inf: never an approximate strategy).
INFINITY_ALLOWED = frozenset({"train.approximate_min_speedup"})


def check_finite(key: str, value: Any) -> None:
    """NaN is never an option's value, nor infinity but where it means something: refused before any
    job, naming the option (a NaN timeout or learning rate otherwise fails deep in the workers).
    Tables and lists are looked into (emulate_network's gbps, early_stopping's min_delta, ...)."""
    if isinstance(value, dict):
        for name, item in value.items():
            check_finite(f"{key}.{name}", item)
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            check_finite(f"{key}[{index}]", item)
        return
    if not isinstance(value, float) or math.isfinite(value):
        return
    if math.isinf(value) and key in INFINITY_ALLOWED:
        return
    raise ConfigError(f"{key} must be a finite number, got {value!r}",
                      hint=f"give {key} a finite value, or leave it out for its default (conf/defaults.toml)")


def coerce(part: Any, name: str, value: Any) -> Any:
    if name == "islands" and isinstance(value, (list, tuple)):
        return tuple(tuple(g) if isinstance(g, (list, tuple)) else g for g in value)  # hashable, as frozen configs are
    if name in ("input_cols", "metrics", "callbacks", "max_staleness", "sparse_cols") and isinstance(value, list):
        return tuple(value)
    if name in ("feature_cols", "hidden", "emulate_speed") and not isinstance(value, (str, tuple)) \
            and not (value is None and name == "emulate_speed"):
        try:
            return tuple(value)
        except TypeError:
            raise ConfigError(f"{name} must be a list, got {value!r}") from None
    if name == "precision" and isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # --set train.precision=16 reads as a TOML integer
    current = getattr(part, name)
    if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


TENSOR_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")


def _names(key: str, value: Any) -> list[str]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value \
            or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{key} must be a non-empty list of column names (or a dict forward keyword -> column), "
                          f"got {value!r}", hint='for example input_cols=["pixels"] or {"query": "q", "doc": "d"}')
    return list(value)


def input_columns(data: Any) -> list[str]:
    """The DataFrame columns input_cols names, in forward() order."""
    cols = data.input_cols
    if isinstance(cols, dict):
        for keyword in cols:
            if not isinstance(keyword, str) or not keyword.isidentifier():
                raise ConfigError(f"data.input_cols keyword {keyword!r} is not a Python argument name",
                                  hint="the dict maps forward() argument names to columns")
        return _names("data.input_cols", list(cols.values()))
    return _names("data.input_cols", cols)


def shape_option(key: str, shape: Any) -> tuple[int, ...]:
    """A per-row shape: positive sizes, at most one -1 (inferred from the array length)."""
    if isinstance(shape, (str, bytes)) or not isinstance(shape, (list, tuple)) or not shape \
            or not all(isinstance(v, int) and not isinstance(v, bool) and (v > 0 or v == -1) for v in shape) \
            or list(shape).count(-1) > 1:
        raise ConfigError(f"{key} must be a list of positive sizes with at most one -1, got {shape!r}",
                          hint="for example input_shapes={'pixels': [1, 28, 28]}")
    return tuple(shape)


def label_shape(data: Any) -> tuple[int, ...] | None:
    """label_shapes as one shape: a list, or {label_col: list}."""
    value = data.label_shapes
    if value is None:
        return None
    if isinstance(value, dict):
        unknown = set(value) - {data.label_col}
        if unknown:
            raise ConfigError(f"data.label_shapes names {sorted(unknown)}, which is not label_col {data.label_col!r}",
                              hint=f"write label_shapes={{{data.label_col!r}: [...]}} or label_shapes=[...]")
        value = value.get(data.label_col)
        if value is None:
            return None
    return shape_option("data.label_shapes", value)


def check_input_spec(data: Any) -> None:
    """input_cols and the options that go with it (DataConfig.validate's tensor-column half)."""
    if data.feature_cols:
        raise ConfigError("data.feature_cols and data.input_cols are both set",
                          hint="pass input_cols (one tensor per column) or feature_cols (numeric columns "
                               "concatenated into one float vector), not both")
    cols = input_columns(data)
    if len(set(cols)) != len(cols):
        raise ConfigError(f"data.input_cols lists a column twice: {cols}", hint="list each input column once")
    for other, what in ((data.label_col, "label_col"), (data.weight_col, "weight_col")):
        if other is not None and other in cols:
            raise ConfigError(f"data.{what} {other!r} is also an input column", hint="remove it from input_cols")
    if data.weight_col is not None and data.weight_col == data.label_col:
        raise ConfigError(f"data.weight_col {data.weight_col!r} is the label column", hint="weight by another column")
    for key in ("input_shapes", "input_dtypes"):
        value = getattr(data, key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ConfigError(f"data.{key} must be a dict column -> value, got {value!r}",
                              hint="for example input_shapes={'pixels': [1, 28, 28]}")
        unknown = sorted(set(value) - set(cols))
        if unknown:
            raise ConfigError(f"data.{key} names {unknown}, which are not input columns {cols}",
                              hint=suggest(unknown[0], cols))
    for name, shape in (data.input_shapes or {}).items():
        shape_option(f"data.input_shapes[{name!r}]", shape)
    for name, dtype in (data.input_dtypes or {}).items():
        choice(f"data.input_dtypes[{name!r}]", dtype, TENSOR_DTYPES)
    label_shape(data)
    if data.transform_fn is not None and not callable(data.transform_fn):
        raise ConfigError(f"data.transform_fn must be a callable batch -> dict, got {data.transform_fn!r}",
                          hint="def decode(batch): return {'png': images}")
    check_rows_options(data)


def positive_int_or_zero(key: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{key} must be an integer >= 0, got {value!r}")


def check_rows_options(data: Any) -> None:
    check_batch_size(data.batch_size)
    choice("data.on_invalid", data.on_invalid, ("error", "skip"))
    if not 0.0 <= data.validation_fraction < 1.0:
        raise ConfigError(f"data.validation_fraction must be in [0, 1), got {data.validation_fraction!r}",
                          hint="for example validation_fraction=0.2")


def check_feature_spec(data: Any) -> None:
    """feature_cols and the options that go with it (DataConfig.validate's feature-vector half)."""
    for key in ("input_shapes", "input_dtypes", "transform_fn", "label_shapes"):
        if getattr(data, key):
            raise ConfigError(f"data.{key} applies to input_cols, but input_cols is not set",
                              hint="pass input_cols=[...] (one tensor per column) instead of feature_cols")
    cols = data.feature_cols
    if isinstance(cols, str):
        raise ConfigError(f"data.feature_cols must be a list of column names, got the string {cols!r}",
                          hint=f"write feature_cols=[{cols!r}]")
    if not cols and data.sparse_cols is None:  # a model of categorical inputs alone has no dense ones
        raise ConfigError("data.feature_cols is empty",
                          hint="pass feature_cols=['f0', 'f1', ...] or one array/vector column, or input_cols=[...]")
    for name in cols:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"data.feature_cols holds {name!r}, not a column name",
                              hint="every entry must be a non-empty string")
    if len(set(cols)) != len(cols):
        raise ConfigError(f"data.feature_cols lists a column twice: {list(cols)}", hint="list each feature column once")
    if data.label_col is not None and data.label_col in cols:
        raise ConfigError(f"data.label_col {data.label_col!r} is also a feature column",
                          hint="remove the label from feature_cols")
    if data.weight_col is not None and data.weight_col in cols:
        raise ConfigError(f"data.weight_col {data.weight_col!r} is also a feature column",
                          hint="remove it from feature_cols")
    if data.weight_col is not None and data.weight_col == data.label_col:
        raise ConfigError(f"data.weight_col {data.weight_col!r} is the label column", hint="weight by another column")
    check_rows_options(data)


def check_islands(value: Any) -> None:
    """train.islands: 0 (none), a count >= 2 (found from measured links), or >= 2 disjoint non-empty
    groups of host names (or executor host:port addresses)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value == 1 or value < 0:
            raise ConfigError(f"train.islands={value}: one island is plain data parallel",
                              hint="0 (no islands), a count >= 2, or groups of hosts [['h1', 'h2'], ['h3', 'h4']]")
        return
    groups = value if isinstance(value, (list, tuple)) else None
    if groups is None or len(groups) < 2 or not all(
            isinstance(g, (list, tuple)) and g and all(isinstance(h, str) and h for h in g) for g in groups):
        raise ConfigError(f"train.islands must be a count or at least two non-empty groups of host names, got "
                          f"{value!r}", hint="for example islands=[['rack1-a', 'rack1-b'], ['rack2-a', 'rack2-b']]")
    seen: set[str] = set()
    for group in groups:
        twice = seen & set(group)
        if twice:
            raise ConfigError(f"train.islands names {sorted(twice)} in two islands", hint="each host in one island")
        seen |= set(group)


def check_text_options(data: Any) -> None:
    """data.tokenizer, max_length and packing (text columns, data/text.py)."""
    tokenizer = data.tokenizer
    if not isinstance(data.max_length, int) or isinstance(data.max_length, bool) or data.max_length < 1:
        raise ConfigError(f"data.max_length must be a positive integer (tokens per row), got {data.max_length!r}",
                          hint="for example max_length=128")
    boolean("data.packing", data.packing)
    if tokenizer is None:
        if data.packing:
            raise ConfigError("data.packing=True needs data.tokenizer (it joins and cuts tokenized texts)",
                              hint="pass tokenizer=... (a tokenizer object or a tokenizer.json path)")
        return
    if not isinstance(tokenizer, str) and not (callable(tokenizer) or hasattr(tokenizer, "encode_batch")):
        raise ConfigError(f"data.tokenizer must be a transformers tokenizer, a tokenizers.Tokenizer or a path, got "
                          f"{type(tokenizer).__name__}", hint="for example tokenizer=AutoTokenizer.from_pretrained(d)")
    if isinstance(tokenizer, str) and not tokenizer:
        raise ConfigError("data.tokenizer is an empty path", hint="pass a tokenizer.json path or a tokenizer directory")
    if data.input_cols is None:
        raise ConfigError("data.tokenizer needs input_cols naming the text column(s)",
                          hint='for example input_cols=["text"] (or {"input_ids": "text"})')
    if data.packing and data.weight_col is not None:
        raise ConfigError("data.packing=True joins rows into blocks, so data.weight_col's per-row weights cannot apply",
                          hint="drop weight_col, or packing")
    if data.packing and data.label_col is not None:
        raise ConfigError(f"data.packing=True trains on the texts' own tokens, but label_col={data.label_col!r} is set",
                          hint="pass label_col=None with packing (causal language models), or packing=False")
