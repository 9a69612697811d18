"""sparkdl/config/sections.py: defaults, flat keyword mapping, `--set` overrides, TOML files, to_dict/flat."""
from __future__ import annotations

import dataclasses
import json
import re
import tomllib
from pathlib import Path

import pytest

from sparkdl.config import (
    DataConfig,
    InputConfig,
    LaunchConfig,
    OutputConfig,
    RunConfig,
    TrainConfig,
    option_owners,
)
from sparkdl.errors import ConfigError, SparkdlError

SECTIONS = ("data", "train", "launch", "input", "output", "model", "tracking", "embeddings")
DIGITS_COLS = tuple(f"p{i}" for i in range(64))


@pytest.fixture()
def cfg() -> RunConfig:
    """The defaults plus the one option that has none."""
    return RunConfig().merged({"data": {"feature_cols": ["a", "b"]}})


# --- defaults -------------------------------------------------------------------------------

def test_defaults_validate_once_feature_cols_are_given(cfg: RunConfig) -> None:
    assert cfg.validate() is cfg
    for section in (TrainConfig(), LaunchConfig(), InputConfig(), OutputConfig()):
        section.validate()


def test_bare_defaults_ask_for_feature_cols() -> None:
    with pytest.raises(ConfigError, match="data.feature_cols") as info:
        RunConfig().validate()
    assert info.value.hint


def test_sections_and_a_few_defaults() -> None:
    config = RunConfig()
    assert [f.name for f in dataclasses.fields(config)] == list(SECTIONS)
    assert config.data.label_col == "label"
    assert config.data.batch_size == 64
    assert config.train.optimizer == "adam"
    assert config.train.loss == "cross_entropy"
    assert config.launch.num_workers == 2
    assert config.launch.backend == "torch"


def test_config_is_frozen(cfg: RunConfig) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.epochs = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.data = DataConfig()  # type: ignore[misc]


def test_option_names_are_unique_across_sections() -> None:
    names = [f.name for s in SECTIONS for f in dataclasses.fields(getattr(RunConfig(), s))]
    assert len(names) == len(set(names)), "flat keyword arguments need unique option names"
    owners = option_owners()
    assert set(owners) == set(names)
    assert owners["batch_size"] == "data"
    assert owners["epochs"] == "train"
    assert owners["num_workers"] == "launch"
    assert owners["path"] == "input"
    assert owners["model_path"] == "output"


# --- from_kwargs ----------------------------------------------------------------------------

def test_from_kwargs_maps_flat_names_onto_sections() -> None:
    config = RunConfig.from_kwargs(feature_cols=["f0", "f1"], label_col="y", batch_size=32, epochs=3,
                                   lr=1, optimizer="sgd", num_workers=4, seed=7).validate()
    assert config.data.feature_cols == ("f0", "f1")
    assert config.data.label_col == "y"
    assert config.data.batch_size == 32
    assert config.train.epochs == 3
    assert config.train.lr == 1.0 and isinstance(config.train.lr, float)
    assert config.train.optimizer == "sgd"
    assert config.train.seed == 7
    assert config.launch.num_workers == 4
    assert config.input == InputConfig() and config.output == OutputConfig()


def test_from_kwargs_starts_from_a_base(cfg: RunConfig) -> None:
    config = RunConfig.from_kwargs(cfg, epochs=9)
    assert config.train.epochs == 9
    assert config.data.feature_cols == ("a", "b")
    assert cfg.train.epochs == 5, "the base is not modified"


def test_from_kwargs_rejects_unknown_names_with_a_suggestion() -> None:
    with pytest.raises(ConfigError) as info:
        RunConfig.from_kwargs(feature_cols=["a"], batchsize=32)
    assert isinstance(info.value, SparkdlError)
    assert "batchsize" in str(info.value)
    assert "did you mean 'batch_size'" in str(info.value)
    assert "HINT:" in str(info.value)


def test_from_kwargs_accepts_callables_and_to_dict_names_them() -> None:
    def my_loss(output: object, label: object) -> object:
        return output

    config = RunConfig.from_kwargs(feature_cols=["a"], loss=my_loss, optimizer=my_loss).validate()
    assert config.train.loss is my_loss
    shown = config.to_dict()["train"]["loss"]
    assert isinstance(shown, str) and shown.endswith("my_loss")


# --- with_overrides -------------------------------------------------------------------------

