"""`sparkdl train --conf x.toml [--set a.b=c]` and `sparkdl demo`: thin commands over the estimator.

A TOML file cannot hold an nn.Module, so `train` builds an MLP from an extra `[mlp]` table
(`hidden = [128]`, optional `outputs`) that is split off before the rest becomes a RunConfig.
pyspark and torch are imported inside the commands, so `sparkdl --help` stays fast.
"""
from __future__ import annotations

import argparse
import difflib
import functools
import json
import os
import sys
import time
import tomllib
from pathlib import Path
from typing import Any, Sequence

from sparkdl.config import RunConfig
from sparkdl.errors import ConfigError, EmptyDataError, SparkdlError

MLP_KEYS = ("hidden", "outputs")
FORMATS = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".orc": "orc"}


def build_mlp(inputs: int, hidden: Sequence[int], outputs: int) -> Any:
    """inputs -> hidden[0] -> ... -> outputs, ReLU between layers (module level: pickled by reference)."""
    from torch import nn

    widths = [inputs, *hidden]
    layers: list[nn.Module] = []
    for width_in, width_out in zip(widths, widths[1:]):
        layers += [nn.Linear(width_in, width_out), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(widths[-1], outputs))


def load_config(path: str, overrides: Sequence[str]) -> tuple[RunConfig, dict[str, Any]]:
    """RunConfig from the TOML file and `--set` overrides, plus the `[mlp]` options split off both."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"config file {path!r} does not exist",
                          hint="pass --conf with the path of a TOML file, e.g. conf/examples/digits.toml")
    try:
        nested = tomllib.loads(file.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path!r} is not valid TOML: {exc}") from None
    mlp = dict(nested.pop("mlp", {}) or {})
    rest: list[str] = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if sep and key.strip().startswith("mlp."):
            mlp[key.strip()[len("mlp."):]] = _literal(raw.strip())
        else:
            rest.append(item)
    for key in mlp:
        if key not in MLP_KEYS:
            close = difflib.get_close_matches(key, MLP_KEYS, n=1)
            raise ConfigError(f"unknown option mlp.{key}", hint=(f"did you mean {close[0]!r}? " if close else "")
                              + f"known: {', '.join(MLP_KEYS)}")
    hidden = mlp.get("hidden", [128])
    if not isinstance(hidden, list) or not all(isinstance(w, int) and not isinstance(w, bool) and w > 0
                                               for w in hidden):
        raise ConfigError(f"mlp.hidden must be a list of positive layer widths, got {hidden!r}",
                          hint="for example hidden = [128] or --set mlp.hidden=[64,64]")
    outputs = mlp.get("outputs")
    if outputs is not None and (not isinstance(outputs, int) or isinstance(outputs, bool) or outputs < 1):
        raise ConfigError(f"mlp.outputs must be a positive integer, got {outputs!r}",
                          hint="leave it out to use the number of classes (cross_entropy) or 1")
    config = RunConfig().merged(nested).with_overrides(rest).validate()
    return config, {"hidden": list(hidden), "outputs": outputs}


def _literal(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def get_spark(master: str | None, app_name: str = "sparkdl") -> tuple[Any, bool]:
    """(session, created_here). An active session wins; under spark-submit its master wins; else local[2]."""
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        if master and master != active.sparkContext.master:
            print(f"note: reusing the active Spark session (master {active.sparkContext.master}); "
                  f"--master {master} is ignored", file=sys.stderr)
        return active, False
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    under_submit = "PYSPARK_GATEWAY_PORT" in os.environ or "--master" in os.environ.get("PYSPARK_SUBMIT_ARGS", "")
    if master or not under_submit:
        builder = builder.master(master or "local[2]")
    return builder.getOrCreate(), True


def read_input(spark: Any, config: RunConfig) -> Any:
    from pyspark.errors import AnalysisException

    source = config.input
    if bool(source.table) == bool(source.path):
        raise ConfigError("set exactly one of input.table and input.path" if source.table else
                          "no input: input.table and input.path are both unset",
                          hint="for example --set input.path=/data/digits.parquet or --set input.table=db.digits")
    try:
        if source.table:
            return spark.table(source.table)
        fmt = source.format
        if fmt == "auto":
            suffix = Path(source.path.rstrip("/")).suffix.lower()
            if suffix and suffix not in FORMATS:
                raise ConfigError(f"cannot tell the format of input.path {source.path!r} from its extension",
                                  hint="set input.format to parquet, csv, json or orc")
            fmt = FORMATS.get(suffix, "parquet")
        reader = spark.read.format(fmt)
        if fmt == "csv":
            reader = reader.option("header", "true").option("inferSchema", "true")
        return reader.load(source.path)
    except AnalysisException as exc:
        what = f"table {source.table!r}" if source.table else f"input.path {source.path!r}"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"cannot read {what}: {first}",
                          hint="check the path/table name and input.format") from None


def mlp_factory(df: Any, config: RunConfig, mlp: dict[str, Any]) -> tuple[Any, int, int]:
    """(zero-argument model factory, input width, output width) computed with cheap Spark jobs."""
    from pyspark.sql import functions as F

    from sparkdl.api import _label_is_integral
    from sparkdl.data.feed import check_columns, feature_kind, features_expression
    from sparkdl.launch.objectives import is_classification

    cols = list(config.data.feature_cols)
    label = config.data.label_col
    check_columns(df, cols + ([label] if label else []))
    if all(feature_kind(df, name) == "scalar" for name in cols):
        inputs = len(cols)
    else:
        row = df.select(F.size(features_expression(df, cols)).alias("n")).first()
        if row is None:
            raise EmptyDataError("the DataFrame has no rows", hint="check the filters or the input path")
        inputs = int(row["n"] or 0)
    outputs = mlp["outputs"]
    if outputs is None:
        outputs = 1
        if label and config.train.loss not in ("mse", "bce_with_logits") and \
                is_classification(config.train, _label_is_integral(df, label)):
            top = df.agg(F.max(F.col(label).cast("double")).alias("m")).first()["m"]
            outputs = max(int(top) + 1, 1) if top is not None else 1
    return functools.partial(build_mlp, inputs, tuple(mlp["hidden"]), outputs), inputs, outputs


def _check_output(config: RunConfig) -> None:
    """Fail before training, not after, when the model directory exists and overwrite is off."""
    path = config.output.model_path
    if not path or config.output.overwrite:
        return
    try:
        import pyarrow.fs as pafs

        fs, root = pafs.FileSystem.from_uri(path if "://" in path else os.path.abspath(path))
        exists = fs.get_file_info(root).type != pafs.FileType.NotFound
    except Exception:  # noqa: BLE001 - a filesystem pyarrow cannot reach is checked by the save itself
        return
    if exists:
        raise ConfigError(f"output.model_path {path!r} already exists",
                          hint="--set output.overwrite=true, or choose another output.model_path")


def print_history(history: Sequence[dict[str, Any]], epochs: int) -> None:
    for h in history:
        print(f"epoch {h['epoch'] + 1}/{epochs}  loss {h['loss']:.4f}  "
              f"samples/s {h.get('samples_per_sec', 0.0):.0f}", flush=True)


def cmd_train(args: argparse.Namespace) -> int:
    from sparkdl.estimator import TorchEstimator

    config, mlp = load_config(args.conf, args.overrides)
    _check_output(config)
    spark, created = get_spark(args.master)
    try:
        started = time.perf_counter()
        df = read_input(spark, config)
        factory, inputs, outputs = mlp_factory(df, config, mlp)
        model = TorchEstimator(model=factory, config=config).fit(df)
        seconds = time.perf_counter() - started
        print_history(model.history, config.train.epochs)
        path = config.output.model_path
        if path:
            writer = model.write()
            (writer.overwrite() if config.output.overwrite else writer).save(path)
        else:
            print("note: output.model_path is unset, so the model was not saved "
                  "(--set output.model_path=PATH to save it)", file=sys.stderr)
        last = model.history[-1] if model.history else {}
        print(json.dumps({"run_id": model.run_id, "epochs": len(model.history), "final_loss": last.get("loss"),
                          "seconds": round(seconds, 2), "inputs": inputs, "mlp_hidden": mlp["hidden"],
                          "outputs": outputs, "num_workers": config.launch.num_workers, "model_path": path}))
        return 0
    finally:
        if created:
            spark.stop()


def demo_session(master: str, workers: int) -> Any:
    """A fresh session on `master`; falls back to local[workers] when the cluster does not come up."""
    from pyspark.sql import SparkSession

    from sparkdl.launch.driver import concurrent_slots

    os.environ["PYSPARK_PYTHON"] = sys.executable
    builder = (SparkSession.builder.appName("sparkdl-demo").config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false"))
    try:
        spark = builder.master(master).getOrCreate()
        deadline = time.monotonic() + 60
        while concurrent_slots(spark) < workers and time.monotonic() < deadline:
            time.sleep(0.5)
        slots = concurrent_slots(spark)
        if slots >= workers or not master.startswith("local-cluster"):
            return spark
        spark.stop()
        reason = f"only {slots} of {workers} task slots came up within 60 s"
    except Exception as exc:  # noqa: BLE001 - any failure to start the cluster leads to the fallback
        reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    print(f"note: {master} did not start ({reason}); falling back to local[{workers}]", flush=True)
    return builder.master(f"local[{workers}]").getOrCreate()


def cmd_demo(args: argparse.Namespace) -> int:
    from pyspark.sql import functions as F

    from sparkdl.datasets import digits_dataframe, train_test_split_digits
    from sparkdl.estimator import TorchEstimator

    started = time.perf_counter()
    spark = demo_session(args.master, args.workers)
    try:
        print(f"spark master: {spark.sparkContext.master}", flush=True)
        train_idx, test_idx = train_test_split_digits(seed=0)
        train_df = digits_dataframe(spark, indices=train_idx)
        test_df = digits_dataframe(spark, indices=test_idx)
        estimator = TorchEstimator(model=functools.partial(build_mlp, 64, (128,), 10),
                                   feature_cols=[f"p{i}" for i in range(64)], label_col="label", optimizer="adam",
                                   lr=1e-3, batch_size=32, epochs=args.epochs, num_workers=args.workers)
        model = estimator.fit(train_df)
        print_history(model.history, args.epochs)
        scored = model.transform(test_df)
        row = scored.agg(F.avg((F.col("prediction") == F.col("label")).cast("double")).alias("acc")).first()
        print(f"test accuracy: {row['acc']:.3f} ({len(test_idx)} test rows, "
              f"{time.perf_counter() - started:.1f} s in all)", flush=True)
        return 0
    finally:
        spark.stop()


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="sparkdl", description="Train PyTorch models on Spark DataFrames.")
    sub = top.add_subparsers(dest="command", required=True, metavar="{train,demo}")
    train = sub.add_parser("train", help="train an MLP described by a TOML config file")
    train.add_argument("--conf", required=True, metavar="PATH", help="TOML file (see conf/examples/)")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override one option; values are TOML literals (repeatable)")
    train.add_argument("--master", default=None,
                       help="Spark master (default: spark-submit's, else local[2]; an active session wins)")
    train.set_defaults(func=cmd_train)
    demo = sub.add_parser("demo", help="train on the bundled digits data and print the test accuracy")
    demo.add_argument("--master", default="local-cluster[2,1,1024]")
    demo.add_argument("--epochs", type=int, default=15)
    demo.add_argument("--workers", type=int, default=2)
    demo.set_defaults(func=cmd_demo)
    return top


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
    except SystemExit as exc:  # bad usage (2) or --help (0): a return code, also when called in-process
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return int(args.func(args))
    except SparkdlError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
