"""MLflow tracking owned by the driver: one run per fit, nested under an active run if any.

Every MLflow call goes through `_guard` (tracking/call_guard.py): a failed call is tried once more,
the first failure is said ONE time, and every later call is still made, so training always goes on,
the metrics stay in model.history, and a server that comes back gets the rest of the run (metric
points a failed call could not send go with the next call). A param is logged once: a value that
changes later (an attempt's world) belongs in metrics or tags, and MLflow refuses a changed param.
`finish` ends the run once, FINISHED or FAILED; `ends_failed()` marks it FAILED on any exception.
mlflow is imported lazily: `import sparkdl` works without it.
"""
from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import platform
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from sparkdl.tracking.call_guard import CallGuard, Outcome
from sparkdl.tracking.redaction import redact_params, redact_text

log = logging.getLogger("sparkdl")

MAX_PARAM_CHARS = 6000  # MLflow 3 accepts 6000-character param values
MAX_TAG_CHARS = 8000  # and 8000-character tag values
MAX_UNSENT_METRICS = 10_000  # metric values kept for the next call while the server does not answer
CLIENT_ENV_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "15"}


_FLUENT_LOCK = threading.Lock()  # around MLflow's fluent (process-global) API
MLFLOW_PYFUNC_CODE = Path(__file__).with_name("pyfunc.py")  # the logged model's code (models from code)


