"""What sparkdl prints and logs carries no secrets (tracking/redaction.py), checked without Spark."""
from __future__ import annotations

import os
import stat
import sys

import pytest

from sparkdl.tracking.mlflow_run import redact
from sparkdl.tracking.redaction import is_secret_name, redact_command, redact_text


@pytest.mark.parametrize("raw, shown", [
    ("s3://AKIA:secret@bucket/p", "s3://AKIA:***@bucket/p"),
    ("s3://AKIA:se@cr@et@bucket/path?x=1", "s3://AKIA:***@bucket/path?x=1"),  # a password holding '@'
    ("postgresql://u:p@ss@db:5432/x failed", "postgresql://u:***@db:5432/x failed"),
    ("abfs://c@acct.dfs.core.windows.net/p?sv=2020&sig=ab%2Fc&se=2021", "abfs://c@acct.dfs.core.windows.net/p?sv=2020&sig=***&se=2021"),
    ("https://h/x?access_token=zz&page=2", "https://h/x?access_token=***&page=2"),
    ("wasbs://c@a.blob.core.windows.net/?account_key=K1", "wasbs://c@a.blob.core.windows.net/?account_key=***"),
    ("https://b.s3.amazonaws.com/k?X-Amz-Credential=AK%2F&X-Amz-Signature=f00", "https://b.s3.amazonaws.com/k?X-Amz-Credential=***&X-Amz-Signature=***"),
    ("could not connect: password=hunter2, tokens=5", "could not connect: password=***, tokens=5"),
    ("DefaultEndpointsProtocol=https;AccountKey=abc;EndpointSuffix=core", "DefaultEndpointsProtocol=https;AccountKey=***;EndpointSuffix=core"),
    ("KeyError: 'label'", "KeyError: 'label'"),  # an exception and its message, not a key and its value
    ("hdfs://user@nn:8020/p", "hdfs://user@nn:8020/p"),  # a user without a password is no secret
    ("lr=0.1 train.sync_every=50", "lr=0.1 train.sync_every=50"),
    ("{'password': 'x1', 'user': 'u'}", "{'password': '***', 'user': 'u'}"),  # a dict's repr
    ('{"secret_key": "x1", "n": 2}', '{"secret_key": "***", "n": 2}'),  # JSON stays JSON
    ("Authorization: Bearer eyJhbGciOi.abc\nnext line", "Authorization: ***\nnext line"),
    ("    key = self._keys[i]", "    key = self._keys[i]"),  # a traceback's source line is code
    ("    sig = inspect.signature(fn)", "    sig = inspect.signature(fn)"),
])
def test_text_is_redacted(raw: str, shown: str) -> None:
    assert redact_text(raw) == shown


def test_secret_names_by_word() -> None:
    secret = ["fs.s3a.secret.key", "spark.hadoop.fs.s3a.access.key", "AWSAccessKeyId", "X-Amz-Signature",
              "fs.azure.account.key.acct.blob.core.windows.net", "sig", "access_token", "db_password",
              "spark.authenticate.secret"]
    plain = ["train.lr", "launch.channel", "data.spool_dir", "tracking.tracking_uri", "train.signal", "tokens",
             "spark.executor.memory", "monkey"]
    assert [n for n in secret if not is_secret_name(n)] == []
    assert [n for n in plain if is_secret_name(n)] == []


def test_logged_params_mask_secret_names_and_urls() -> None:
    params = redact({"storage.s3_secret_key": "xyz", "data.path": "s3://k:pw@b/data?token=t0",
                     "train.lr": 0.1, "tracking.tracking_uri": "https://u:pw@mlflow:5000"})
    assert params == {"storage.s3_secret_key": "***", "data.path": "s3://k:***@b/data?token=***", "train.lr": 0.1,
                      "tracking.tracking_uri": "https://u:***@mlflow:5000"}


def test_conf_values_are_masked_in_every_spelling() -> None:
    shown = redact_command(["spark-submit", "--conf", "spark.hadoop.fs.s3a.secret.key=XYZ",
                            "--conf=spark.hadoop.fs.s3a.access.key=AK", "-c", "spark.executor.memory=4g",
                            "--conf", "spark.pyspark.python=/usr/bin/python3", "cli.py", "--data", "s3://a:b@c/d"])
    assert shown == ["spark-submit", "--conf", "spark.hadoop.fs.s3a.secret.key=***",
                     "--conf=spark.hadoop.fs.s3a.access.key=***", "-c", "spark.executor.memory=4g",
                     "--conf", "spark.pyspark.python=/usr/bin/python3", "cli.py", "--data", "s3://a:***@c/d"]


def test_sparkdl_submit_prints_no_secret_but_passes_it_on(tmp_path, monkeypatch, capfd) -> None:  # type: ignore[no-untyped-def]
    """A real `sparkdl submit` with a spark-submit that records its arguments: the printed command is
    masked, the one run is not."""
    from sparkdl.cli import main

    seen = tmp_path / "argv.txt"
    script = tmp_path / "bin" / "spark-submit"
    script.parent.mkdir()
    script.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {seen}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("SPARK_HOME", str(tmp_path))
    monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)
    code = main(["submit", "--conf", "spark.hadoop.fs.s3a.secret.key=TOPSECRET", "--", "train", "--set",
                 "data.path=s3://k:pa55@b/x"])
    printed = capfd.readouterr().err
    assert code == 0 and "spark.hadoop.fs.s3a.secret.key=***" in printed and "s3://k:***@b/x" in printed
    assert "TOPSECRET" not in printed and "pa55" not in printed
    passed = seen.read_text().split("\n")
    assert "spark.hadoop.fs.s3a.secret.key=TOPSECRET" in passed and "data.path=s3://k:pa55@b/x" in passed
    assert os.path.isfile(seen)
