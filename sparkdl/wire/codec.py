"""Everything that crosses between the driver and the executor tasks, encoded and decoded in one place.

- Objects shipped by value (models, losses, custom loops, train_fn results): pyspark's cloudpickle,
  so modules registered for pickling by value (driver/shipping.py) apply.
- Result batches: rows of (rank, kind, seq, payload) in RESULT_SCHEMA; "history" (JSON, rank 0),
  "part" (JSON: where the rank's part of the trained model went, wire/model_transfer.py) and
  "payload" (a pickled train_fn result, or a part that had to ride in the rows: a tensor file)
  chunked below Spark's 2 GiB cell limit. `loads_result` / `part_records` read them on the driver.
- Failure markers: a failing rank raises `failure_text(rank, ...)`; Spark wraps it in its own long
  stack trace, and `parse_failure` pulls the rank and the exception line back out.
Writer and reader live side by side so both ends stay in step. No pyspark.sql here.
"""
from __future__ import annotations

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


def result_batch(rank: int, kind: str, seq: int, payload: bytes) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays(
        [pa.array([rank], pa.int32()), pa.array([kind], pa.string()), pa.array([seq], pa.int32()),
         pa.array([payload], pa.binary())],
        names=["rank", "kind", "seq", "payload"])


def result_batches(rank: int, history: list[dict[str, Any]] | None, payload: bytes | None,
                   part: bytes | None = None) -> list[pa.RecordBatch]:
    """What one rank yields as its task's output: rank 0's history, where its part of the model
    went, then its payload (if any) in chunks."""
    out = []
    if history is not None:
        out.append(result_batch(rank, "history", 0, json.dumps(history).encode()))
    if part is not None:
        out.append(result_batch(rank, "part", 0, part))
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


def loads_history(parts: ResultParts) -> list[dict[str, Any]]:
    return json.loads(b"".join(p for _, _, p in sorted(parts.get("history", []))) or b"[]")


def loads_result(parts: ResultParts) -> Any:
    """A custom loop's return value (rank 0's, pickled), None when it returned nothing."""
    payload = b"".join(c for rank, _, c in sorted(parts.pop("payload", [])) if rank == 0)
    return pickle.loads(payload) if payload else None


def loads_every_result(parts: ResultParts, world_size: int) -> list[Any]:
    """Every rank's return value, in rank order (horovod.spark.run's result)."""
    chunks: dict[int, list[tuple[int, bytes]]] = {}
    for rank, seq, chunk in parts.pop("payload", []):
        chunks.setdefault(rank, []).append((seq, chunk))
    payloads = [b"".join(c for _, c in sorted(chunks.get(rank, []))) for rank in range(world_size)]
    return [pickle.loads(p) if p else None for p in payloads]


def part_records(parts: ResultParts) -> dict[int, tuple[dict[str, Any], list[bytes]]]:
    """rank -> (where its part of the model went, the chunks of a part that rode in the rows, in
    order); the chunks are taken out of `parts` so they are held once."""
    chunks: dict[int, list[tuple[int, bytes]]] = {}
    for rank, seq, chunk in parts.pop("payload", []):
        chunks.setdefault(rank, []).append((seq, chunk))
    return {rank: (json.loads(record), [c for _, c in sorted(chunks.pop(rank, []), key=lambda i: i[0])])
            for rank, _, record in parts.get("part", [])}


def failure_text(rank: int, detail: str, trace: str) -> str:
    """The message a failing rank raises; `parse_failure` reads it back out of Spark's error."""
    return f"{FAILURE_MARKER} rank={rank}: {detail}\n{trace}"


def parse_failure(text: str) -> tuple[int, str] | None:
    """(rank, exception line) of the first rank failure marked in `text`, or None."""
    match = _FAILURE.search(text)
    if match is None:
        return None
    return int(match.group(1)), match.group(2).strip()
