"""benchmarks/peers.py's report: the table replaces its own block in docs on every run (the rest of
the file untouched), the chart is written, ratios are medians of per-round pairs."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from peers_parts import common, report  # noqa: E402


def sample_result() -> dict:
    launch = common.ratio_entry("launch: sparkdl / TorchDistributor", [(1.0, 8.0), (2.0, 8.0), (1.5, 10.0)], 0.5,
                                "lower")
    ingest = common.ratio_entry("ingest: sparkdl / Petastorm", [(3.0, 2.0)], 2.0, "higher")
    info = common.ratio_entry("info only", [(1.0, 2.0)], None, "lower")
    return {"when": "2026-11-29 12:00", "wall_s": 10.0, "repeats": 3, "versions": {"torch": "x"},
            "host": {"cpus": 2, "loadavg_before_after": [0.5, 1.0]},
            "parts": [{"part": "launch", "figures": {"sparkdl_noop_s": 1.5}, "runs": {"sparkdl_noop_s": [1, 2, 1.5]},
                       "ratios": [launch, info], "notes": ["a note"], "errors": {}},
                      {"part": "ingest", "figures": {}, "runs": {}, "ratios": [ingest], "notes": [],
                       "errors": {"petastorm": "ImportError: cannot import name 'x'\nmore"}}]}


def test_ratios_are_medians_of_pairs_and_judged_against_targets() -> None:
    result = sample_result()
    launch, info, ingest = report.all_ratios(result)
    assert launch["value"] == 0.15 and launch["met"] is True  # per round 0.125, 0.25, 0.15
    assert ingest["value"] == 1.5 and ingest["met"] is False
    assert info["met"] is None


def test_docs_block_is_replaced_not_appended(tmp_path: Path) -> None:
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\nearlier section\n")
    result = sample_result()
    report.write_docs(docs, report.markdown(result, "make bench", "img/peers.png"))
    first = docs.read_text()
    assert "earlier section" in first and first.count(report.BEGIN) == 1
    assert "| ingest: sparkdl / Petastorm | 1.5x | >= 2 | **no** |" in first
    assert "ingest/petastorm: `ImportError: cannot import name 'x'`" in first
    result["parts"][0]["ratios"][0]["value"] = 0.2
    report.write_docs(docs, report.markdown(result, "make bench", "img/peers.png"))
    second = docs.read_text()
    assert second.count(report.BEGIN) == 1 and "| launch: sparkdl / TorchDistributor | 0.2x |" in second
    assert "earlier section" in second


def test_chart_is_written(tmp_path: Path) -> None:
    png = tmp_path / "img" / "peers.png"
    report.chart(sample_result(), png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
