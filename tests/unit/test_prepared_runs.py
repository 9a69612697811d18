"""A tuning grid's fits share the data stage where their options allow (data/prepare.PreparedRuns)."""
from __future__ import annotations

import threading
from dataclasses import replace

import sparkdl.data.prepare as prepare
from sparkdl.config import RunConfig
from sparkdl.data.prepare import PreparedRuns, preparation_key


def test_points_that_differ_only_in_training_options_share_one_preparation(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    calls: list[tuple[int, str]] = []

    def counted(df, data, train, launch, validation_df=None):  # type: ignore[no-untyped-def]
        calls.append((id(df), preparation_key(data, train, launch)))
        return object()

    monkeypatch.setattr(prepare, "prepare_run", counted)
    base = RunConfig.from_kwargs(feature_cols=["x"], epochs=2)
    frame, other_frame = object(), object()
    runs = PreparedRuns()
    points = [base.merged({"train": {"lr": lr, "optimizer": opt}}) for lr in (0.1, 0.01) for opt in ("sgd", "adam")]
    first = [runs.prepared(frame, c.data, c.train, c.launch) for c in points]
    assert len(calls) == 1 and all(p is first[0] for p in first) and runs.shared == 3
    # batch_size, the seed, the workers or another DataFrame (a CrossValidator fold) each prepare anew
    for config, df in ((base.merged({"data": {"batch_size": 16}}), frame), (replace(base, train=replace(base.train, seed=3)), frame),
                       (base.merged({"launch": {"num_workers": 3}}), frame), (base, other_frame)):
        runs.prepared(df, config.data, config.train, config.launch)
    assert len(calls) == 5


def test_two_threads_asking_at_once_prepare_once(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    started = threading.Event()
    calls = []

    def slow(df, data, train, launch, validation_df=None):  # type: ignore[no-untyped-def]
        calls.append(1)
        started.set()
        threading.Event().wait(0.2)
        return object()

    monkeypatch.setattr(prepare, "prepare_run", slow)
    config, runs, frame = RunConfig.from_kwargs(feature_cols=["x"]), PreparedRuns(), object()
    got = []
    threads = [threading.Thread(target=lambda: got.append(runs.prepared(frame, config.data, config.train, config.launch)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and got[0] is got[1]
