"""The pure helpers of a launch's failure path and of the wire between driver and executors, without
Spark: which failures are retried, which rank is named, how Spark's long error is read, the shard
check every rank runs, and how result batches round-trip."""
from __future__ import annotations

import io
import pickle

import pyarrow as pa
import pytest
import torch

from sparkdl.config import RunConfig
from sparkdl.data.epochs import BatchOptions, check_shards
from sparkdl.errors import EmptyDataError, TrainingError
from sparkdl.driver.attempts import name_the_failure, retryable
from sparkdl.driver.job import training_error
from sparkdl.wire.codec import (FAILURE_MARKER, RESULT_CHUNK_BYTES, collect_parts, dumps_any, failure_text,
                                loads_history, loads_result, parse_failure, result_batches)


def own(text: str, host: str = "h1") -> dict:
    return {"text": text, "peer_failure": False, "host": host}


def echo(text: str = "RuntimeError: Connection reset by peer") -> dict:
    return {"text": text, "peer_failure": True, "host": "h2"}


# -- retryable -------------------------------------------------------------------------------------

def test_only_lost_peers_are_retried() -> None:
    assert retryable({0: echo(), 1: echo("gloo/transport: Connection closed by peer")})
    assert retryable({})  # nobody reported: an executor vanished before anyone could speak
    assert not retryable({0: echo(), 1: own("ValueError: bad shape")}), "a rank's own error would fail again"
    assert not retryable({0: echo("RuntimeError: Socket Timeout: timed out after 600 s")}), "a stall would stall again"
    assert not retryable({0: echo("collective operation timeout")})


# -- name_the_failure --------------------------------------------------------------------------------

def test_the_rank_with_its_own_error_is_named_not_the_echoes() -> None:
    config = RunConfig()
    fallback = TrainingError("the training job failed: ...", hint="see the executor logs")
    named = name_the_failure({0: echo(), 3: own("ValueError: shapes (2,3) and (4,5)\ntraceback...", host="node-7")},
                             4, config.launch.timeout_s, fallback)
    assert isinstance(named, TrainingError)
    assert str(named).startswith("training failed on rank 3: ValueError: shapes (2,3) and (4,5) (on host node-7)")
    assert named.hint == "see the executor logs"


def test_the_lowest_own_error_wins_and_echoes_alone_name_the_first_reporter() -> None:
    config = RunConfig()
    fallback = TrainingError("x")
    assert "rank 1:" in str(name_the_failure({2: own("KeyError: b"), 1: own("KeyError: a")}, 3, config.launch.timeout_s, fallback))
    only_echoes = name_the_failure({2: echo(), 1: echo("RuntimeError: Broken pipe")}, 3, config.launch.timeout_s, fallback)
    assert str(only_echoes).startswith("training failed on rank 1: RuntimeError: Broken pipe")


def test_silent_ranks_are_named_when_every_report_is_a_timeout() -> None:
    config = RunConfig.from_kwargs(timeout_s=30.0)
    named = name_the_failure({0: echo("RuntimeError: timed out"), 2: echo("Socket Timeout")}, 3, config.launch.timeout_s,
                             TrainingError("x"))
    assert "rank(s) [1] stopped responding" in str(named) and "launch.timeout_s=30 s" in str(named)
    assert "launch.timeout_s" in (named.hint or "")


def test_silent_ranks_are_named_with_their_hosts_when_the_driver_heard_them() -> None:
    config = RunConfig.from_kwargs(timeout_s=30.0)
    named = name_the_failure({0: echo("RuntimeError: timed out")}, 2, config.launch.timeout_s, TrainingError("x"),
                             ["198.18.0.11", "198.18.0.12"])
    assert "rank(s) [1] (on host 198.18.0.12) stopped responding" in str(named)
    assert "unreachable host" in (named.hint or "")


def test_silent_ranks_the_driver_cannot_reach_are_named_as_cut_off_with_the_address_dialled() -> None:
    config = RunConfig.from_kwargs(timeout_s=15.0)
    named = name_the_failure({0: echo("RuntimeError: timed out")}, 2, config.launch.timeout_s, TrainingError("x"),
                             ["198.18.0.11", "198.18.0.12"], {1: "198.18.0.12:40123"})
    assert "rank(s) [1] (on host 198.18.0.12) cannot be reached" in str(named), str(named)
    assert "dialled 198.18.0.12:40123" in str(named) and "launch.timeout_s=15 s" in str(named)
    assert "checkpoint_dir" in (named.hint or "") and "link" in (named.hint or "")