class RunTracker:
    """The driver's handle on one MLflow run; a disabled tracker does nothing, a failing one goes on
    trying (tracking/call_guard.py)."""

    def __init__(self, enabled: bool, tracking_uri: str | None = None, experiment: str | None = None,
                 run_name: str | None = None) -> None:
        self.enabled = enabled
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.run_id: str | None = None
        self.ended: str | None = None  # the status the run was ended with
        self._calls = CallGuard(redact=redact_text)
        self._params: dict[str, str] = {}  # logged so far: MLflow refuses a param logged again with another value
        self._unsent: list[Any] = []  # metric values of failed calls, sent with the next
        self._metrics_lock = threading.Lock()  # the channel's thread and the fit's thread both log metrics
        self._client: Any = None

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, params: Mapping[str, Any], tags: Mapping[str, str] | None = None) -> str | None:
        if not self.enabled:
            return None
        self._guard("start the MLflow run", lambda: self._start(params, dict(tags or {})))
        return self.run_id

    def _start(self, params: Mapping[str, Any], tags: dict[str, str]) -> None:
        # MLflow's HTTP defaults (7 retries, 120 s timeouts) make a dead server block each call for
        # about 4 minutes; a run wants to find out in seconds. Explicit user settings win.
        for name, value in CLIENT_ENV_DEFAULTS.items():
            os.environ.setdefault(name, value)
        import mlflow
        from mlflow.tracking import MlflowClient
        from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME

        uri = self.tracking_uri or mlflow.get_tracking_uri()
        self.tracking_uri = uri
        self._client = MlflowClient(tracking_uri=uri)
        experiment_id = self._experiment_id(mlflow)
        active = mlflow.active_run()
        if active is not None:
            tags[MLFLOW_PARENT_RUN_ID] = active.info.run_id
            experiment_id = self.experiment and experiment_id or active.info.experiment_id
        if self.run_name:
            tags[MLFLOW_RUN_NAME] = self.run_name
        run = self._client.create_run(experiment_id, tags=tags, run_name=self.run_name)
        self.run_id = run.info.run_id
        self.log_params(params)

    def _experiment_id(self, mlflow: Any) -> str:
        if self.experiment is None:
            from mlflow.tracking.fluent import _get_experiment_id

            return _get_experiment_id()
        found = self._client.get_experiment_by_name(self.experiment)
        if found is not None:
            return found.experiment_id
        try:
            return self._client.create_experiment(self.experiment)
        except Exception:  # noqa: BLE001 - a concurrent fit (another thread) created it first: use that one
            found = self._client.get_experiment_by_name(self.experiment)
            if found is None:
                raise
            return found.experiment_id

    def finish(self, status: str = "FINISHED") -> None:
        """End the run with `status` (FINISHED or FAILED), once: later calls keep the first status.
        Metric points still unsent are tried first, and failed calls are counted in a tag."""
        if not self._active() or self.ended is not None:
            return
        self.ended = status
        if self._unsent:
            self.log_metric_points([], now=True)
        if self._calls.failures:
            self.set_tags({"sparkdl.tracking_failures": self._calls.failures})
        self._guard("end the MLflow run", lambda: self._client.set_terminated(self.run_id, status=status))

    @contextlib.contextmanager
    def ends_failed(self) -> Iterator[RunTracker]:
        """The block's exception (any: KeyboardInterrupt and a notebook's stop included) ends the run
        FAILED, named in the tag sparkdl.failed_with, and propagates; a run never stays RUNNING."""
        try:
            yield self
        except BaseException as exc:
            if self._active() and self.ended is None:
                self.set_tags({"sparkdl.failed_with": f"{type(exc).__name__}: {str(exc).strip()[:500]}"})
                self.finish("FAILED")
            raise

    # -- logging ---------------------------------------------------------------------------------
    def log_params(self, params: Mapping[str, Any]) -> None:
        """Params not logged yet; one logged before with another value is set as a tag of that
        name instead (MLflow refuses to change a param, and would fail the whole batch)."""
        if not self._active():
            return
        from mlflow.entities import Param

        texts = {k: _param_text(v) for k, v in params.items()}
        changed = {k: t for k, t in texts.items() if k in self._params and self._params[k] != t}
        items = [Param(k, t) for k, t in texts.items() if k not in self._params]

        def send() -> None:
            while items:  # MLflow caps a batch at 100 params
                self._client.log_batch(self.run_id, params=items[:100])
                self._params.update((p.key, p.value) for p in items[:100])
                del items[:100]

        if items:
            self._guard("log params", send)
        if changed:
            self.set_tags(changed)

    def log_metric_points(self, points: Sequence[tuple[Mapping[str, float], int]], now: bool = False) -> None:
        """Many (metrics, step) points in as few requests as MLflow allows (1000 values each). While
        calls fail they are kept for a later call (CallGuard.resting), unless `now`."""
        if not self._active():
            return
        import time

        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        new = [Metric(k, float(v), stamp, int(step)) for metrics, step in points for k, v in metrics.items()
               if _is_number(v)]
        with self._metrics_lock:
            items, self._unsent = self._unsent + new, []
            if self._calls.resting() and not now:
                self._unsent = items[-MAX_UNSENT_METRICS:]
                return

            def send() -> None:
                while items:  # MLflow caps a batch at 1000 values; a sent batch is not sent again
                    self._client.log_batch(self.run_id, metrics=items[:1000])
                    del items[:1000]

            if items and self._guard("log metrics", send) == "failed":
                self._unsent = items[-MAX_UNSENT_METRICS:]  # the next call tries them again

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if self._active():
            self._guard("set tags", lambda: [self._client.set_tag(self.run_id, k, redact_text(str(v))[:MAX_TAG_CHARS])
                                             for k, v in tags.items()])

    def log_text(self, text: str, artifact_file: str) -> None:
        """Every text artifact (failure.txt, the rank-0 log, plan.txt) redacted: error texts echo URIs."""
        text = redact_text(text)
        if self._active():
            self._guard(f"log {artifact_file}", lambda: self._client.log_text(self.run_id, text, artifact_file))

    def log_dict(self, data: Any, artifact_file: str) -> None:
        if self._active():
            self._guard(f"log {artifact_file}", lambda: self._client.log_dict(self.run_id, data, artifact_file))

    def log_loss_curve(self, history: Sequence[Mapping[str, Any]]) -> None:
        if self._active() and history:
            self._guard("log the loss curve", lambda: self._log_png(loss_curve_png(history), "loss_curve.png"))

    def _log_png(self, png: bytes, name: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / name
            path.write_bytes(png)
            self._client.log_artifact(self.run_id, str(path))

    def log_model(self, served: Any, input_example: Any, weights_dir: str, loaded: bool = True) -> str | None:
        """The model as an MLflow pyfunc logged from its files: the weightless skeleton of the
        serving.ServedModel and the directory of tensor files the ranks wrote (`weights_dir`), with
        the model's code file (sparkdl/tracking/pyfunc.py) instead of a cloudpickled object. `predict`
        answers what TorchModel.transform writes, with class probabilities beside it; signature and
        input example included (the output's schema only when the module is `loaded` here).
        Returns the model URI."""
        if not self._active():
            return None
        result: list[str] = []

        def send() -> None:
            import mlflow

            from sparkdl.model.trained import serving_in_process, skeleton_bytes

            signature = model_signature(served, input_example, loaded)
            with tempfile.TemporaryDirectory() as tmp:
                skeleton = Path(tmp) / "skeleton.pkl"
                skeleton.write_bytes(skeleton_bytes(served))
                # log_model goes through MLflow's process-global tracking URI: fits running in other
                # threads must not swap it between our set and our log (their runs live elsewhere).
                with _FLUENT_LOCK, serving_in_process(skeleton.read_bytes(), served if loaded else None), \
                        _environment(MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR="false"):  # bars of our own files
                    previous = mlflow.get_tracking_uri()
                    mlflow.set_tracking_uri(self.tracking_uri)
                    try:
                        with mlflow.start_run(run_id=self.run_id, nested=mlflow.active_run() is not None), \
                                warnings.catch_warnings():
                            # Not loaded here by design: an example would make MLflow load the model to check it.
                            warnings.filterwarnings("ignore", message=r".*input example was not provided")
                            # MLflow checks the input example by loading the logged model and predicting:
                            # serving_in_process hands it this process's module (no second copy in
                            # memory); a model never loaded here is logged without an example.
                            info = mlflow.pyfunc.log_model(
                                name="model", python_model=str(MLFLOW_PYFUNC_CODE),
                                artifacts={"skeleton": str(skeleton), "weights": weights_dir}, signature=signature,
                                input_example=input_example if loaded else None,
                                pip_requirements=model_requirements(served))
                        result.append(info.model_uri)
                    finally:
                        mlflow.set_tracking_uri(previous)

        # Not tried twice: a second log_model after a lost answer would log a second model.
        self._guard("log the model", send, retry=False)
        return result[0] if result else None

    # -- failure handling ------------------------------------------------------------------------
    def _active(self) -> bool:
        return self.enabled and self.run_id is not None

    @property
    def failures(self) -> int:
        """MLflow calls of this run that failed (each tried again once while calls succeeded)."""
        return self._calls.failures

    def _guard(self, what: str, action: Callable[[], Any], retry: bool = True) -> Outcome:
        return self._calls.call(what, action, retry=retry)


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """Environment variables set for the block (those the user set win), then restored."""
    previous = {k: os.environ.get(k) for k in values}
    for key, value in values.items():
        os.environ.setdefault(key, value)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)