def test_overrides_parse_toml_literals(cfg: RunConfig) -> None:
    config = cfg.with_overrides([
        "train.epochs=3",
        'data.feature_cols=["x","y"]',
        "train.lr=0.01",
        "data.shuffle=false",
        " train.seed = 11 ",
        'data.label_col="target"',
    ]).validate()
    assert config.train.epochs == 3 and type(config.train.epochs) is int
    assert config.data.feature_cols == ("x", "y") and isinstance(config.data.feature_cols, tuple)
    assert config.train.lr == 0.01
    assert config.data.shuffle is False
    assert config.train.seed == 11
    assert config.data.label_col == "target"


def test_overrides_take_non_literals_as_plain_strings(cfg: RunConfig) -> None:
    config = cfg.with_overrides(["input.path=/tmp/digits.parquet", "train.optimizer=sgd",
                                 "output.model_path=models/run-1"]).validate()
    assert config.input.path == "/tmp/digits.parquet"
    assert config.train.optimizer == "sgd"
    assert config.output.model_path == "models/run-1"


def test_overrides_coerce_ints_to_float_options(cfg: RunConfig) -> None:
    config = cfg.with_overrides(["train.lr=1", "launch.timeout_s=30"])
    assert config.train.lr == 1.0 and isinstance(config.train.lr, float)
    assert config.launch.timeout_s == 30.0 and isinstance(config.launch.timeout_s, float)


def test_overrides_leave_the_original_unchanged(cfg: RunConfig) -> None:
    cfg.with_overrides(["train.epochs=3"])
    assert cfg.train.epochs == 5


@pytest.mark.parametrize("item", ["epochs=3", "train.epochs", "train_epochs=3", ""])
def test_malformed_override_is_rejected(cfg: RunConfig, item: str) -> None:
    with pytest.raises(ConfigError, match="section.option=value"):
        cfg.with_overrides([item])


def test_unknown_section_and_option_get_suggestions(cfg: RunConfig) -> None:
    with pytest.raises(ConfigError, match="unknown config section 'trian'") as info:
        cfg.with_overrides(["trian.epochs=3"])
    assert "did you mean 'train'" in str(info.value)
    with pytest.raises(ConfigError, match=r"unknown option train\.epoch\b") as info:
        cfg.with_overrides(["train.epoch=3"])
    assert "did you mean 'epochs'" in str(info.value)


