"""Pure helpers of the training essentials: option validation, the accumulation windows, early
stopping's patience, the driver's callback verdicts and the precision/step object."""
from __future__ import annotations

import logging

import pytest
import torch

from sparkdl.config import RunConfig
from sparkdl.config.training import check_monitored, early_stopping_options, parse_metric_name
from sparkdl.data.epochs import Accumulation, accumulation, optimizer_steps
from sparkdl.errors import ConfigError
from sparkdl.driver.callbacks import resolve_callbacks, run_callbacks
from sparkdl.wire.stopping import EarlyStopping, stop_tags
from sparkdl.strategies.stepping import OptimizerSteps


def config(**options):  # type: ignore[no-untyped-def]
    return RunConfig.from_kwargs(feature_cols=["a"], **options).validate()


@pytest.mark.parametrize("options, match", [
    ({"lr_schedule": "cosin"}, "did you mean 'cosine'"),
    ({"warmup_steps": -1}, "warmup_steps"),
    ({"min_lr": 1.0}, "min_lr"),
    ({"step_gamma": 0.0}, "step_gamma"),
    ({"precision": "fp16"}, "train.precision"),
    ({"accumulate_steps": 0}, "accumulate_steps"),
    ({"metrics": ["accuracy", "accuracy"]}, "twice"),
    ({"metrics": ["acuracy"]}, "did you mean 'accuracy'"),
    ({"metrics": "accuracy"}, "must be a list"),
    ({"early_stopping": {"patience": 0}}, "patience"),
    ({"early_stopping": {"metrc": "val_loss"}}, "did you mean 'metric'"),
    ({"early_stopping": {"mode": "up"}}, "mode"),
    ({"callbacks": ["no_colon"]}, "package.module:function"),
    ({"precision": "16", "strategy": "hybrid"}, "data-parallel only"),
    ({"accumulate_steps": 2, "strategy": "ist"}, "IST"),
    ({"early_stopping": {"metric": 3}}, "history name"),
    ({"lr_schedule": lambda optimizer: None, "warmup_steps": 5}, "lr_schedule is a callable"),
])
def test_bad_training_options_name_the_option(options, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=match):
        config(**options)


def test_training_options_come_from_toml_overrides_too() -> None:
    parsed = RunConfig().with_overrides([
        "data.feature_cols=['a']", "train.lr_schedule=cosine", "train.warmup_steps=5", "train.precision=bf16",
        "train.metrics=['accuracy','top_3_accuracy']", "train.early_stopping={metric='val_accuracy', patience=2}",
        "train.callbacks=['json:dumps']", "train.accumulate_steps=2"]).validate()
    train = parsed.train
    assert (train.lr_schedule, train.warmup_steps, train.precision, train.accumulate_steps) == ("cosine", 5, "bf16", 2)
    assert train.metrics == ("accuracy", "top_3_accuracy")
    assert early_stopping_options(train.early_stopping)["mode"] == "max"  # accuracy: higher is better
    assert [c.__name__ for c in resolve_callbacks(train.callbacks)] == ["dumps"]
    assert config(precision="16").train.implied_strategy == "data_parallel"
    assert RunConfig().with_overrides(["data.feature_cols=['a']", "train.precision=16"]).validate().train.precision == "16"
    assert early_stopping_options({"metric": "val_my_error"})["mode"] == "min"
    assert early_stopping_options({"metric": "val_auc"})["mode"] == "max"


def test_metric_names_and_monitored_names() -> None:
    assert parse_metric_name("top_k_accuracy") == ("top_k_accuracy", 5)
    assert parse_metric_name("top_2_accuracy") == ("top_k_accuracy", 2)
    check_monitored("val_auc", ["auc"], True)
    with pytest.raises(ConfigError, match="no validation rows"):
        check_monitored("val_loss", [], False)
    with pytest.raises(ConfigError, match="needs <name> in train.metrics"):
        check_monitored("val_auc", [], True)