def model_signature(served: Any, input_example: Any, loaded: bool) -> Any:
    """The input schema of the example and, when the module is loaded, the predictions' schema.
    MLflow's hint that integer columns cannot hold missing values is left out: sparkdl's input layout
    refuses nulls before training and scoring alike."""
    import pandas as pd
    from mlflow.models import infer_signature

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*Inferred schema contains integer column", category=UserWarning)
        output = pd.DataFrame(served.predict_columns(input_example)) if loaded else None
        from sparkdl.tracking.json_types import json_signature  # what JSON clients send (issue 52 part 3)

        return json_signature(infer_signature(input_example, output))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _param_text(value: Any) -> str:
    text = str(list(value) if isinstance(value, tuple) else value)
    return text if len(text) <= MAX_PARAM_CHARS else text[: MAX_PARAM_CHARS - 20] + " ...[cut]"


SERVING_PACKAGES = ("sparkdl-torch", "torch", "mlflow", "pandas", "numpy", "pyarrow", "cloudpickle")


def model_requirements(served: Any) -> list[str]:
    """The logged model's pip requirements: what serving it imports, plus the distributions that
    provide the model's layer classes and transform_fn. Said here instead of letting MLflow infer
    them, which loads the model in a subprocess and costs 2-4 s per fit."""
    import importlib.metadata as metadata
    import sys

    roots = {type(m).__module__.split(".")[0] for m in served.module.modules()}
    if served.transform_fn is not None:
        roots.add(str(getattr(served.transform_fn, "__module__", "") or "").split(".")[0])
    providers = _distributions_by_module()
    names = list(SERVING_PACKAGES)
    for root in sorted(roots - set(sys.stdlib_module_names)):
        names += [d for d in providers.get(root, []) if d.lower() not in {n.lower() for n in names}]
    requirements = []
    for name in names:
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:  # e.g. sparkdl run from a source tree
            continue
        requirements.append(f"{name}=={version.split('+')[0]}")  # a local label (+cpu) is on no index
    return requirements


