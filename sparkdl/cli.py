"""`sparkdl train --conf x.toml [--set a.b=c]` and `sparkdl demo`: thin commands over the estimator.

A TOML file cannot hold an nn.Module, so `train` takes the model from the `[model]` table: the
import path of a factory (`factory = "pkg.mod:make_net"`) or an MLP (`hidden = [128]`, `outputs`).
pyspark and torch are imported inside the commands, so `sparkdl --help` stays fast.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from sparkdl.config import RunConfig
from sparkdl.errors import ConfigError, EmptyDataError, SparkdlError
from sparkdl.spark.session import facts
from sparkdl.tracking.redaction import redact_text

FORMATS = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".orc": "orc"}
# Per-worker batch 32 on 2 workers is a global batch of 64: lr 1e-3 stops at ~0.927 test accuracy
# after 15 epochs, 3e-3 reaches ~0.96 (the same setting as tests/spark/test_fit.py).
DEMO_LR = 3e-3


def build_mlp(inputs: int, hidden: Sequence[int], outputs: int) -> Any:
    """inputs -> hidden... -> outputs with ReLU between layers (module level: pickled by reference)."""
    from torch import nn

    widths = [inputs, *hidden]
    layers: list[nn.Module] = []
    for width_in, width_out in zip(widths, widths[1:]):
        layers += [nn.Linear(width_in, width_out), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(widths[-1], outputs))


def load_config(path: str, overrides: Sequence[str]) -> RunConfig:
    """RunConfig from the TOML file and `--set` overrides (the model comes from its [model] table)."""
    return RunConfig.from_toml(path, overrides)


def get_spark(master: str | None, remote: str | None = None) -> tuple[Any, bool]:
    """(session, created_here). An active session wins; then a Spark Connect server (--remote, or
    pyspark's own SPARK_REMOTE); under spark-submit its master; else local[2]."""
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        if master and master != facts(active).master():
            print(f"note: reusing the active Spark session ({facts(active).master()}); --master ignored",
                  file=sys.stderr)
        return active, False
    if remote or os.environ.get("SPARK_REMOTE"):
        if master:
            raise ConfigError("--master and a Spark Connect server (--remote or SPARK_REMOTE) are both given",
                              hint="the Connect server has its own master: drop --master")
        builder = SparkSession.builder.appName("sparkdl")
        return (builder.remote(remote) if remote else builder).getOrCreate(), True
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName("sparkdl")
    under_submit = "PYSPARK_GATEWAY_PORT" in os.environ or "--master" in os.environ.get("PYSPARK_SUBMIT_ARGS", "")
    if master or not under_submit:
        builder = builder.master(master or "local[2]").config("spark.ui.showConsoleProgress", "false")
    return builder.getOrCreate(), True


def input_format(config: RunConfig) -> str:
    """The reader format of input.path ("table" for input.table); checked before Spark starts."""
    table, path, fmt = config.input.table, config.input.path, config.input.format
    if bool(table) == bool(path):
        raise ConfigError("input.table and input.path are both set" if table else "no input: set input.path "
                          "or input.table", hint="for example --set input.path=/data/digits.parquet")
    if table:
        return "table"
    if (local := _local(path)) is not None and not local.exists():
        raise ConfigError(f"input.path {path!r} does not exist", hint="check the path (relative to the working "
                          f"directory {os.getcwd()!r}) or pass a URI such as hdfs://... or s3a://...")
    suffix = Path(path.rstrip("/")).suffix.lower()
    if fmt == "auto" and suffix and suffix not in FORMATS:
        raise ConfigError(f"cannot tell the format of input.path {path!r} from its extension {suffix!r}",
                          hint="set input.format to parquet, csv, json or orc")
    return FORMATS.get(suffix, "parquet") if fmt == "auto" else fmt


def read_input(spark: Any, config: RunConfig, fmt: str) -> Any:
    from pyspark.errors import AnalysisException

    try:
        if fmt == "table":
            return spark.table(config.input.table)
        reader = spark.read.format(fmt)
        if fmt == "csv":
            reader = reader.option("header", "true").option("inferSchema", "true")
        return reader.load(config.input.path)
    except AnalysisException as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        what = f"table {config.input.table!r}" if fmt == "table" else f"input.path {config.input.path!r}"
        raise ConfigError(f"cannot read {what}: {first}",
                          hint="check the path or table name and input.format") from None


def model_factory(df: Any, config: RunConfig) -> tuple[Any, int | None, int | None]:
    """(zero-argument model factory, input width, output width); widths are None for a user factory."""
    if config.model.factory:
        from sparkdl.model.objectives import import_factory

        return import_factory(config.model.factory), None, None
    return mlp_factory(df, config)


def mlp_factory(df: Any, config: RunConfig) -> tuple[Any, int, int]:
    """(zero-argument model factory, input width, output width), found with at most two small jobs."""
    from pyspark.sql import functions as F

    from sparkdl.data.feed import check_columns, feature_kind, features_expression, is_classification

    if config.data.input_cols is not None:
        raise ConfigError("data.input_cols needs model.factory: the built-in MLP reads one feature vector "
                          "(feature_cols)", hint="--set model.factory='package.module:function' returning the model "
                                                 "for these tensor columns, or use feature_cols")
    cols, label = list(config.data.feature_cols), config.data.label_col
    check_columns(df, cols + ([label] if label else []))
    inputs = len(cols)
    if any(feature_kind(df, name) != "scalar" for name in cols):
        row = df.select(F.size(features_expression(df, cols)).alias("n")).first()
        if row is None:
            raise EmptyDataError("the DataFrame has no rows", hint="check the filters or the input path")
        inputs = int(row["n"] or 0)
    outputs = config.model.outputs
    if not outputs:
        outputs = 1
        if label and config.train.loss not in ("mse", "bce_with_logits") and \
                is_classification(df, config.data, config.train):
            top = df.agg(F.max(F.col(label).cast("double")).alias("m")).first()["m"]
            outputs = max(int(top) + 1, 1) if top is not None else 1  # bad labels: prepare() raises
    return functools.partial(build_mlp, inputs, tuple(config.model.hidden), outputs), inputs, outputs


def check_output(config: RunConfig) -> None:
    """Fail before training, not after it, when a local model directory exists and overwrite is off."""
    path = config.output.model_path
    local = _local(path) if path else None
    if local is not None and local.exists() and not config.output.overwrite:
        raise ConfigError(f"output.model_path {path!r} already exists",
                          hint="--set output.overwrite=true, or choose another output.model_path")


def _local(path: str) -> Path | None:
    """The local file a path or file: URI names; None for hdfs://, s3a://, dbfs:/ and the like."""
    scheme, sep, rest = path.partition(":")
    if not sep or "/" in scheme:
        return Path(path)
    return Path(rest) if scheme == "file" else None


def print_history(history: Sequence[dict[str, Any]], epochs: int) -> None:
    for h in history:
        validation = "".join(f"  {k} {v:.4f}" for k, v in h.items() if k.startswith("val_") and isinstance(v, float))
        print(f"epoch {h['epoch'] + 1}/{epochs}  loss {h['loss']:.4f}{validation}  "
              f"samples/s {h.get('samples_per_sec', 0):.0f}", flush=True)
    if history and history[-1].get("stopped_by"):
        print(f"stopped by {history[-1]['stopped_by']}: {history[-1].get('stop_reason', '')}", flush=True)


def cmd_train(args: argparse.Namespace) -> int:
    from sparkdl.estimator import TorchEstimator

    config = load_config(args.conf, args.overrides)
    check_output(config)
    fmt = input_format(config)
    spark, created = get_spark(args.master, args.remote)
    try:
        started = time.perf_counter()
        df = read_input(spark, config, fmt)
        factory, inputs, outputs = model_factory(df, config)
        model = TorchEstimator(model=factory, config=config).fit(df)
        seconds = time.perf_counter() - started
        print_history(model.history, config.train.epochs)
        path = config.output.model_path
        if path:
            writer = model.write()
            (writer.overwrite() if config.output.overwrite else writer).save(path)
        else:
            print("note: output.model_path is unset, nothing was saved (--set output.model_path=PATH)",
                  file=sys.stderr)
        last = model.history[-1] if model.history else {}
        print(json.dumps({"run_id": model.run_id, "epochs": len(model.history), "final_loss": last.get("loss"),
                          "stopped_by": last.get("stopped_by"),
                          "seconds": round(seconds, 2), "inputs": inputs, "model": config.to_dict()["model"],
                          "outputs": outputs, "num_workers": config.launch.num_workers, "model_path": path}))
        return 0
    finally:
        if created:
            spark.stop()


def demo_session(master: str, workers: int) -> Any:
    """A fresh session on `master`; local[workers] when a local-cluster does not come up in 60 s."""
    from pyspark.sql import SparkSession

    from sparkdl.driver.job import concurrent_slots

    os.environ["PYSPARK_PYTHON"] = sys.executable
    builder = (SparkSession.builder.appName("sparkdl-demo").config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               # the feature expression's plan is wide: without this Spark warns it truncated its text
               .config("spark.sql.debug.maxToStringFields", "1000"))
    try:
        spark = builder.master(master).getOrCreate()
        deadline = time.monotonic() + 60
        while (slots := concurrent_slots(spark)) < workers and time.monotonic() < deadline:
            time.sleep(0.5)
        if slots >= workers or not master.startswith("local-cluster"):
            return spark
        spark.stop()
        reason = f"only {slots} of {workers} task slots came up within 60 s"
    except Exception as exc:  # noqa: BLE001 - any failure to start the cluster leads to the fallback
        reason = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
    print(f"note: {master} is not usable ({reason}); falling back to local[{workers}]", flush=True)
    return builder.master(f"local[{workers}]").getOrCreate()


def demo_job(spark: Any, epochs: int, workers: int, **options: Any) -> tuple[Any, float, int]:
    """The demo's job on `spark`: train on the bundled digits, print the epoch table; (the model,
    its test accuracy, test rows). `options` go to the estimator (tests: tracking=False)."""
    from pyspark.sql import functions as F

    from sparkdl.datasets import DIGITS_FEATURE_COLS, digits_dataframe, train_test_split_digits
    from sparkdl.estimator import TorchEstimator

    train_idx, test_idx = train_test_split_digits(seed=0)
    estimator = TorchEstimator(model=functools.partial(build_mlp, 64, (128,), 10), feature_cols=DIGITS_FEATURE_COLS,
                               label_col="label", optimizer="adam", lr=DEMO_LR, batch_size=32,
                               epochs=epochs, num_workers=workers, seed=0, **options)
    model = estimator.fit(digits_dataframe(spark, indices=train_idx))
    print_history(model.history, epochs)
    scored = model.transform(digits_dataframe(spark, indices=test_idx))
    acc = scored.agg(F.avg((F.col("prediction") == F.col("label")).cast("double"))).first()[0]
    return model, float(acc), len(test_idx)


def cmd_demo(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    spark = demo_session(args.master, args.workers)
    try:
        print(f"spark master: {facts(spark).master()}", flush=True)
        _, acc, rows = demo_job(spark, args.epochs, args.workers)
        print(f"test accuracy: {acc:.3f} ({rows} test rows, {time.perf_counter() - started:.1f} s in all)",
              flush=True)
        return 0
    finally:
        spark.stop()


def cmd_plan(args: argparse.Namespace) -> int:
    from sparkdl import api

    config = load_config(args.conf, args.overrides)
    fmt = input_format(config)
    spark, created = get_spark(args.master, args.remote)
    try:
        df = read_input(spark, config, fmt)
        factory, _, _ = model_factory(df, config)
        result = api.plan(factory, df, config=config.merged({"train": {"strategy": "auto"}}))
        print(result.explain())
        if args.out:
            Path(args.out).write_text(result.to_json(), encoding="utf-8")
            print(f"plan written to {args.out}; train with it: --set train.plan_file={args.out}", file=sys.stderr)
        choice = result.choice
        print(json.dumps({"strategy": result.strategy, "options": result.options,
                          "predicted_step_s": choice.predicted_step_s if choice is not None else None,
                          "emulated": bool(result.auto.emulated) if result.auto is not None else False}))
        return 0
    finally:
        if created:
            spark.stop()


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="sparkdl", description="Train PyTorch models on Spark DataFrames.")
    top.epilog = ("sparkdl submit [spark-submit options] -- {train,plan} ...: the same under spark-submit "
                  "(e.g. --master spark://host:7077)")
    sub = top.add_subparsers(dest="command", required=True, metavar="{train,plan,demo,submit}")
    train = sub.add_parser("train", help="train an MLP described by a TOML config file")
    train.add_argument("--conf", required=True, metavar="PATH", help="TOML file (see conf/examples/)")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override one option; values are TOML literals (repeatable)")
    train.add_argument("--master", help="Spark master (default: spark-submit's, else local[2]; an active "
                                        "session is always reused)")
    train.add_argument("--remote", metavar="sc://HOST:PORT", help="train through a Spark Connect server "
                                                                  "(default: $SPARK_REMOTE when set)")
    train.set_defaults(func=cmd_train)
    plan = sub.add_parser("plan", help="print the layout the planner would choose, and every alternative, "
                                       "without training")
    plan.add_argument("--conf", required=True, metavar="PATH", help="TOML file (see conf/examples/)")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                      help="override one option (repeatable); train.strategy is treated as 'auto' (options only one "
                           "strategy has, or one worker, still decide it without the planner)")
    plan.add_argument("--master", help="Spark master (as for train)")
    plan.add_argument("--remote", metavar="sc://HOST:PORT", help="Spark Connect server (as for train)")
    plan.add_argument("--out", metavar="PATH", help="also write the plan as JSON (train with --set train.plan_file=PATH)")
    plan.set_defaults(func=cmd_plan)
    demo = sub.add_parser("demo", help="train on the bundled digits and print the test accuracy")
    demo.add_argument("--master", default="local-cluster[2,1,1024]", help="default: %(default)s")
    demo.add_argument("--epochs", type=int, default=15, help="default: %(default)s")
    demo.add_argument("--workers", type=int, default=2, help="default: %(default)s")
    demo.set_defaults(func=cmd_demo)
    return top


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["submit"]:  # spark-submit's own options follow: not for argparse
        from sparkdl.submit import run_submit

        try:
            return run_submit(argv[1:])
        except SparkdlError as exc:
            print(f"error: {redact_text(str(exc))}", file=sys.stderr)
            return 2
    try:
        args = parser().parse_args(argv)
    except SystemExit as exc:  # bad usage (2) or --help (0): a return code, also when called in-process
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return int(args.func(args))
    except SparkdlError as exc:  # scheduled jobs keep stderr in their logs: no URL password or key there
        print(f"error: {redact_text(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
