"""sparkdl's options as Spark ML Params: what ParamGridBuilder, CrossValidator, TrainValidationSplit,
explainParams() and Pipeline persistence work with.

Every RunConfig option is a Param of the estimator under its own name (`est.lr`, `est.batch_size`),
documented from conf/defaults.toml, with a default from the estimator's base config; the column
options also answer to Spark's usual names (featuresCol, labelCol, predictionCol, weightCol,
probabilityCol, rawPredictionCol). The RunConfig of a fit is built from the Params, so a copy with
an extra ParamMap (what a tuning grid does) trains with those values.
"""
from __future__ import annotations

import re
from dataclasses import fields
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

from pyspark.ml.param import Param, Params, TypeConverters

from sparkdl.config import RunConfig
from sparkdl.config.sections import option_owners
from sparkdl.errors import ConfigError

# Spark's column Param -> sparkdl's option; featuresCol names one (vector or array) column.
SPARK_COLUMNS = {"featuresCol": "feature_cols", "labelCol": "label_col", "predictionCol": "prediction_col",
                 "weightCol": "weight_col"}
# Written by TorchModel.transform for classifiers ("" leaves the column out, as Spark's classifiers do).
SCORE_COLUMNS = {"probabilityCol": ("probability", "the class probabilities of a classifier, as a vector "
                                                   "(softmax of the logits; [1 - p, p] for one logit); \"\": not written"),
                 "rawPredictionCol": ("rawPrediction", "a classifier's raw scores, as a vector (its logits; "
                                                       "[-z, z] for one logit z, as Spark's LogisticRegression); "
                                                       "\"\": not written")}
SPARK_COLUMN_DOCS = {
    "featuresCol": "Spark ML's name for feature_cols when the features are one column (a vector or array)",
    "labelCol": "Spark ML's name for label_col: the label column",
    "predictionCol": "Spark ML's name for prediction_col: the prediction column transform writes "
                     "(a double for classifiers and regressors)",
    "weightCol": "Spark ML's name for weight_col: a per-row loss weight column",
}
_DEFAULTS_TOML = ("config/defaults.toml", "../conf/defaults.toml")