def test_accumulation_windows_never_cross_an_epoch_end() -> None:
    windows = [accumulation(step, 7, 3) for step in range(7)]
    assert windows == [Accumulation(0, 3), Accumulation(1, 3), Accumulation(2, 3), Accumulation(0, 3),
                       Accumulation(1, 3), Accumulation(2, 3), Accumulation(0, 1)]
    assert [w.last for w in windows].count(True) == optimizer_steps(7, 3) == 3
    assert optimizer_steps(8, 1) == 8 and accumulation(4, 8, 1) == Accumulation(0, 1)


def test_early_stopping_waits_patience_epochs_and_remembers_the_best() -> None:
    early = EarlyStopping(**early_stopping_options({"metric": "val_loss", "patience": 2, "min_delta": 0.01}))
    verdicts = [early.update({"epoch": e, "val_loss": v}) for e, v in enumerate([1.0, 0.8, 0.795, 0.9])]
    assert [improved for improved, _ in verdicts] == [True, True, False, False]
    assert verdicts[3][1] is not None and "best 0.8 at epoch 1" in verdicts[3][1]
    again = EarlyStopping(metric="val_loss", patience=2)
    again.load(early.state())
    assert (again.best, again.best_epoch) == (0.8, 1)
    maxing = EarlyStopping(metric="val_accuracy", mode="max", patience=1)
    assert maxing.update({"epoch": 0, "val_accuracy": 0.5}) == (True, None)
    assert maxing.update({"epoch": 1, "val_accuracy": float("nan")})[1] is not None  # NaN never improves


def named_stop(record):  # type: ignore[no-untyped-def]
    return "stop" if record["epoch"] >= 1 else None


def broken(record):  # type: ignore[no-untyped-def]
    raise RuntimeError("plot failed")


def test_callbacks_verdicts(caplog) -> None:  # type: ignore[no-untyped-def]
    seen = []
    assert run_callbacks([seen.append, named_stop], {"epoch": 0}) == {"stop": False}
    verdict = run_callbacks([named_stop, seen.append], {"epoch": 1})
    assert verdict["stop"] and verdict["stopped_by"] == "callback:named_stop" and len(seen) == 2
    with caplog.at_level(logging.ERROR, logger="sparkdl"):
        verdict = run_callbacks([broken], {"epoch": 3})
    assert verdict["stop"] and "RuntimeError: plot failed" in verdict["reason"] and "plot failed" in caplog.text
    assert stop_tags([{"epoch": 1, "stopped_by": "callback:named_stop", "stop_reason": "x"}])["stopped_after_epoch"] == "1"
    assert stop_tags([{"epoch": 4}]) == {}
    with pytest.raises(ConfigError, match="cannot be imported"):
        resolve_callbacks(["no_such_module_xyz:fn"])


def test_sixteen_bit_precision_needs_cuda_and_bf16_autocasts_on_cpu() -> None:
    with pytest.raises(ConfigError, match="precision='16' needs CUDA"):
        OptimizerSteps(config(precision="16").train, "cpu")
    steps = OptimizerSteps(config(precision="bf16").train, "cpu")
    layer = torch.nn.Linear(4, 2)
    with steps.autocast():
        out = layer(torch.randn(3, 4))
    assert out.dtype == torch.bfloat16 and layer.weight.dtype == torch.float32
    steps.backward(out.float().sum(), Accumulation(0, 2))
    assert layer.weight.grad.dtype == torch.float32  # fp32 master weights get fp32 gradients


def test_sparkdl_submit_hands_spark_submit_a_python_application() -> None:
    from sparkdl.submit import submit_command

    command = submit_command(["--master", "spark://h:7077", "--executor-memory", "2g", "--", "train", "--conf", "x.toml"])
    assert command[0].endswith("spark-submit") and command[1:5] == ["--master", "spark://h:7077", "--executor-memory", "2g"]
    application = command.index("train") - 1
    assert command[application].endswith("sparkdl/cli.py") and command[application + 1:] == ["train", "--conf", "x.toml"]
    assert any(c.startswith("spark.pyspark.python=") for c in command)
    with pytest.raises(ConfigError, match="needs `--`"):
        submit_command(["--master", "local[2]", "train"])
    with pytest.raises(ConfigError, match="runs `train` or `plan`"):
        submit_command(["--", "demo"])