@pytest.mark.parametrize(("override", "key"), [
    ("train.epochs=0", "train.epochs"),
    ("train.epochs=1.5", "train.epochs"),
    ("train.epochs=true", "train.epochs"),
    ("train.epochs=three", "train.epochs"),
    ("data.batch_size=0", "data.batch_size"),
    ("data.batch_size=-8", "data.batch_size"),
    ("train.lr=0", "train.lr"),
    ("train.lr=-1e-3", "train.lr"),
    ("train.lr=fast", "train.lr"),
    ("train.optimizer=adagrad", "train.optimizer"),
    ("train.loss=hinge", "train.loss"),
    ("train.task=ranking", "train.task"),
    ("train.strategy=bogus", "train.strategy"),
    ("train.seed=1.5", "train.seed"),
    ("launch.num_workers=0", "launch.num_workers"),
    ("launch.backend=mpi", "launch.backend"),
    ("launch.timeout_s=0", "launch.timeout_s"),
    ("launch.slot_wait_s=-1", "launch.slot_wait_s"),
    ("launch.threads_per_worker=0", "launch.threads_per_worker"),
    ("input.format=xlsx", "input.format"),
    ("output.model_path=3", "output.model_path"),
    ("data.feature_cols=a", "data.feature_cols"),
    ("data.feature_cols=[]", "data.feature_cols"),
    ('data.feature_cols=["a","a"]', "data.feature_cols"),
    ('data.feature_cols=["a",""]', "data.feature_cols"),
    ("data.feature_cols=[1,2]", "data.feature_cols"),
    ('data.feature_cols=["a","label"]', "data.label_col"),
])
def test_bad_values_raise_config_error_naming_the_key(cfg: RunConfig, override: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        cfg.with_overrides([override]).validate()
    assert key in str(info.value)


def test_choice_errors_suggest_the_close_value(cfg: RunConfig) -> None:
    with pytest.raises(ConfigError) as info:
        cfg.with_overrides(["train.optimizer=adamm"]).validate()
    assert "did you mean 'adam'" in str(info.value)


# --- TOML files -----------------------------------------------------------------------------

def test_defaults_toml_matches_config_py(repo_root: Path) -> None:
    path = repo_root / "conf" / "defaults.toml"
    written = tomllib.loads(path.read_text(encoding="utf-8"))
    defaults = RunConfig().to_dict()
    assert set(written) == set(SECTIONS)
    for section, values in written.items():
        for key, value in values.items():
            assert key in defaults[section], f"{section}.{key} in defaults.toml is not an option"
            assert value == defaults[section][key], f"defaults.toml says {section}.{key} = {value!r}"


def test_defaults_toml_documents_every_option(repo_root: Path) -> None:
    text = (repo_root / "conf" / "defaults.toml").read_text(encoding="utf-8")
    current = None
    seen: set[str] = set()
    for line in text.splitlines():
        header = re.fullmatch(r"\[(\w+)\]", line.strip())
        if header:
            current = header.group(1)
            continue
        # A key line, live (`key = ...`) or commented out because its default is unset (`# key = ...`).
        match = re.fullmatch(r"#?\s*(\w+)\s*=.*", line.strip())
        if current and match:
            seen.add(f"{current}.{match.group(1)}")
    missing = set(RunConfig().flat()) - seen
    assert not missing, f"options not documented in conf/defaults.toml: {sorted(missing)}"


def test_from_toml_loads_defaults_toml(repo_root: Path) -> None:
    path = repo_root / "conf" / "defaults.toml"
    with pytest.raises(ConfigError, match="data.feature_cols"):
        RunConfig.from_toml(path)
    config = RunConfig.from_toml(path, ['data.feature_cols=["a","b"]'])
    assert config == RunConfig(data=DataConfig(feature_cols=("a", "b")))


def test_from_toml_loads_the_digits_example(repo_root: Path) -> None:
    path = repo_root / "conf" / "examples" / "digits.toml"
    config = RunConfig.from_toml(path, ["input.path=/tmp/digits.parquet", "train.epochs=3"])
    assert config.data.feature_cols == DIGITS_COLS
    assert config.data.label_col == "label"
    assert config.train.loss == "cross_entropy"
    assert config.train.epochs == 3
    assert config.input.path == "/tmp/digits.parquet"
    assert config.input.format == "parquet"


def test_every_example_config_validates(repo_root: Path) -> None:
    examples = sorted((repo_root / "conf" / "examples").glob("*.toml"))
    assert examples
    for path in examples:
        RunConfig.from_toml(path)


def test_from_toml_reports_missing_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        RunConfig.from_toml(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nepochs = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        RunConfig.from_toml(bad)
    unknown = tmp_path / "unknown.toml"
    unknown.write_text('[data]\nfeature_cols = ["a"]\n[train]\nepoch = 3\n')
    with pytest.raises(ConfigError, match=r"train\.epoch"):
        RunConfig.from_toml(unknown)


def test_from_toml_applies_overrides_after_the_file(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[data]\nfeature_cols = ["a"]\n[train]\nepochs = 2\nlr = 1\n')
    config = RunConfig.from_toml(path, ["train.epochs=4"])
    assert config.train.epochs == 4
    assert config.train.lr == 1.0 and isinstance(config.train.lr, float)


# --- to_dict / flat -------------------------------------------------------------------------

def test_to_dict_is_nested_plain_and_json_serialisable(cfg: RunConfig) -> None:
    out = cfg.to_dict()
    assert list(out) == list(SECTIONS)
    assert out["data"]["feature_cols"] == ["a", "b"]
    assert out["train"]["epochs"] == 5
    assert out["input"]["path"] is None
    json.dumps(out)


def test_to_dict_round_trips_through_merged(cfg: RunConfig) -> None:
    config = cfg.with_overrides(["train.epochs=3", "launch.num_workers=4", "input.path=x.parquet"])
    assert RunConfig().merged(config.to_dict()) == config


def test_flat_names_every_option_once(cfg: RunConfig) -> None:
    flat = cfg.flat()
    assert flat["train.epochs"] == 5
    assert flat["data.feature_cols"] == ["a", "b"]
    assert flat["launch.num_workers"] == 2
    assert len(flat) == len(option_owners())
    assert all(key.split(".", 1)[0] in SECTIONS for key in flat)


def test_memory_sizes_parse_with_units() -> None:
    from sparkdl.config import parse_bytes

    assert parse_bytes(1000) == 1000
    assert parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("1.5g") == int(1.5 * 2**30)
    for bad in ("3 parsecs", "lots", 0, -5, True):
        with pytest.raises(ConfigError, match="max_memory_per_rank"):
            parse_bytes(bad, "launch.max_memory_per_rank")
    with pytest.raises(ConfigError, match="launch.max_memory_per_rank"):
        RunConfig.from_kwargs(feature_cols=["a"], max_memory_per_rank="ten gigs").validate()


def test_hybrid_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="train.schedule"):
        RunConfig.from_kwargs(feature_cols=["a"], schedule="zigzag").validate()
    with pytest.raises(ConfigError, match="train.stages=1"):
        RunConfig.from_kwargs(feature_cols=["a"], strategy="hybrid", stages=1).validate()
    with pytest.raises(ConfigError, match="num_workers >= 2"):
        RunConfig.from_kwargs(feature_cols=["a"], strategy="hybrid", num_workers=1).validate()
    with pytest.raises(ConfigError, match="train.microbatches must be an integer >= 0"):
        RunConfig.from_kwargs(feature_cols=["a"], microbatches=-1).validate()
    config = RunConfig.from_kwargs(feature_cols=["a"], strategy="hybrid", stages=2, num_workers=6).validate()
    assert (config.train.stages, config.train.schedule) == (2, "1f1b")


def test_auto_is_the_default_and_single_strategy_options_decide_it() -> None:
    def implied(**options: object) -> str:
        return RunConfig.from_kwargs(feature_cols=["a"], **options).validate().train.implied_strategy

    assert RunConfig().train.strategy == "auto" and implied() == "auto"
    assert implied(sync="diloco") == "data_parallel"
    assert implied(stages=2, num_workers=4) == "hybrid" and implied(microbatches=8) == "hybrid"
    assert implied(strategy="ist") == "ist"
    with pytest.raises(ConfigError, match="train.stages=3 does not divide"):
        RunConfig.from_kwargs(feature_cols=["a"], stages=3, num_workers=4).validate()
    with pytest.raises(ConfigError, match="hybrid ones"):
        RunConfig.from_kwargs(feature_cols=["a"], sync="diloco", stages=2).validate()
    with pytest.raises(ConfigError, match="train.sync='diloco' is a synchronisation mode of data parallel"):
        RunConfig.from_kwargs(feature_cols=["a"], sync="diloco", strategy="ist").validate()
    with pytest.raises(ConfigError, match="approximate_min_speedup must be >= 1"):
        RunConfig.from_kwargs(feature_cols=["a"], approximate_min_speedup=0.5).validate()
    assert RunConfig.from_kwargs(feature_cols=["a"], approximate_min_speedup=float("inf")).validate()


def test_spark_conf_files_are_spark_defaults(repo_root: Path) -> None:
    for path in sorted((repo_root / "conf" / "spark").glob("*.conf")):
        for line in path.read_text().splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            key, _, value = line.strip().partition(" ")
            assert key.startswith("spark.") and value.strip(), f"{path.name}: {line!r}"
    gpu = dict(line.split(None, 1) for line in (repo_root / "conf" / "spark" / "gpu-cluster.conf").read_text()
               .splitlines() if line.strip() and not line.startswith("#"))
    assert gpu["spark.task.resource.gpu.amount"] == "1" and gpu["spark.dynamicAllocation.enabled"] == "false"


def test_spool_modes_are_checked_with_the_epochs() -> None:
    with pytest.raises(ConfigError, match=r"spool='none' trains one pass.*epochs=2") as info:
        RunConfig.from_kwargs(feature_cols=["a"], epochs=2, spool="none").validate()
    assert "spool='disk'" in info.value.hint
    with pytest.raises(ConfigError, match="data.spool"):
        RunConfig.from_kwargs(feature_cols=["a"], spool="ram").validate()
    with pytest.raises(ConfigError, match="data.shuffle_buffer_rows"):
        RunConfig.from_kwargs(feature_cols=["a"], shuffle_buffer_rows=-1).validate()
    RunConfig.from_kwargs(feature_cols=["a"], epochs=1, spool="none", shuffle_buffer_rows=4096).validate()


def test_auto_spool_writes_none_for_one_epoch() -> None:
    from sparkdl.config import TrainConfig
    from sparkdl.config.training import spool_mode

    one, three = TrainConfig(epochs=1), TrainConfig(epochs=3)
    assert spool_mode("auto", one) == "none" and spool_mode("auto", three) == "disk"
    assert spool_mode("disk", one) == "disk"
    # shares by speed wrap fast ranks around their shards: only a spool gives those rows again
    assert spool_mode("auto", TrainConfig(epochs=1, batch_balance="speed")) == "disk"
    with pytest.raises(ConfigError, match="batch_balance='speed'"):
        RunConfig.from_kwargs(feature_cols=["a"], epochs=1, spool="none", batch_balance="speed").validate()