def _optional(convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: value if value is None else convert(value)


def _whole_number(value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{value!r} is a boolean, not a whole number")
    return TypeConverters.toInt(value)


def _number(value: Any) -> float:
    if isinstance(value, bool):
        raise TypeError(f"{value!r} is a boolean, not a number")
    return TypeConverters.toFloat(value)


_CONVERTERS: dict[str, Callable[[Any], Any]] = {
    "int": _whole_number, "float": _number, "bool": TypeConverters.toBoolean, "str": TypeConverters.toString,
    "int | None": _optional(_whole_number), "float | None": _optional(_number),
    "str | None": _optional(TypeConverters.toString),
}


def _listed(value: Any) -> Any:
    """Tuples as lists: Spark's explainParams formats values with `%`, which a tuple would feed."""
    return list(value) if isinstance(value, tuple) else value


def converter(annotation: str) -> Callable[[Any], Any]:
    """Spark's type check for a plain option; for the richer ones (lists, dicts, callables) tuples
    become lists, and RunConfig's own coercion and validation check them when the fit builds its config."""
    return _CONVERTERS.get(annotation, _listed)


@lru_cache(maxsize=1)
def option_docs() -> dict[str, str]:
    """`section.option` -> its comment in conf/defaults.toml (the documented defaults), joined: the
    comment lines right above `option = value` (or `# option = value` for an unset default)."""
    here = Path(__file__).resolve().parent
    path = next((here / p for p in _DEFAULTS_TOML if (here / p).is_file()), None)
    if path is None:  # an installation without the file: the Params say where the options are documented
        return {}
    known = {f"{section}.{f.name}" for section, part in _section_parts(RunConfig()) for f in fields(part)}
    docs: dict[str, str] = {}
    section, comment, after_setting = "", [], False  # type: ignore[var-annotated]
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        header = re.fullmatch(r"\[([a-z_]+)\]", line)
        setting = re.match(r"#?\s*([a-z_]+)\s*=", line)
        key = f"{section}.{setting.group(1)}" if setting else ""
        if header:
            section, comment, after_setting = header.group(1), [], False
        elif key in known and key not in docs:  # settings in a row share the comment above them
            docs[key], after_setting = " ".join(comment), True
        elif line.startswith("#"):
            comment = [] if after_setting else comment
            comment.append(line.lstrip("#").strip())
            after_setting = False
        else:
            comment, after_setting = [], False
    return docs


def option_param_specs() -> list[tuple[str, str, Callable[[Any], Any]]]:
    """(name, doc, type converter) of every RunConfig option, in section order."""
    config, docs = RunConfig(), option_docs()
    specs = []
    for section, owner in _section_parts(config):
        for f in fields(owner):
            doc = docs.get(f"{section}.{f.name}") or f"sparkdl option {section}.{f.name} (see conf/defaults.toml)"
            specs.append((f.name, f"{section}.{f.name}: {doc}", converter(str(f.type))))
    return specs


def _section_parts(config: RunConfig) -> list[tuple[str, Any]]:
    return [(f.name, getattr(config, f.name)) for f in fields(config)]


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head[:1].upper() + head[1:] + "".join(part.title() for part in rest)


def _accessors(cls: type, name: str) -> None:
    """getX / setX for the Param `name` (Spark's own classes write them by hand)."""
    camel = _camel(name)

    def getter(self: Params) -> Any:
        return self.getOrDefault(name)

    def setter(self: Params, value: Any) -> Params:
        return self._set(**{name: value})

    getter.__doc__, setter.__doc__ = f"The value of {name}.", f"Sets {name}."
    if not hasattr(cls, f"get{camel}"):
        setattr(cls, f"get{camel}", getter)
    if not hasattr(cls, f"set{camel}"):
        setattr(cls, f"set{camel}", setter)


class ScoreColumnParams(Params):
    """predictionCol, probabilityCol and rawPredictionCol: shared by the estimator and the model."""

    predictionCol: Param[str] = Param(Params._dummy(), "predictionCol", SPARK_COLUMN_DOCS["predictionCol"],
                                      typeConverter=TypeConverters.toString)
    probabilityCol: Param[str] = Param(Params._dummy(), "probabilityCol", SCORE_COLUMNS["probabilityCol"][1],
                                       typeConverter=TypeConverters.toString)
    rawPredictionCol: Param[str] = Param(Params._dummy(), "rawPredictionCol", SCORE_COLUMNS["rawPredictionCol"][1],
                                         typeConverter=TypeConverters.toString)

    def _score_defaults(self, prediction_col: str = "prediction") -> None:
        self._setDefault(predictionCol=prediction_col,
                         **{name: default for name, (default, _) in SCORE_COLUMNS.items()})


for _name in ("predictionCol", "probabilityCol", "rawPredictionCol"):
    _accessors(ScoreColumnParams, _name)


class RunConfigParams(ScoreColumnParams):
    """Every RunConfig option as a Param (added below from the dataclasses), plus Spark's column names."""

    featuresCol: Param[str] = Param(Params._dummy(), "featuresCol", SPARK_COLUMN_DOCS["featuresCol"],
                                    typeConverter=_optional(TypeConverters.toString))
    labelCol: Param[str] = Param(Params._dummy(), "labelCol", SPARK_COLUMN_DOCS["labelCol"],
                                 typeConverter=_optional(TypeConverters.toString))
    weightCol: Param[str] = Param(Params._dummy(), "weightCol", SPARK_COLUMN_DOCS["weightCol"],
                                  typeConverter=_optional(TypeConverters.toString))

    def _config_defaults(self, base: RunConfig) -> None:
        """Every option's default from `base` (the config the estimator was built on)."""
        self._setDefault(**{f.name: _listed(getattr(part, f.name)) for _, part in _section_parts(base)
                            for f in fields(part)})
        self._score_defaults(base.data.prediction_col)

    def _set_options(self, options: dict[str, Any]) -> None:
        """Keyword options of the constructor or setParams: sparkdl names or Spark's column names;
        unknown names raise with a suggestion."""
        spark_named = {k: v for k, v in options.items() if k in SPARK_COLUMNS or k in SCORE_COLUMNS}
        sparkdl_named = {k: v for k, v in options.items() if k not in spark_named}
        RunConfig.from_kwargs(**{k: v for k, v in sparkdl_named.items()})  # unknown names, coercion
        for spark_name, option in SPARK_COLUMNS.items():  # the name set last speaks for the pair
            if option in sparkdl_named and spark_name not in spark_named:
                self.clear(getattr(self, spark_name))
            if spark_name in spark_named and option not in sparkdl_named:
                self.clear(getattr(self, option))
        self._set(**sparkdl_named)
        self._set(**spark_named)

    def _run_config(self, base: RunConfig) -> RunConfig:
        """The RunConfig these Params describe: base, with every option's value (set or default) and
        Spark's column names where set (which must agree with the sparkdl names set beside them)."""
        values = {name: self.getOrDefault(name) for name in option_owners(base)}
        for spark_name, option in SPARK_COLUMNS.items():
            if not self.isSet(spark_name):
                continue
            value = self.getOrDefault(spark_name)
            value = (value,) if option == "feature_cols" and value is not None else value
            if self.isSet(option) and _differs(self.getOrDefault(option), value):
                raise ConfigError(f"{spark_name}={self.getOrDefault(spark_name)!r} and {option}="
                                  f"{self.getOrDefault(option)!r} are both set and disagree",
                                  hint=f"set only one of {spark_name} and {option}")
            values[option] = value
        return RunConfig.from_kwargs(base=base, **values)


def _differs(left: Any, right: Any) -> bool:
    as_tuple = (lambda v: tuple(v) if isinstance(v, (list, tuple)) else v)
    return as_tuple(left) != as_tuple(right)


def _spark_column_getter(spark_name: str) -> Callable[..., Any]:
    def getter(self: RunConfigParams) -> Any:
        if self.isSet(spark_name):
            return self.getOrDefault(spark_name)
        value = self.getOrDefault(SPARK_COLUMNS[spark_name])
        if spark_name == "featuresCol":  # one column of features, or None for several
            return value[0] if isinstance(value, (list, tuple)) and len(value) == 1 else None
        return value

    getter.__doc__ = f"{spark_name}, or the value of {SPARK_COLUMNS[spark_name]} where it is not set."
    return getter


def _spark_column_setter(spark_name: str) -> Callable[..., Any]:
    def setter(self: RunConfigParams, value: Any) -> RunConfigParams:
        self._set_options({spark_name: value})
        return self

    setter.__doc__ = f"Sets {spark_name} (and so {SPARK_COLUMNS[spark_name]})."
    return setter


for _name in SPARK_COLUMNS:  # setLabelCol is Spark's labelCol; label_col's own setter would share the name
    setattr(RunConfigParams, f"set{_camel(_name)}", _spark_column_setter(_name))
    setattr(RunConfigParams, f"get{_camel(_name)}", _spark_column_getter(_name))
for _name, _doc, _convert in option_param_specs():
    if _name in SPARK_COLUMNS or _name in SCORE_COLUMNS or hasattr(RunConfigParams, _name):
        raise RuntimeError(f"option {_name!r} clashes with a Spark ML name")  # a new option must be renamed
    setattr(RunConfigParams, _name, Param(Params._dummy(), _name, _doc, typeConverter=_convert))
    _accessors(RunConfigParams, _name)
