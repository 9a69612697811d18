"""The last figures of each benchmark, kept in benchmarks/results/records/<name>.json, and every new
run's figures set against them: a drop (epoch 1 three times slower, say) shows in the next run's
output instead of waiting for someone to compare two JSON files by hand. Nothing here asserts.

A figure is any number in the result object, named by its path (`parts.ingest.figures.sparkdl_epoch1`,
`ratios.sparkdl epoch 1 / TorchDistributor loader`). Which way is better is read off the name:
seconds, milliseconds, bytes and memory are lower-is-better, everything else (rows/s, ratios of
speed) higher-is-better, unless the result says so itself (a ratio entry's "better").
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

RECORDS = Path(__file__).resolve().parent / "results" / "records"
WORSE_BY = 1.25  # flagged when a figure is this much worse than its record
_LOWER_SUFFIXES = ("_s", "_ms", "_mb", "_gb")
_LOWER_WORDS = ("seconds", "bytes", "rss", "memory", "stall", "wall")
_NOT_FIGURES = frozenset({"runs", "per_round", "host", "versions", "when", "repeats", "targets_met", "rows", "features",
                          "batch_size", "step_rows", "step_epochs", "seed", "workers", "num_workers", "epochs",
                          "target", "config", "loadavg_after", "loadavg_before", "source",
                          "against_record", "loadavg_start", "loadavg_end", "loadavg", "cpus", "rank", "ranks_count",
                          "steps_per_epoch", "chunk_mb", "input_batch_rows", "seq_len", "image_rows", "spark_rounds",
                          "rounds", "master"})


def figures_of(result: Any, prefix: str = "") -> dict[str, tuple[float, str]]:
    """{path: (value, "higher" | "lower")} of every finite number in `result`; a list of ratio
    entries ({"name", "value", "better"}) is named by each entry's name."""
    out: dict[str, tuple[float, str]] = {}
    if isinstance(result, dict):
        if "name" in result and "value" in result and isinstance(result.get("better"), str):
            value = result["value"]
            if _finite(value):
                out[f"{prefix}ratio: {result['name']}"] = (float(value), result["better"])
            return out
        for key, value in result.items():
            if key in _NOT_FIGURES:
                continue  # raw rounds, facts and parameters of the run, not figures
            out.update(figures_of(value, f"{prefix}{key}."))
    elif isinstance(result, list):
        named = [item for item in result if isinstance(item, dict) and "part" in item]
        for index, item in enumerate(result):
            if isinstance(item, dict) and "name" in item and "value" in item:
                out.update(figures_of(item, prefix))  # a ratio entry: named by its own name
                continue
            key = item["part"] if item in named else str(index)
            out.update(figures_of(item, f"{prefix}{key}."))
    elif _finite(result) and not isinstance(result, bool):
        name = prefix.rstrip(".")
        out[name] = (float(result), _direction(name))
    return out


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _direction(name: str) -> str:
    leaf = name.rsplit(".", 1)[-1].lower()
    lower = leaf.endswith(_LOWER_SUFFIXES) or any(word in leaf for word in _LOWER_WORDS)
    return "lower" if lower else "higher"


def compare(name: str, result: dict[str, Any], directory: Path = RECORDS) -> list[dict[str, Any]]:
    """Each figure of `result` against the recorded one: [{"figure", "value", "recorded",
    "ratio" (value / recorded), "worse" (by more than WORSE_BY)}]; empty without a record."""
    path = directory / f"{name}.json"
    if not path.exists():
        return []
    recorded = json.loads(path.read_text())
    before = {k: tuple(v) for k, v in recorded.get("figures", {}).items()}
    rows = []
    for figure, (value, better) in figures_of(result).items():
        if figure not in before or not before[figure][0]:
            continue
        old = before[figure][0]
        ratio = value / old
        worse = ratio < 1 / WORSE_BY if better == "higher" else ratio > WORSE_BY
        rows.append({"figure": figure, "value": value, "recorded": old, "ratio": round(ratio, 3),
                     "better": better, "worse": bool(worse), "recorded_when": recorded.get("when")})
    return rows


def report(name: str, rows: list[dict[str, Any]], stream: Any = sys.stderr) -> None:
    """One line per figure: the new value, the recorded one and their ratio; worse ones marked."""
    if not rows:
        print(f"[records] {name}: no earlier record to compare with", file=stream, flush=True)
        return
    print(f"[records] {name}: against the figures recorded {rows[0]['recorded_when']} "
          f"(ratio = now / then; {sum(r['worse'] for r in rows)} worse by > {WORSE_BY}x)", file=stream)
    for row in rows:
        mark = "  WORSE" if row["worse"] else ""
        print(f"[records]   {row['figure']}: {row['value']:.4g} (was {row['recorded']:.4g}, "
              f"x{row['ratio']:.3g}, {row['better']} is better){mark}", file=stream)
    stream.flush()


def record(name: str, result: dict[str, Any], directory: Path = RECORDS) -> Path:
    """Keep this run's figures as the record the next run compares with."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    figures = {k: [v, better] for k, (v, better) in figures_of(result).items()}
    load = (result.get("host") or {}).get("loadavg_before_after") or \
        (os.getloadavg()[0] if hasattr(os, "getloadavg") else None)
    when = result.get("when") or time.strftime("%Y-%m-%d %H:%M")
    path.write_text(json.dumps({"benchmark": name, "when": when,
                                "loadavg_at_record": load, "figures": figures}, indent=1, sort_keys=True))
    return path


def compare_and_record(name: str, result: dict[str, Any], keep: bool = True,
                       directory: Path = RECORDS) -> list[dict[str, Any]]:
    """compare + report, then (keep) record: what a benchmark calls once with its result object."""
    rows = compare(name, result, directory)
    report(name, rows)
    if keep:
        record(name, result, directory)
    return rows