@functools.lru_cache(maxsize=1)
def _distributions_by_module() -> Mapping[str, list[str]]:
    """Top-level module -> the installed distributions providing it (a scan of every install: once)."""
    import importlib.metadata as metadata

    return metadata.packages_distributions()


def versions() -> dict[str, str]:
    import pyarrow
    import torch

    from sparkdl import __version__

    try:
        import pyspark

        spark_version = pyspark.__version__
    except ImportError:  # pragma: no cover - sparkdl always runs with pyspark today
        spark_version = "absent"
    return {"version.sparkdl": __version__, "version.torch": torch.__version__,
            "version.pyspark": spark_version, "version.pyarrow": pyarrow.__version__,
            "version.python": platform.python_version()}


def loss_curve_png(history: Sequence[Mapping[str, Any]]) -> bytes:
    """Train (and validation) loss per epoch as a PNG, drawn with matplotlib's Agg backend."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6, 4), dpi=100)
    axes = figure.add_subplot()
    epochs = [h["epoch"] + 1 for h in history]
    axes.plot(epochs, [h["loss"] for h in history], marker="o", label="train loss")
    if all("val_loss" in h for h in history):
        axes.plot(epochs, [h["val_loss"] for h in history], marker="s", label="validation loss")
    axes.set_xlabel("epoch")
    axes.set_ylabel("loss")
    axes.grid(True, alpha=0.3)
    axes.legend()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", bbox_inches="tight")
    return buffer.getvalue()


def redact(params: dict[str, Any]) -> dict[str, Any]:
    """Params safe to log (tracking/redaction.py): values of options whose names say secret, token,
    password, key, ... masked whole; URL passwords and credential query parameters masked in the rest.
    Environment variables are never logged."""
    return redact_params(params)


def read_run_artifact(run_id: str, artifact_file: str, tracking_uri: str | None = None) -> str:
    """The text of one artifact of an MLflow run (a kept plan.json); SparkdlError when the run or
    the artifact cannot be read."""
    from sparkdl.errors import ConfigError

    for name, value in CLIENT_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    try:
        import mlflow
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=tracking_uri or mlflow.get_tracking_uri())
        with tempfile.TemporaryDirectory() as tmp:
            path = client.download_artifacts(run_id, artifact_file, tmp)
            return Path(path).read_text(encoding="utf-8")
    except Exception as exc:  # noqa: BLE001 - MLflow raises many types for a missing run or file
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise ConfigError(f"cannot read {artifact_file} of MLflow run {run_id!r}: {first}",
                          hint="pass the MLflow run id of a sparkdl fit (model.run_id) with the tracking_uri "
                               "it was logged to") from None
