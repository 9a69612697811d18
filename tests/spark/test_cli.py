"""`sparkdl train` run in-process against the session fixture (the CLI must reuse it)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparkdl import cli
from sparkdl.datasets import digits_dataframe
from sparkdl.estimator import TorchModel


@pytest.fixture(scope="module")
def digits_parquet(spark, tmp_path_factory) -> str:  # type: ignore[no-untyped-def]
    path = tmp_path_factory.mktemp("cli") / "digits.parquet"
    digits_dataframe(spark).write.parquet(str(path))
    return str(path)


@pytest.fixture(scope="module")
def conf(repo_root: Path) -> str:
    return str(repo_root / "conf" / "examples" / "digits.toml")


def test_train_saves_a_loadable_model(spark, digits_parquet: str, conf: str,  # type: ignore[no-untyped-def]
                                      tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "model"
    rc = cli.main(["train", "--conf", conf, "--set", f"input.path={digits_parquet}",
                   "--set", f"output.model_path={out}", "--set", "train.epochs=3"])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    lines = printed.out.strip().splitlines()
    assert [ln.split()[1] for ln in lines if ln.startswith("epoch ")] == ["1/3", "2/3", "3/3"]
    summary = json.loads(lines[-1])
    assert summary["epochs"] == 3 and summary["inputs"] == 64 and summary["outputs"] == 10
    assert summary["model_path"] == str(out)

    model = TorchModel.load(str(out))
    assert not spark.sparkContext._jsc.sc().isStopped()  # noqa: SLF001 - the CLI must not stop our session
    scored = model.transform(digits_dataframe(spark).limit(50))
    assert "prediction" in scored.columns
    assert {r["prediction"] for r in scored.select("prediction").collect()} <= set(range(10))


def test_model_override_and_existing_output(spark, digits_parquet: str, conf: str,  # type: ignore[no-untyped-def]
                                          tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "model"
    out.mkdir()
    args = ["train", "--conf", conf, "--set", f"input.path={digits_parquet}", "--set", f"output.model_path={out}",
            "--set", "train.epochs=1", "--set", "model.hidden=[32,16]"]
    assert cli.main(args) == 2
    assert "already exists" in capsys.readouterr().err
    assert cli.main(args + ["--set", "output.overwrite=true"]) == 0
    module = TorchModel.load(str(out)).torch_module()
    assert [m.out_features for m in module if hasattr(m, "out_features")] == [32, 16, 10]


def test_missing_column_returns_2_and_names_it(spark, digits_parquet: str, conf: str,  # type: ignore[no-untyped-def]
                                               capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["train", "--conf", conf, "--set", f"input.path={digits_parquet}",
                   "--set", "data.label_col=nope"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("error: ") and "'nope'" in err and "HINT" in err


def test_unknown_option_returns_2_with_suggestion(conf: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["train", "--conf", conf, "--set", "train.epochz=3"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "train.epochz" in err and "did you mean 'epochs'" in err


def test_bad_usage_returns_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["train"]) == 2
    assert "--conf" in capsys.readouterr().err


def test_load_config_reads_the_model_table(conf: str) -> None:
    config = cli.load_config(conf, ["model.hidden=[64,64]", "model.outputs=12", "train.epochs=2"])
    assert config.model.hidden == (64, 64) and config.model.outputs == 12
    assert config.train.epochs == 2 and config.data.label_col == "label"


def test_model_factory_import_path(spark, digits_parquet: str, conf: str, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "factory-model"
    rc = cli.main(["train", "--conf", conf, "--set", f"input.path={digits_parquet}", "--set", f"output.model_path={out}",
                   "--set", "train.epochs=1", "--set", 'model.factory="sparkdl_test_models:small_digits_net"'])
    assert rc == 0
    module = TorchModel.load(str(out)).torch_module()
    assert [m.out_features for m in module if hasattr(m, "out_features")] == [16, 10]


def test_bad_model_factory_is_a_clear_error(spark, digits_parquet: str, conf: str,  # type: ignore[no-untyped-def]
                                            capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["train", "--conf", conf, "--set", f"input.path={digits_parquet}",
                   "--set", 'model.factory="no_such_module:net"'])
    assert rc == 2
    assert "model.factory 'no_such_module:net' cannot be imported" in capsys.readouterr().err


def test_input_format_is_inferred_from_the_path(tmp_path: Path) -> None:
    from sparkdl.config import RunConfig

    cases = {"d.csv": "csv", "d.json": "json", "d.orc": "orc", "d.parquet": "parquet", "d": "parquet"}
    for name, fmt in cases.items():
        (tmp_path / name).mkdir()
        assert cli.input_format(RunConfig().merged({"input": {"path": str(tmp_path / name)}})) == fmt
    (tmp_path / "d.txt").mkdir()
    with pytest.raises(cli.ConfigError, match="input.format"):
        cli.input_format(RunConfig().merged({"input": {"path": str(tmp_path / "d.txt")}}))
    with pytest.raises(cli.ConfigError, match="does not exist"):
        cli.input_format(RunConfig().merged({"input": {"path": str(tmp_path / "missing.parquet")}}))
    assert cli.input_format(RunConfig().merged({"input": {"path": "s3a://bucket/x.csv"}})) == "csv"


def test_hybrid_from_the_conf(spark, digits_parquet: str, conf: str, tmp_path: Path,  # type: ignore[no-untyped-def]
                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "model"
    rc = cli.main(["train", "--conf", conf, "--set", f"input.path={digits_parquet}", "--set", f"output.model_path={out}",
                   "--set", "train.epochs=2", "--set", "model.hidden=[64,32]", "--set", 'train.strategy="hybrid"',
                   "--set", "train.stages=2", "--set", 'train.schedule="gpipe"', "--set", "train.microbatches=4"])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    model = TorchModel.load(str(out))
    assert model.options["train.strategy"] == "hybrid" and model.options["train.schedule"] == "gpipe"
    assert model.history[-1]["loss"] < model.history[0]["loss"]
    assert model.history[-1]["max_param_bytes_per_rank"] < sum(
        p.numel() * 4 for p in model.torch_module().parameters())


def test_training_essentials_from_set_overrides(spark, digits_parquet: str, conf: str,  # type: ignore[no-untyped-def]
                                                capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["train", "--conf", conf, "--set", f"input.path={digits_parquet}", "--set", "train.epochs=3",
                   "--set", "train.lr_schedule=cosine", "--set", "train.warmup_steps=5", "--set", "train.precision=bf16",
                   "--set", "train.accumulate_steps=2", "--set", "data.validation_fraction=0.2",
                   "--set", "train.metrics=['accuracy','top_3_accuracy']",
                   "--set", "train.callbacks=['sparkdl_test_models:stop_after_first_epoch']",
                   "--set", 'train.strategy="data_parallel"'])
    out = capsys.readouterr().out
    assert rc == 0, out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["epochs"] == 1 and summary["stopped_by"] == "callback:stop_after_first_epoch"
    assert "val_top_3_accuracy" in out and "stopped by callback:stop_after_first_epoch" in out
