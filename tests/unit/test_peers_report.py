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


def test_a_run_is_set_against_the_recorded_figures_and_a_drop_is_flagged(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    import copy

    import records

    before = sample_result()
    assert records.compare_and_record("peers", before, directory=tmp_path) == []  # nothing recorded yet
    after = copy.deepcopy(before)
    after["parts"][0]["figures"]["sparkdl_noop_s"] = 4.5  # 3x slower: seconds, lower is better
    after["parts"][1]["ratios"][0]["value"] = 1.4  # a higher-is-better ratio, a little lower
    rows = {r["figure"]: r for r in records.compare_and_record("peers", after, directory=tmp_path)}
    noop = rows["parts.launch.figures.sparkdl_noop_s"]
    assert (noop["ratio"], noop["better"], noop["worse"]) == (3.0, "lower", True)
    ingest = rows["parts.ingest.ratios.ratio: ingest: sparkdl / Petastorm"]
    assert ingest["better"] == "higher" and not ingest["worse"]
    assert "wall_s" in rows and "repeats" not in rows and not any("per_round" in k for k in rows)
    assert "WORSE" in capsys.readouterr().err
    # the record now holds the later run
    assert records.compare("peers", after, directory=tmp_path)[0]["ratio"] == 1.0


def test_ingest_benchmark_sets_its_figures_against_the_record_without_replacing_it_under_no_record() -> None:
    import json
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    records_dir = repo / "benchmarks" / "results" / "records"
    name = records_dir / "ingest_a_20000_8.json"
    before = name.read_text() if name.exists() else None
    done = subprocess.run([sys.executable, str(repo / "benchmarks" / "ingest.py"), "--rows", "20000", "--features", "8",
                           "--repeats", "1", "--no-record"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "ingest" and isinstance(result["against_record"], list)
    assert "[records] ingest_a_20000_8" in done.stderr
    assert (name.read_text() if name.exists() else None) == before  # --no-record leaves the record alone
