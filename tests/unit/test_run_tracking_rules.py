"""The pure pieces of a run's MLflow record surviving what the run survives (issue 52, part 6):
the retry rule of every MLflow call against a fake failing client (tracking/call_guard.py), the
tracker's params-once and unsent-metrics rules, a run ended once (FINISHED or FAILED, also on
KeyboardInterrupt), each attempt's world (driver/attempt_world.py), the membership record, and the
error of a run below min_workers. A real MLflow server and real executors: tests/spark/test_elastic.py."""
from __future__ import annotations

import warnings
from typing import Any

import pytest

from sparkdl.config import RunConfig
from sparkdl.driver.attempt_world import AttemptWorlds
from sparkdl.driver.elastic import MembershipChange, below_min_workers, hosts_lost, log_change
from sparkdl.tracking.call_guard import CallGuard
from sparkdl.tracking.mlflow_run import RunTracker


def refusal() -> Exception:
    from mlflow.exceptions import RestException

    return RestException({"error_code": "INVALID_PARAMETER_VALUE", "message": "Changing param values is not allowed"})


class Flaky:
    """An action failing its first `fails` calls with `error`."""

    def __init__(self, fails: int, error: Exception | None = None) -> None:
        self.fails, self.calls = fails, 0
        self.error = error or ConnectionError("Connection refused")

    def __call__(self) -> None:
        self.calls += 1
        if self.calls <= self.fails:
            raise self.error


def quiet_guard() -> tuple[CallGuard, list[float]]:
    pauses: list[float] = []
    return CallGuard(pause_s=0.5, sleep=pauses.append), pauses


