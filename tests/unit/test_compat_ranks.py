"""sparkdl.compat's pure parts without Spark: the rank variables, a rank's child process (real
subprocesses), the failure naming, and partition_batches against PySpark's own partition dataset."""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from sparkdl.compat.launcher import compat_options, rank_error
from sparkdl.errors import ConfigError, RankFunctionError, TrainingError
from sparkdl.executor.child_process import child_env, first_failure, rank_failure, run_child
from sparkdl.executor.child_rank import run_children, write_partition
from sparkdl.wire.child import ChildCall, torchrun_variables
from sparkdl.wire.codec import dumps_any


def test_the_torchrun_variables_of_a_rank() -> None:
    env = torchrun_variables(3, 4, 1, 2, 1, 2, "10.0.0.1", 29500, "run-1")
    assert env["RANK"] == "3" and env["WORLD_SIZE"] == "4" and env["LOCAL_RANK"] == "1"
    assert env["LOCAL_WORLD_SIZE"] == "2" and env["GROUP_RANK"] == "1" and env["NODE_RANK"] == "1"
    assert env["MASTER_ADDR"] == "10.0.0.1" and env["MASTER_PORT"] == "29500" and env["TORCHELASTIC_RUN_ID"] == "run-1"
    assert all(isinstance(v, str) for v in env.values())


def test_a_child_call_is_a_function_or_a_script() -> None:
    with pytest.raises(ValueError):
        ChildCall()
    with pytest.raises(ValueError):
        ChildCall(function=b"x", script="a.py")
    with pytest.raises(ValueError):
        ChildCall(function=b"x", framework="mpi")
    with pytest.raises(ValueError):
        ChildCall(function=b"x", framework="horovod", processes_per_task=2)


def _call(fn, *args, **kwargs) -> ChildCall:  # type: ignore[no-untyped-def]
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return ChildCall(function=dumps_any((fn, args, kwargs)))


