"""How a rank's part of the trained model reaches the driver (issue 29), without Spark or training in
the way: W processes each hold a part of --mb MB and send it at once, side by side in one run:

- channel: over the authenticated connection to the driver's PartReceiver, written to its disk
- storage: each rank writes its tensor file to a directory (here the same local disk; on a cluster a
  shared mount or an object store), which the driver then reads
- rows: the bytes a rank would put in the job's rows (one serialized copy per rank; the JVMs' share of
  that path, pickling in two heaps, is not in this figure: see big_model.py --model-return)

For each: the wall time until every part is on the driver's side, MB/s, and the median over --repeats.

    .venv/bin/python benchmarks/model_transfer.py [--ranks 4] [--mb 256] [--repeats 5]

One JSON object on the last line, also written to benchmarks/results/model_transfer.json; nothing asserted.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _rank(sink: Any, rank: int, mb: int, ready: Any, go: Any, out: Any) -> None:
    import torch

    from sparkdl.wire.model_transfer import deliver

    state = {f"layer{i}.weight": torch.randn((mb << 20) // 16) for i in range(4)}  # 4 tensors of mb/4 MB
    ready.put(rank)
    go.wait()
    record = deliver(sink, rank, state)
    out.put((rank, record["via"], record["seconds"]))


def one_round(mode: str, ranks: int, mb: int) -> float:
    from sparkdl.wire.model_transfer import ModelSink, PartReceiver

    context = mp.get_context("fork")
    directory = tempfile.mkdtemp(prefix="sparkdl-bench-transfer-")
    receiver = PartReceiver("127.0.0.1", directory) if mode == "channel" else None
    sink = ModelSink("channel", receiver.address) if receiver else \
        ModelSink(mode, storage_uri=os.path.join(directory, "store") if mode == "storage" else None)
    ready, out, go = context.Queue(), context.Queue(), context.Event()
    workers = [context.Process(target=_rank, args=(sink, r, mb, ready, go, out)) for r in range(ranks)]
    for w in workers:
        w.start()
    for _ in workers:
        ready.get()  # every part built before the clock starts
    started = time.perf_counter()
    go.set()
    results = [out.get() for _ in workers]
    seconds = time.perf_counter() - started
    for w in workers:
        w.join()
    if receiver is not None:
        receiver.close()
    assert {via for _, via, _ in results} == {mode}, results
    shutil.rmtree(directory, ignore_errors=True)
    return seconds


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    rounds: dict[str, list[float]] = {"channel": [], "storage": [], "rows": []}
    for _ in range(args.repeats):  # alternated, so drifting load falls on every mode alike
        for mode in rounds:
            rounds[mode].append(one_round(mode, args.ranks, args.mb))
    total_mb = args.ranks * args.mb
    result: dict[str, Any] = {"benchmark": "model_transfer", "ranks": args.ranks, "mb_per_rank": args.mb,
                              "repeats": args.repeats}
    for mode, seconds in rounds.items():
        median = statistics.median(seconds)
        result[mode] = {"median_s": round(median, 3), "mb_per_s": round(total_mb / median, 1),
                        "rounds_s": [round(s, 3) for s in seconds]}
    result["storage_over_channel"] = round(result["storage"]["median_s"] / result["channel"]["median_s"], 2)
    result["load_before"], result["load_after"] = [round(x, 2) for x in load_before], \
        [round(x, 2) for x in os.getloadavg()]
    text = json.dumps(result)
    (REPO / "benchmarks" / "results").mkdir(exist_ok=True)
    (REPO / "benchmarks" / "results" / "model_transfer.json").write_text(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