def test_a_failed_call_is_tried_once_more_and_a_blip_costs_nothing() -> None:
    guard, pauses = quiet_guard()
    blip = Flaky(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a blip that the retry covers is not said
        assert guard.call("log metrics", blip) == "ok"
    assert blip.calls == 2 and pauses == [0.5] and guard.failures == 0 and not guard.said


def test_failures_are_said_once_and_later_calls_are_still_made() -> None:
    guard, pauses = quiet_guard()
    with pytest.warns(RuntimeWarning, match=r"MLflow tracking failed \(could not log metrics: ConnectionError"):
        assert guard.call("log metrics", Flaky(5)) == "failed"
    down = Flaky(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: the second failure is not a warning
        assert guard.call("set tags", down) == "failed"
    assert down.calls == 1  # while calls fail, each is tried once (a dead server costs one try per call)
    back = Flaky(0)
    assert guard.call("log metrics", back) == "ok" and back.calls == 1  # the server came back: tracking goes on
    assert guard.failures == 2 and guard.healthy and pauses == [0.5]


def test_a_refusal_is_never_tried_again_and_leaves_the_tracker_healthy() -> None:
    guard, pauses = quiet_guard()
    refused = Flaky(1, refusal())
    with pytest.warns(RuntimeWarning, match="INVALID_PARAMETER_VALUE"):
        assert guard.call("log params", refused) == "refused"
    assert refused.calls == 1 and pauses == [] and guard.healthy and guard.failures == 1


def test_a_call_that_must_not_run_twice_is_tried_once() -> None:
    guard, _ = quiet_guard()
    once = Flaky(1)
    with pytest.warns(RuntimeWarning):
        assert guard.call("log the model", once, retry=False) == "failed"
    assert once.calls == 1


class FakeClient:
    """MlflowClient's calls the tracker makes, recorded; `down` makes every call fail as a dead server."""

    def __init__(self) -> None:
        self.params: dict[str, str] = {}
        self.tags: dict[str, str] = {}
        self.metrics: list[tuple[str, float, int]] = []
        self.status: list[str] = []
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise ConnectionError("Connection refused")

    def log_batch(self, run_id: str, metrics: Any = (), params: Any = ()) -> None:
        self._check()
        for param in params:
            if param.key in self.params and self.params[param.key] != param.value:
                raise refusal()
            self.params[param.key] = param.value
        self.metrics += [(m.key, m.value, m.step) for m in metrics]

    def set_tag(self, run_id: str, key: str, value: str) -> None:
        self._check()
        self.tags[key] = value

    def set_terminated(self, run_id: str, status: str) -> None:
        self._check()
        self.status.append(status)


def tracker_on(client: FakeClient, clock: list[float] | None = None) -> RunTracker:
    tracker = RunTracker(enabled=True)
    tracker.run_id = "run"
    tracker._client = client  # noqa: SLF001 - the fake stands where MlflowClient would
    time_now = clock if clock is not None else [0.0]
    tracker._calls = CallGuard(pause_s=0.0, sleep=lambda s: None, rest_s=30.0,  # noqa: SLF001
                               clock=lambda: time_now[0])
    return tracker


def test_a_param_is_logged_once_and_a_changed_value_becomes_a_tag() -> None:
    client = FakeClient()
    tracker = tracker_on(client)
    tracker.log_params({"world.size": 3, "world.hosts": "a, b, c"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing refused, nothing said
        tracker.log_params({"world.size": 2, "world.hosts": "a, b, c", "extra": 1})
    assert client.params == {"world.size": "3", "world.hosts": "a, b, c", "extra": "1"}
    assert client.tags == {"world.size": "2"} and tracker.failures == 0


def test_metric_points_of_a_failed_call_go_with_a_later_one_and_the_run_ends_once() -> None:
    client, clock = FakeClient(), [0.0]
    tracker = tracker_on(client, clock)
    client.down = True
    with pytest.warns(RuntimeWarning, match="MLflow tracking failed"):
        tracker.log_metric_points([({"loss": 1.0}, 0)])
    client.down = False
    clock[0] = 10.0
    tracker.log_metric_points([({"loss": 0.7}, 1)])  # resting after a failure: kept, not sent (no wait at a flush)
    assert client.metrics == []
    clock[0] = 31.0
    tracker.log_metric_points([({"loss": 0.5}, 2)])  # tried again: the server is back, everything goes
    assert client.metrics == [("loss", 1.0, 0), ("loss", 0.7, 1), ("loss", 0.5, 2)]
    client.down = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per run
        tracker.log_metric_points([({"loss": 0.4}, 3)])
    client.down = False
    tracker.log_metric_points([({"loss": 0.3}, 4)])  # resting
    tracker.finish("FINISHED")  # sends what is kept, whatever the rest
    tracker.finish("FAILED")  # a later failure keeps the status the run ended with
    assert client.metrics[-2:] == [("loss", 0.4, 3), ("loss", 0.3, 4)]
    assert client.status == ["FINISHED"] and tracker.ended == "FINISHED"
    assert client.tags == {"sparkdl.tracking_failures": "2"}


@pytest.mark.parametrize("error", [KeyboardInterrupt(), ValueError("boom")])
def test_any_exception_ends_the_run_failed(error: BaseException) -> None:
    client = FakeClient()
    tracker = tracker_on(client)
    with pytest.raises(type(error)), tracker.ends_failed():
        raise error
    assert client.status == ["FAILED"] and client.tags["sparkdl.failed_with"].startswith(type(error).__name__)
    with tracker.ends_failed():
        pass  # nothing raised: the run is left for collect to finish
    assert client.status == ["FAILED"]


class Recorder:
    def __init__(self) -> None:
        self.params: list[dict[str, Any]] = []
        self.metrics: list[tuple[dict[str, float], int]] = []
        self.tags: dict[str, Any] = {}
        self.texts: dict[str, str] = {}

    def log_params(self, params: dict[str, Any]) -> None:
        self.params.append(dict(params))

    def log_metric_points(self, points: list[tuple[dict[str, float], int]]) -> None:
        self.metrics += points

    def set_tags(self, tags: dict[str, Any]) -> None:
        self.tags.update(tags)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.texts[artifact_file] = text


def start_message(size: int, hosts: list[str]) -> dict[str, Any]:
    return {"world_size": size, "hosts": hosts, "device": "cpu", "gpus": [], "steps_per_epoch": 10}


def test_only_the_first_attempts_world_is_params_every_attempt_is_metrics_and_a_tag() -> None:
    recorder = Recorder()
    worlds = AttemptWorlds(recorder)
    for size, hosts in ((3, ["a", "b", "c"]), (2, ["a", "b"]), (3, ["a", "b", "d"])):
        worlds.started(start_message(size, hosts))
    (params,) = recorder.params
    assert params["world.size"] == 3 and params["world.hosts"] == "a, b, c"
    assert [(p["world_size"], step) for p, step in recorder.metrics] == [(3.0, 0), (2.0, 1), (3.0, 2)]
    assert recorder.tags["sparkdl.attempts"] == 3
    assert recorder.tags["sparkdl.attempt.2.world"] == "2 workers on a, b (cpu, 10 steps an epoch)"


def test_every_membership_change_reaches_the_workers_metric_and_membership_json() -> None:
    import json

    recorder = Recorder()
    changes: list[MembershipChange] = []
    for change in (MembershipChange(1.0, 3, 2, ("h3",), (), "hosts lost", 12, 24),
                   MembershipChange(2.0, 2, 3, (), ("h4",), "slots returned", 8, 24)):
        changes.append(change)
        log_change(recorder, change, changes)
    assert [(p["workers"], step) for p, step in recorder.metrics] == [(3.0, 0), (2.0, 1), (3.0, 2)]
    record = json.loads(recorder.texts["membership.json"])
    assert [(c["from_workers"], c["to_workers"]) for c in record] == [(3, 2), (2, 3)]


def test_below_min_workers_names_the_hosts_lost_and_min_workers() -> None:
    assert hosts_lost(["a", "b", "b", "c"], ["a", "b"]) == ["c"]
    assert hosts_lost(["a", "b"], []) == []  # executors unknown (Spark Connect): nobody is named
    fixed = RunConfig.from_kwargs(feature_cols=["a"], num_workers=3, checkpoint_dir="/x").launch
    error = below_min_workers(fixed, 2, 3, ["c"], "the resubmitted job waited launch.slot_wait_s=60 s")
    assert str(error.message) == ("the run lost host(s) c: 2 slot(s) found after the resubmitted job waited "
                                  "launch.slot_wait_s=60 s, fewer than launch.min_workers=3 (unset: num_workers) "
                                  "(it had 3)")
    assert "set min_workers below num_workers" in (error.hint or "")
    same = RunConfig.from_kwargs(feature_cols=["a"], num_workers=2, min_workers=2, checkpoint_dir="/x").launch
    assert "lost executors" in below_min_workers(same, 1, 2, [], "waiting").message