def adds(a: int, b: int = 0) -> dict:
    print("adding", a, b)
    print("to stderr", file=sys.stderr)
    return {"sum": a + b, "rank": os.environ.get("RANK"), "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}


def raises() -> None:
    raise KeyError("no such key")


def exits(code: int) -> None:
    sys.exit(code)


def dies() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def sleeps() -> None:
    time.sleep(120)


def _run(call: ChildCall, tmp_path: Path, variables: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    lines: list[tuple[str, str]] = []
    tmp_path.mkdir(parents=True, exist_ok=True)
    outcome = run_child(call, child_env(variables or {}, use_gpu=False), str(tmp_path),
                        lambda stream, line: lines.append((stream, line)))
    return outcome, lines


def test_a_child_runs_the_function_with_its_variables_and_hands_back_the_value_and_every_line(tmp_path: Path) -> None:
    import pickle

    outcome, lines = _run(_call(adds, 2, b=3), tmp_path, {"RANK": "1"})
    assert outcome.error is None and outcome.returncode == 0
    assert pickle.loads(outcome.result) == {"sum": 5, "rank": "1", "cuda": ""}  # use_gpu=False hides GPUs
    assert ("stdout", "adding 2 3") in lines and ("stderr", "to stderr") in lines


def test_a_failing_child_reports_the_users_exception_type_message_and_traceback(tmp_path: Path) -> None:
    outcome, _ = _run(_call(raises), tmp_path)
    assert outcome.error["type"] == "KeyError" and outcome.error["module"] == "builtins"
    assert outcome.error["message"] == "'no such key'" and "in raises" in outcome.error["traceback"]
    exc = rank_failure(2, outcome.error)
    assert "".join(traceback.format_exception_only(type(exc), exc)).strip() == "KeyError: 'no such key'"
    assert exc.rank == 2 and "in raises" in exc.rank_traceback
    custom = rank_failure(0, {"type": "Bad", "module": "mypkg.errors", "message": "m", "traceback": ""})
    assert "".join(traceback.format_exception_only(type(custom), custom)).strip() == "mypkg.errors.Bad: m"


def test_sys_exit_zero_is_success_and_other_codes_and_signals_are_failures(tmp_path: Path) -> None:
    outcome, _ = _run(_call(exits, 0), tmp_path / "a")
    assert outcome.error is None
    outcome, _ = _run(_call(exits, 3), tmp_path / "b")
    assert outcome.error["type"] == "SystemExit" and outcome.error["message"] == "3"
    outcome, _ = _run(_call(dies), tmp_path / "c")
    assert "died of signal SIGKILL" in outcome.error["message"] and "OOM killer" in outcome.error["message"]


def test_a_script_gets_its_arguments_and_a_failing_one_its_stderr_tail(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("import sys\nprint('args', sys.argv[1:])\nif '--fail' in sys.argv: raise SystemExit('bad')\n")
    outcome, lines = _run(ChildCall(script=str(script), script_args=("--x", "1")), tmp_path / "a")
    assert outcome.error is None and outcome.result is None and ("stdout", "args ['--x', '1']") in lines
    outcome, _ = _run(ChildCall(script=str(script), script_args=("--fail",)), tmp_path / "b")
    assert outcome.error["message"].endswith("exited with code 1") and "bad" in outcome.error["traceback"]


def test_once_a_rank_fails_its_waiting_siblings_are_stopped(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    calls = [_call(raises), _call(sleeps)]
    started = time.monotonic()
    # run_children takes one call for all ranks; two different functions go through their own runs
    outcomes: list = [None, None]
    stop = threading.Event()

    def one(i: int) -> None:
        (tmp_path / str(i)).mkdir()
        outcomes[i] = run_child(calls[i], child_env({}, False), str(tmp_path / str(i)), lambda s, l: None, stop)
        if outcomes[i].error is not None:
            threading.Timer(0.5, stop.set).start()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert time.monotonic() - started < 30
    assert outcomes[1].error["echo"] and first_failure(outcomes) == (0, outcomes[0].error)
    echo = {"type": "RuntimeError", "module": "builtins", "message": "gloo/transport: Connection closed by peer"}
    own = {"type": "ValueError", "module": "builtins", "message": "x"}
    from sparkdl.executor.child_process import ChildOutcome

    assert first_failure([ChildOutcome(1, None, echo), ChildOutcome(1, None, own)]) == (1, own)
    # run_children: the same grace rule, every rank's lines prefixed on the driver
    outs = run_children(_call(adds, 1), [child_env({"RANK": str(r)}, False) for r in range(2)], str(tmp_path), [0, 1],
                        prefix_always=True)
    assert [o.error for o in outs] == [None, None]
    assert "[rank 1] adding 1 0" in capsys.readouterr().out


def test_compat_options_take_launch_and_tracking_only_and_show_every_ranks_output() -> None:
    options = compat_options("TorchDistributor", 2, {"timeout_s": 30, "tracking": False})
    assert options.launch.rank_output == "all" and options.launch.timeout_s == 30 and options.launch.num_workers == 2
    assert compat_options("x", 2, {"rank_output": "rank0"}).launch.rank_output == "rank0"
    with pytest.raises(ConfigError, match="epochs belong to train"):
        compat_options("TorchDistributor", 2, {"epochs": 3})
    with pytest.raises(ConfigError, match="unknown option"):
        compat_options("TorchDistributor", 2, {"timeout": 3})


def test_the_drivers_error_names_the_rank_the_users_type_and_its_traceback() -> None:
    exc = TrainingError("training failed on rank 1: ValueError: bad lr (on host h1)", hint="x")
    exc.rank, exc.rank_text = 1, "ValueError: bad lr\nTraceback (most recent call last):\n  File \"t.py\", line 3\n"
    named = rank_error("TorchDistributor", exc)
    assert isinstance(named, RankFunctionError) and named.rank == 1 and named.exception_type == "ValueError"
    assert named.exception_message == "bad lr" and 'File "t.py"' in str(named)
    lost = TrainingError("the training job failed: executor lost")
    assert rank_error("TorchDistributor", lost) is lost


def _spark_schema(fields: list[tuple[str, str]]) -> str:
    return json.dumps({"type": "struct", "fields": [{"name": n, "type": t, "nullable": True, "metadata": {}}
                                                    for n, t in fields]})


def test_partition_batches_give_pysparks_rows_in_its_order_with_its_wrap_around(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("torch")
    from pyspark.sql.types import StructType

    from pyspark.ml.torch.data import _SparkPartitionTorchDataset
    from sparkdl.compat import partition_batches

    vector = pa.struct([("type", pa.int8()), ("size", pa.int32()), ("indices", pa.list_(pa.int32())),
                        ("values", pa.list_(pa.float64()))])
    batches = [pa.record_batch({"x": pa.array([1.5, 2.5, 3.5]), "arr": pa.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]),
                                "v": pa.array([{"type": 1, "size": None, "indices": None, "values": [1.0, 0.0]},
                                               {"type": 0, "size": 2, "indices": [1], "values": [7.0]},
                                               {"type": 1, "size": None, "indices": None, "values": [0.5, 0.5]}],
                                              vector),
                                "y": pa.array([0, 1, 2], pa.int64())}),
               pa.record_batch({"x": pa.array([4.5]), "arr": pa.array([[7.0, 8.0]]),
                                "v": pa.array([{"type": 0, "size": 2, "indices": [0], "values": [9.0]}], vector),
                                "y": pa.array([3], pa.int64())})]
    schema = _spark_schema([("x", "double"), ("arr", {"type": "array", "elementType": "double", "containsNull": True}),
                            ("v", {"type": "udt", "class": "org.apache.spark.ml.linalg.VectorUDT",
                                   "pyClass": "pyspark.ml.linalg.VectorUDT", "sqlType": {"type": "struct", "fields": []}}),
                            ("y", "long")])
    variables = write_partition(ChildCall(function=b"x", partition_schema=schema), iter(batches), str(tmp_path), 0)
    for key, value in variables.items():
        monkeypatch.setenv(key, value)
    with open(variables["SPARK_DATAFRAME_SCHEMA_FILE"]) as f:
        spark_schema = StructType.fromJson(json.load(f))
    for num_samples in (2, 4, 7):
        theirs = [[np.asarray(v, dtype=np.float64).tolist() for v in row]
                  for row in _SparkPartitionTorchDataset(variables["SPARK_PARTITION_ARROW_DATA_FILE"], spark_schema,
                                                         num_samples)]
        ours = [[np.asarray(c[i].tolist(), dtype=np.float64).tolist() for c in batch]
                for batch in partition_batches(3, num_samples=num_samples) for i in range(len(batch[0]))]
        assert ours == theirs, num_samples
    x, = next(partition_batches(10, columns=["x"], as_tensors=False))
    assert x.tolist() == [1.5, 2.5, 3.5, 4.5]
    with pytest.raises(ConfigError, match="no column 'z'"):
        next(partition_batches(2, columns=["z"]))
    monkeypatch.delenv("SPARK_PARTITION_ARROW_DATA_FILE")
    with pytest.raises(ConfigError, match="_train_on_dataframe"):
        next(partition_batches(2))


def test_an_empty_partition_is_refused_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="repartition"):
        write_partition(ChildCall(function=b"x", partition_schema="{}"), iter([]), str(tmp_path), 1)
    assert write_partition(ChildCall(function=b"x"), iter([pa.record_batch({"id": [1]})]), str(tmp_path), 0) == {}
