"""Everything that crosses between the driver and the executor tasks, encoded and decoded in one place.

- Objects shipped by value (models, losses, custom loops, train_fn results): pyspark's cloudpickle,
  so modules registered for pickling by value (launch/shipping.py) apply.
- Result batches: rows of (rank, kind, seq, payload) in RESULT_SCHEMA; "history" (JSON, rank 0) and
  "payload" (a state dict saved with torch.save, or a pickled train_fn result) chunked below
  Spark's 2 GiB cell limit. `loads_result` reassembles them on the driver.
- Failure markers: a failing rank raises `failure_text(rank, ...)`; Spark wraps it in its own long
  stack trace, and `parse_failure` pulls the rank and the exception line back out.
Writer and reader live side by side so both ends stay in step. No pyspark.sql here.
"""
from __future__ import annotations

import io
import json
import pickle
import re
from typing import Any, Iterable

import pyarrow as pa

RESULT_SCHEMA = "rank int, kind string, seq int, payload binary"
RESULT_CHUNK_BYTES = 32 << 20  # keeps every Arrow cell far below Spark's 2 GiB limit
FAILURE_MARKER = "SPARKDL_RANK_FAILED"

ResultParts = dict[str, list[tuple[int, int, bytes]]]

_FAILURE = re.compile(FAILURE_MARKER + r" rank=(\d+): (.*)")


def dumps_any(obj: Any) -> bytes:
    """Pickle by value where registered (pyspark's own cloudpickle copy)."""
    from pyspark import cloudpickle

    return cloudpickle.dumps(obj)


def dumps_state(state: dict[str, Any]) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def result_batch(rank: int, kind: str, seq: int, payload: bytes) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays(
        [pa.array([rank], pa.int32()), pa.array([kind], pa.string()), pa.array([seq], pa.int32()),
         pa.array([payload], pa.binary())],
        names=["rank", "kind", "seq", "payload"])


def result_batches(rank: int, history: list[dict[str, Any]] | None, payload: bytes | None) -> list[pa.RecordBatch]:
    """What one rank yields as its task's output: rank 0's history, then its payload in chunks."""
    out = []
    if history is not None:
        out.append(result_batch(rank, "history", 0, json.dumps(history).encode()))
    if payload is not None:
        for seq, start in enumerate(range(0, max(len(payload), 1), RESULT_CHUNK_BYTES)):
            out.append(result_batch(rank, "payload", seq, payload[start: start + RESULT_CHUNK_BYTES]))
    return out


def output_batch(rank: int, lines: Iterable[str]) -> pa.RecordBatch:
    """The last lines of a rank's output, for a driver whose channel never got them."""
    return result_batch(rank, "output", 0, "\n".join(lines).encode("utf-8", "replace"))


def output_lines(parts: ResultParts) -> list[str]:
    text = b"".join(p for _, _, p in sorted(parts.get("output", []))).decode("utf-8", "replace")
    return text.splitlines()


def collect_parts(rows: Iterable[Any]) -> ResultParts:
    """The collected result rows grouped by kind as (rank, seq, bytes), emptying `rows` as it goes:
    a large model's chunks are then held once (the payloads are kept as Spark returned them)."""
    parts: ResultParts = {}
    rows = rows if isinstance(rows, list) else list(rows)
    while rows:
        row = rows.pop()
        parts.setdefault(row["kind"], []).append((row["rank"], row["seq"], row["payload"]))
    return parts


def loads_result(parts: ResultParts, custom: bool) -> tuple[Any, list[dict[str, Any]]]:
    """Reassemble the (rank, seq, bytes) chunks. A custom loop returns rank 0's value; the built-in
    loop's state dicts of every contributing rank are merged by key."""
    history = json.loads(b"".join(p for _, _, p in sorted(parts.get("history", []))) or b"[]")
    by_rank: dict[int, list[tuple[int, bytes]]] = {}
    for rank, seq, chunk in parts.pop("payload", []):
        by_rank.setdefault(rank, []).append((seq, chunk))
    if custom:
        payload = b"".join(c for _, c in sorted(by_rank.get(0, [])))
        return (pickle.loads(payload) if payload else None), history
    import torch

    state: dict[str, Any] = {}
    for rank in sorted(by_rank):
        # One rank's part at a time, its chunks dropped as they are copied: the driver holds the
        # model about twice at most, not four times (rows, bytes, joined bytes, tensors).
        chunks = sorted(by_rank.pop(rank), key=lambda item: item[0], reverse=True)
        buffer = io.BytesIO()
        while chunks:
            buffer.write(chunks.pop()[1])
        buffer.seek(0)
        state.update(torch.load(buffer, weights_only=True))
        del buffer
    return state, history


def failure_text(rank: int, detail: str, trace: str) -> str:
    """The message a failing rank raises; `parse_failure` reads it back out of Spark's error."""
    return f"{FAILURE_MARKER} rank={rank}: {detail}\n{trace}"


def parse_failure(text: str) -> tuple[int, str] | None:
    """(rank, exception line) of the first rank failure marked in `text`, or None."""
    match = _FAILURE.search(text)
    if match is None:
        return None
    return int(match.group(1)), match.group(2).strip()
