"""The peers benchmark's outputs: the JSON object, a PNG chart of every ratio against its target, and
a Markdown table written between markers in docs/benchmarks.md (replaced on each run)."""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

BEGIN, END = "<!-- peers:begin (written by benchmarks/peers.py) -->", "<!-- peers:end -->"


def all_ratios(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [ratio for part in result["parts"] for ratio in part.get("ratios", [])]


def chart(result: dict[str, Any], path: Path) -> None:
    """Horizontal bars: each ratio on a log axis, its target as a tick; green met, red missed, grey info."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    ratios = [r for r in all_ratios(result) if r["value"] is not None]
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(ratios) + 1.6))
    names = [r["name"] for r in ratios]
    colors = ["grey" if r["met"] is None else "tab:green" if r["met"] else "tab:red" for r in ratios]
    ax.barh(range(len(ratios)), [r["value"] for r in ratios], color=colors)
    for i, r in enumerate(ratios):
        if r["target"] is not None:
            ax.plot([r["target"]] * 2, [i - 0.4, i + 0.4], color="black", linewidth=2)
        ax.text(r["value"], i, f" {r['value']:.2f}x", va="center", fontsize=8)
    ax.set_yticks(range(len(ratios)), names, fontsize=8)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.axvline(1.0, color="lightgrey", linewidth=1, zorder=0)
    ax.invert_yaxis()
    ax.set_xlabel("ratio (median of per-round ratios; black tick = target; green met, red missed)")
    ax.set_title(f"sparkdl against its peers ({result['host']['cpus']} cores, {result['repeats']} rounds)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    return str(value)


def markdown(result: dict[str, Any], command: str, png: str | None) -> str:
    lines = [BEGIN, f"Command: `{command}` ({result['when']}, {result['wall_s']:.0f} s; host: "
                    f"{result['host']['cpus']} cores, load {result['host']['loadavg_before_after']} before/after, "
                    f"versions {result['versions']}).", ""]
    if png:
        lines += [f"![sparkdl against its peers]({png})", ""]
    lines += ["| comparison | ratio | target | met | per round |", "|---|---|---|---|---|"]
    for r in all_ratios(result):
        target = "info" if r["target"] is None else ("<= " if r["better"] == "lower" else ">= ") + _fmt(r["target"])
        met = "-" if r["met"] is None else "yes" if r["met"] else "**no**"
        value = "n/a" if r["value"] is None else f"{_fmt(r['value'])}x"
        lines.append(f"| {r['name']} | {value} | {target} | {met} | {r['per_round']} |")
    lines += ["", "| part | figure | median | per round |", "|---|---|---|---|"]
    for part in result["parts"]:
        for name, value in part.get("figures", {}).items():
            lines.append(f"| {part['part']} | {name} | {_fmt(value)} | {part.get('runs', {}).get(name, '')} |")
    errors = {f"{part['part']}/{tool}": text for part in result["parts"] for tool, text in part.get("errors", {}).items()}
    if errors:
        lines += ["", "Errors recorded (a tool without figures failed; the notes say where figures came from "
                      "instead):", ""]
        lines += [f"- {where}: `{text.strip().splitlines()[0][:300] if text.strip() else text}`"
                  for where, text in errors.items()]
    against = result.get("against_record") or []
    if against:
        worse = [r for r in against if r["worse"]]
        lines += ["", f"Against the run recorded {against[0]['recorded_when']} (benchmarks/results/records/; "
                      f"{len(worse)} of {len(against)} figures worse by more than 1.25x):", ""]
        lines += [f"- {r['figure']}: {_fmt(r['value'])} (was {_fmt(r['recorded'])}, x{r['ratio']:.3g})"
                  + (" **worse**" if r["worse"] else "") for r in against if "ratio:" in r["figure"] or r["worse"]]
    notes = [f"{part['part']}: {note}" for part in result["parts"] for note in part.get("notes", [])]
    if notes:
        lines += ["", "Notes:", ""] + [f"- {note}" for note in notes]
    lines.append(END)
    return "\n".join(lines)


def write_docs(docs: Path, block: str) -> None:
    """Replace the block between the markers (appended under its own heading the first time)."""
    text = docs.read_text() if docs.exists() else "# Benchmarks\n"
    if BEGIN in text and END in text:
        text = re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n## Peers: latest run (`benchmarks/peers.py`, issue 10)\n\n" + block + "\n"
    docs.write_text(text)
