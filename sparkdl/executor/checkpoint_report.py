"""How the driver names a resume that fell back past damaged checkpoints (executor/checkpoint_fallback.py
decides it; driver/monitor.py says it and puts it in the MLflow run). Standard library only: the
driver imports it, and it is a leaf of the layering (docs/architecture.md)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

HISTORY_FROM = "checkpoint_fallback_from_step"  # the newest step skipped (None: a damaged entry without one)
HISTORY_REASON = "checkpoint_fallback"  # why each skipped step could not be used


@dataclass(frozen=True)
class FallbackReport:
    """What the driver says of a fall-back: a line (stderr and a text artifact) and MLflow tags."""

    line: str
    artifact: str
    tags: dict[str, str]


def fallback_report(record: dict[str, Any]) -> FallbackReport | None:
    """From an epoch record (driver/monitor.py), the fall-back it names, or None."""
    reason = record.get(HISTORY_REASON)
    if not reason:
        return None
    skipped_from, resumed = record.get(HISTORY_FROM), record.get("resumed_from_step")
    line = (f"sparkdl: resumed from the checkpoint of step {resumed}, not the newest (step {skipped_from}): "
            f"{reason}")
    tags = {"checkpoint_fallback_from_step": str(skipped_from), "checkpoint_fallback_to_step": str(resumed),
            "checkpoint_fallback": str(reason)[:4000]}
    return FallbackReport(line, f"checkpoint_fallback_step_{resumed}.txt", tags)