def test_a_host_answers_when_it_accepts_or_refuses_a_connection() -> None:
    import socket

    from sparkdl.comm.reachability import host_answers

    with socket.create_server(("127.0.0.1", 0)) as listening:
        assert host_answers(f"127.0.0.1:{listening.getsockname()[1]}", 1.0)
    with socket.socket() as closed:  # bound, not listening: the host refuses, so it is there
        closed.bind(("127.0.0.1", 0))
        assert host_answers(f"127.0.0.1:{closed.getsockname()[1]}", 1.0)
    assert not host_answers("no-such-host.invalid:1", 1.0)


def test_a_ranks_own_hint_replaces_the_generic_one() -> None:
    message = {**own("ConfigError: rank 1 cannot reach rank 0", host="h1"), "hint": "open the ports"}
    named = name_the_failure({1: message}, 2, RunConfig().launch.timeout_s, TrainingError("x", hint="see the executor logs"))
    assert named.hint == "open the ports"


def test_no_reports_keep_sparks_error() -> None:
    fallback = TrainingError("the training job failed: executor lost")
    assert name_the_failure({}, 2, RunConfig().launch.timeout_s, fallback) is fallback


# -- training_error / the failure marker ---------------------------------------------------------------

def test_the_failure_marker_round_trips_through_sparks_wrapping() -> None:
    text = failure_text(1, "ValueError: boom", "Traceback (most recent call last):\n  ...")
    spark_error = ("org.apache.spark.SparkException: Job aborted due to stage failure: Task 1 in stage 3.0 "
                   f"failed 1 times\n  at org.apache...\nPythonException: RuntimeError: {text}\n  at ...")
    assert parse_failure(spark_error) == (1, "ValueError: boom")
    assert parse_failure("no marker here") is None
    error = training_error(RuntimeError(spark_error))
    assert isinstance(error, TrainingError) and str(error).startswith("training failed on rank 1: ValueError: boom")
    assert FAILURE_MARKER not in str(error)


def test_an_unmarked_failure_keeps_the_cause_lines() -> None:
    text = ("py4j.protocol.Py4JJavaError: An error occurred while calling o123.collect.\n"
            ": org.apache.spark.SparkException: Job aborted due to stage failure: barrier stage failed\n"
            "\tat org.apache.spark.scheduler.DAGScheduler.failJobAndIndependentStages\n"
            "Caused by: java.io.IOException: Connection reset\n")
    error = training_error(RuntimeError(text))
    assert str(error).startswith("the training job failed:") and "java.io.IOException: Connection reset" in str(error)
    assert "at org.apache" not in str(error)


# -- check_shards (every rank runs it on the same row counts) ---------------------------------------------

def test_check_shards_gives_every_rank_the_same_verdict() -> None:
    data = RunConfig().data
    assert check_shards([10, 9], data).steps == 1
    with pytest.raises(EmptyDataError, match=r"rank\(s\) \[1\] received no rows"):
        check_shards([10, 0], data)
    with pytest.raises(EmptyDataError, match="drop_last=True with batch_size=64 leaves no full batch"):
        check_shards([10, 9], BatchOptions(64, drop_last=True))
    assert check_shards([64, 10], BatchOptions(64, drop_last=True)).steps == 1


# -- result batches --------------------------------------------------------------------------------------

def _rows(batches: list[pa.RecordBatch]) -> list[dict]:
    return pa.Table.from_batches(batches).to_pylist()


def test_a_custom_result_larger_than_a_chunk_is_reassembled_from_rank_0() -> None:
    value = {"blob": b"x" * (RESULT_CHUNK_BYTES + 10), "n": 3}
    payload = dumps_any(value)
    batches = result_batches(0, [], payload) + result_batches(1, None, dumps_any("not rank 0"))
    kinds = [(r["rank"], r["kind"], r["seq"]) for r in _rows(batches)]
    assert kinds[:3] == [(0, "history", 0), (0, "payload", 0), (0, "payload", 1)]
    parts = collect_parts(_rows(batches)[::-1])
    assert loads_result(parts) == value and loads_history(parts) == []
    assert pickle.loads(payload) == value


def test_no_payload_means_none() -> None:
    parts = collect_parts(_rows(result_batches(0, [], None)))
    assert loads_result(parts) is None and loads_history(parts) == []
