"""Errors sparkdl raises on purpose.

Every message names the column or option at fault and ends with a HINT saying what to do, so a
user reading a notebook cell's output can fix the problem without reading sparkdl's source.
"""
from __future__ import annotations

from typing import Callable


def _shown_as_is(text: str) -> str:
    return text


# How an error's text is shown: sparkdl/__init__.py installs tracking/redaction.py's rule (the one
# home of it; this module imports nothing of sparkdl), so a URL's password, a token or a key in a
# user's error text reaches neither a notebook nor a log, as MLflow's copies of it do not.
_mask: Callable[[str], str] = _shown_as_is


def mask_credentials_with(rule: Callable[[str], str]) -> None:
    """Every SparkdlError made from now on carries its texts through `rule` (message, hint and the
    texts a subclass keeps, e.g. RankFunctionError's traceback)."""
    global _mask
    _mask = rule


def masked(text: str) -> str:
    """`text` as errors show it: credentials masked."""
    return _mask(text) if isinstance(text, str) and text else text


class SparkdlError(Exception):
    """Base class of every error sparkdl raises on purpose. Its message and hint are masked: they
    often carry a user's own error text or option values (a URI with user:password@, a token)."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        self.message = masked(message)
        self.hint = masked(hint) if hint is not None else None
        super().__init__(self.message if self.hint is None else f"{self.message}\nHINT: {self.hint}")


class ConfigError(SparkdlError):
    """An option has a bad value, a bad type, or is unknown."""


class SchemaError(SparkdlError):
    """The DataFrame does not fit the requested columns."""


class MissingColumnError(SchemaError):
    """A requested column is not in the DataFrame."""


class ColumnTypeError(SchemaError):
    """A used column has a type sparkdl cannot feed to torch."""


class NullValuesError(SchemaError):
    """A used column holds nulls."""


class ArrayLengthError(SchemaError):
    """An array or vector feature column holds rows of different lengths."""


class EmptyDataError(SchemaError):
    """The DataFrame has no rows."""


class ResourceError(SparkdlError):
    """Spark cannot give the run what it needs (slots, GPUs)."""


class InsufficientSlotsError(ResourceError):
    """More workers were asked for than Spark can run at once."""


class SpoolSpaceError(ResourceError):
    """An executor's spool directory (data.spool_dir) has too little free space for its partition."""


class PartitionChangedError(SparkdlError):
    """A rank received fewer rows than the driver counted, and spool="none" kept too few to fill its steps."""


class TrainingError(SparkdlError):
    """A worker failed during training; the message carries the failing rank's exception.
    `events`: what the JVM bridge's BarrierWatch saw during the job (executors lost, tasks failed
    with rank, host and exception line); empty without the bridge."""

    events: list = []  # noqa: RUF012 - replaced per instance when the driver drains the events


class RankFunctionError(TrainingError, RuntimeError):
    """A function or script run through sparkdl.compat failed on a rank (a RuntimeError too, as
    PySpark's TorchDistributor raises): `rank`, the user's
    exception type name (`exception_type`, e.g. "ValueError" or "mypkg.MyError"), its message and
    the rank's own traceback (`rank_traceback`), all in the message too."""

    def __init__(self, message: str, hint: str | None = None, *, rank: int = -1, exception_type: str = "",
                 exception_message: str = "", rank_traceback: str = "") -> None:
        super().__init__(message, hint)
        self.rank, self.exception_type, self.exception_message = rank, exception_type, masked(exception_message)
        self.rank_traceback = masked(rank_traceback)


class CompatValueError(ConfigError, ValueError):
    """A bad argument of a peer API (sparkdl.compat): also the ValueError the peer raises."""


class CompatRuntimeError(ConfigError, RuntimeError):
    """A cluster that cannot give a peer API what it asks (GPUs): also the RuntimeError PySpark raises."""


class CheckpointError(SparkdlError):
    """A checkpoint cannot be written or resumed from (a failed write, an unreadable manifest, a
    resume at another world size than the checkpoint was written by)."""


class ModelError(SparkdlError):
    """The model, loss or optimizer given cannot be used."""
