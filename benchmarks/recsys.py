"""Recommender embeddings: sharded against replicated (and, on the bed, TorchDistributor DDP) (issue 45).

    PYTHONPATH=. .venv/bin/python benchmarks/recsys.py [--steps 30] [--batch 1024] [--big] [--link account|sleep]
    sudo PYTHONPATH=. .venv/bin/python benchmarks/recsys.py --mode bed [--world 2] [--steps-per-epoch 6]
        [--epochs 3] [--rows-min 10000] [--rows-max 100000] [--variants sharded,replicated,ddp]

--mode bed (benchmarks/recsys_bed.py, recsys_bed_driver.py on the bed's driver host): the issue's
full benchmark through Spark on the multi-host bed, worker links shaped at --gbps (0.1: 100 Mbit/s):
TorchEstimator.fit with sparse_cols and embedding_placement "sharded" and "replicated", and PySpark's
TorchDistributor running DDP (gloo) on the same DLRM with its tables whole, the same data, batch,
epochs and Adam; bytes per step from the worker hosts' link counters, samples/s of the steady
epochs, held-out AUC. Writes benchmarks/results/recsys_bed.json (--out). Its docstring has the details.

--mode local (the default) runs without Spark: W (2) real gloo ranks on 127.0.0.1
(tests/support/gloo_world.py), each link emulated at --gbps (0.1: 100 Mbit/s) and --latency-ms by
sparkdl.comm.emulated.EmulatedNetwork, and two variants one after the other in the same processes,
with the same model, data, seeds, optimizers and number of steps:

  sharded     ShardedEmbeddingTraining: tables row-wise sharded, lookups and row gradients by
              all-to-all of the rows a batch touches, RowwiseAdagrad where the rows live, the dense
              part averaged by one allreduce, Adam
  replicated  the same DLRM with its EmbeddingBagCollection whole on every rank (sparkdl's data
              parallel): every gradient, dense and whole tables, averaged by allreduce each step
              (one allreduce per table, one for the dense part: DDP-sized buckets), the same Adam on
              the dense part and the same row-wise Adagrad formula applied to every row of every table
              (a row with a zero gradient does not move, so it is the sharded update exactly)

Data: a synthetic Criteo-like click log: 26 single-hot categorical columns, ids Zipf-distributed
(--zipf 1.1) over each table's rows and scattered over the id space by a fixed permutation (so hot
rows land on every shard), 13 dense standard-normal features, labels drawn from a planted logistic
model (a per-id effect for each column plus a linear dense term), so that AUC means something. Tables:
26 log-spaced sizes from --rows-min (local 1e5, bed 1e4) to --rows-max (local 1e6: 10.2M rows, 661 MB of
fp32 at dim 16; bed 1e5: 1.02M rows, 65 MB); --big: up to 1e7 rows.

--link account (default): the emulator's delay (latency x messages + bytes sent / bandwidth, less
the real time the operation took: EmulatedNetwork's own formula, subclassed to add instead of sleep)
is added to each step's clock rather than slept, so the replicated variant (661 MB a step at 100
Mbit/s: about 50 s a step) fits a short run; --link sleep really sleeps (small tables or few steps).

Per variant: bytes per step per rank (the communicator's counters), samples/s (global batch over the
median step time after --warmup steps, the slowest rank's), AUC on a held-out set after the same
steps (sklearn's roc_auc_score; a rank-based AUC without sklearn). Prints JSON last (--out writes it too).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "support"))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from gloo_world import run_world  # noqa: E402

TABLES = 26
DENSE = 13


def table_rows(rows_min: int, rows_max: int) -> list[int]:
    """26 sizes log-spaced from rows_min to rows_max (Criteo's columns span several decades)."""
    return [int(round(v)) for v in np.geomspace(rows_min, rows_max, TABLES)]


def make_log(rows: list[int], samples: int, zipf: float, seed: int) -> dict[str, np.ndarray]:
    """`samples` clicks: ids [samples, 26], dense [samples, 13], labels [samples] (planted logistic model)."""
    rng = np.random.default_rng(seed)
    ids = np.empty((samples, TABLES), dtype=np.int64)
    logit = np.zeros(samples)
    for t, n in enumerate(rows):
        weights = np.arange(1, n + 1, dtype=np.float64) ** -zipf
        cdf = np.cumsum(weights)
        ranks = np.searchsorted(cdf, rng.random(samples) * cdf[-1])
        ids[:, t] = rng.permutation(n)[ranks]  # the hot ids spread over the whole table
        effect = rng.normal(0.0, 0.6, size=n)  # indexed by id, so a row's effect is fixed
        logit += effect[ids[:, t]]
    dense = rng.normal(size=(samples, DENSE)).astype(np.float32)
    logit = logit / np.sqrt(TABLES / 4) + dense @ rng.normal(0.0, 0.4, size=DENSE) - 1.0
    labels = (rng.random(samples) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return {"ids": ids, "dense": dense, "labels": labels, "logit": logit}


def _batch(log: dict[str, np.ndarray], start: int, stop: int) -> tuple[Any, Any, Any]:
    import torch

    from sparkdl.embeddings import Bag

    ids = torch.from_numpy(log["ids"][start:stop])
    offsets = torch.arange(stop - start, dtype=torch.int64)
    sparse = {f"c{t}": Bag(ids[:, t].contiguous(), offsets) for t in range(TABLES)}
    return torch.from_numpy(log["dense"][start:stop]), sparse, torch.from_numpy(log["labels"][start:stop])


def _link(comm: Any, opts: dict[str, Any]) -> Any:
    from sparkdl.comm.emulated import EmulatedNetwork

    class AccountedNetwork(EmulatedNetwork):
        """The emulator's delays added up (emulated_s) instead of slept."""

        def _sleep(self, seconds: float) -> None:
            if seconds > 0:
                self.emulated_s += seconds

    cls = AccountedNetwork if opts["link"] == "account" else EmulatedNetwork
    return cls(comm, opts["latency_ms"] / 1e3, opts["gbps"] * 1e9 / 8)


def _model_factory(opts: dict[str, Any], specs: Any) -> Any:
    import torch

    from sparkdl.embeddings import DLRM

    def build() -> Any:
        torch.manual_seed(opts["seed"])  # the same dense initial weights in both variants
        return DLRM(DENSE, specs, bottom=[32, opts["dim"]], top=[64, 32], seed=opts["seed"])
    return build


class Replicated:
    """sparkdl's replicated data parallel on the DLRM with whole tables (see the module docstring)."""

    def __init__(self, comm: Any, model: Any, opts: dict[str, Any]) -> None:
        import torch

        self.comm, self.model, self.lr, self.eps = comm, model, opts["table_lr"], 1e-8
        self.tables = list(model.embeddings.weights)
        ids = {id(p) for p in self.tables}
        self.dense = [p for p in model.parameters() if id(p) not in ids]
        self.adam = torch.optim.Adam(self.dense, lr=opts["dense_lr"])
        self.sums = [torch.zeros(w.shape[0]) for w in self.tables]
        self.loss_fn = torch.nn.BCEWithLogitsLoss()

    def train_step(self, dense: Any, sparse: Any, labels: Any) -> None:
        import torch

        self.model.train()
        self.model.zero_grad(set_to_none=True)
        self.loss_fn(self.model(dense, sparse), labels).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in self.dense])
        self.comm.allreduce(flat, op="avg")
        for p, piece in zip(self.dense, torch.split(flat, [p.numel() for p in self.dense])):
            p.grad.copy_(piece.view_as(p))
        self.adam.step()
        with torch.no_grad():
            for weight, total in zip(self.tables, self.sums):
                grad = self.comm.allreduce(weight.grad, op="avg")
                # RowwiseAdagrad.update over every row (untouched rows: zero gradient, no move).
                total += grad.pow(2).mean(dim=1)
                weight -= self.lr * grad / (total.sqrt() + self.eps).unsqueeze(1)

    def predict(self, dense: Any, sparse: Any) -> Any:
        import torch

        self.model.eval()
        with torch.no_grad():
            return self.model(dense, sparse)


def _run_variant(comm: Any, name: str, log: dict[str, np.ndarray], held: dict[str, np.ndarray],
                 specs: Any, opts: dict[str, Any]) -> dict[str, Any]:
    import torch

    from sparkdl.embeddings import RowwiseAdagrad, ShardedEmbeddingTraining

    link = _link(comm, opts)
    factory = _model_factory(opts, specs)
    if name == "sharded":
        trainer: Any = ShardedEmbeddingTraining(
            link, factory, lambda params: torch.optim.Adam(params, lr=opts["dense_lr"]),
            RowwiseAdagrad(lr=opts["table_lr"]), torch.nn.BCEWithLogitsLoss())
    else:
        trainer = Replicated(link, factory(), opts)
    batch, world, rank = opts["batch"], comm.size, comm.rank
    times, sent, began_all = [], [], time.perf_counter()
    for step in range(opts["steps"]):
        start = (step * world + rank) * batch
        dense, sparse, labels = _batch(log, start, start + batch)
        link.barrier()  # steps start together, so one rank's lag is not charged to the next step
        before_bytes, before_link, began = link.bytes_sent, link.emulated_s, time.perf_counter()
        trainer.train_step(dense, sparse, labels)
        elapsed = time.perf_counter() - began
        if opts["link"] == "account":
            elapsed += link.emulated_s - before_link
        times.append(elapsed)
        sent.append(link.bytes_sent - before_bytes)
    train_wall_s = time.perf_counter() - began_all
    share = len(held["labels"]) // world
    preds = []
    for start in range(rank * share, (rank + 1) * share, 4096):
        dense, sparse, _ = _batch(held, start, min(start + 4096, (rank + 1) * share))
        preds.append(trainer.predict(dense, sparse).numpy())
    kept = opts["warmup"]
    return {"step_s": times[kept:], "bytes_per_step": statistics.median(sent[kept:]),
            "predictions": np.concatenate(preds).tolist(), "rows": (rank * share, (rank + 1) * share),
            "train_wall_s": train_wall_s, "link_s": link.emulated_s}


def rank_main(comm: Any, opts: dict[str, Any]) -> dict[str, Any]:
    from sparkdl.embeddings import TableSpec

    rows = table_rows(opts["rows_min"], opts["rows_max"])
    specs = [TableSpec(f"c{t}", n, opts["dim"]) for t, n in enumerate(rows)]
    train = make_log(rows, opts["steps"] * comm.size * opts["batch"] + opts["held_out"], opts["zipf"], opts["seed"])
    held = {k: v[-opts["held_out"]:] for k, v in train.items()}
    out = {}
    for name in opts["variants"]:
        out[name] = _run_variant(comm, name, train, held, specs, opts)
    return out


def _auc(labels: np.ndarray, scores: np.ndarray) -> float:
    try:
        from sklearn.metrics import roc_auc_score
    except ImportError:  # Mann-Whitney: the mean rank of the positives (ties are rare in float scores)
        ranks = np.empty(len(scores))
        ranks[np.argsort(scores, kind="stable")] = np.arange(1, len(scores) + 1)
        pos = labels > 0.5
        n_pos, n_neg = int(pos.sum()), int((~pos).sum())
        return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))
    return float(roc_auc_score(labels, scores))


def summarize(per_rank: list[dict[str, Any]], opts: dict[str, Any]) -> dict[str, Any]:
    rows = table_rows(opts["rows_min"], opts["rows_max"])
    log = make_log(rows, opts["steps"] * opts["world"] * opts["batch"] + opts["held_out"], opts["zipf"],
                   opts["seed"])
    held = log["labels"][-opts["held_out"]:]
    # The ceiling: the planted model's own logit scores the held-out labels this well.
    result: dict[str, Any] = {"planted_model_auc": round(_auc(held, log["logit"][-opts["held_out"]:]), 5),
                              "variants": {}}
    for name in opts["variants"]:
        ranks = [r[name] for r in per_rank]
        step_s = max(statistics.median(r["step_s"]) for r in ranks)  # the slowest rank's median
        scores = np.concatenate([r["predictions"] for r in ranks])
        labels = np.concatenate([held[a:b] for a, b in (r["rows"] for r in ranks)])
        result["variants"][name] = {
            "bytes_per_step_per_rank": max(r["bytes_per_step"] for r in ranks),
            "median_step_s": round(step_s, 4),
            "samples_per_s": round(opts["world"] * opts["batch"] / step_s, 1),
            "auc": round(_auc(labels, scores), 5),
            "train_wall_s": round(max(r["train_wall_s"] for r in ranks), 1),
            "link_s_total": round(max(r["link_s"] for r in ranks), 1)}
    if {"sharded", "replicated"} <= set(opts["variants"]):
        s, r = result["variants"]["sharded"], result["variants"]["replicated"]
        result["ratios"] = {"bytes_replicated_over_sharded": round(r["bytes_per_step_per_rank"]
                                                                  / s["bytes_per_step_per_rank"], 1),
                            "samples_per_s_sharded_over_replicated": round(s["samples_per_s"]
                                                                           / r["samples_per_s"], 1),
                            "auc_difference": round(s["auc"] - r["auc"], 5)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=("local", "bed"), default="local",
                        help="local: gloo ranks on this machine, links emulated; bed: Spark on the multi-host bed "
                             "against TorchDistributor DDP (benchmarks/recsys_bed.py)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30, help="local: steps")
    parser.add_argument("--steps-per-epoch", type=int, default=6, help="bed: steps a rank per epoch")
    parser.add_argument("--epochs", type=int, default=3, help="bed: epochs (the first one is not timed)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1024, help="samples per rank per step")
    parser.add_argument("--held-out", type=int, default=20000)
    parser.add_argument("--rows-min", type=int, help="smallest table (local 1e5, bed 1e4)")
    parser.add_argument("--rows-max", type=int, help="largest table (local 1e6, bed 1e5)")
    parser.add_argument("--big", action="store_true", help="tables up to 1e7 rows (--rows-max 10_000_000)")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--gbps", type=float, default=0.1)
    parser.add_argument("--latency-ms", type=float, default=0.2)
    parser.add_argument("--link", choices=("account", "sleep"), default="account")
    parser.add_argument("--dense-lr", type=float, help="local 1e-3, bed 1e-2 (Adam)")
    parser.add_argument("--table-lr", type=float, help="local (row-wise Adagrad) 0.1, bed (Adam) 1e-3")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", help="local: sharded,replicated; bed: sharded,replicated,ddp")
    parser.add_argument("--bed-timeout-s", type=float, default=1500.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    bed = args.mode == "bed"
    defaults = {"rows_min": 10_000 if bed else 100_000, "rows_max": 100_000 if bed else 1_000_000,
                "dense_lr": 1e-2 if bed else 1e-3, "table_lr": 1e-3 if bed else 0.1,
                "variants": "sharded,replicated,ddp" if bed else "sharded,replicated"}
    opts = {k: v for k, v in vars(args).items() if k not in ("out", "big", "mode")}
    opts.update({k: v for k, v in defaults.items() if opts[k] is None})
    if args.big:
        opts["rows_max"] = 10_000_000
    opts["variants"] = [v for v in opts["variants"].split(",") if v]
    if bed:
        import recsys_bed

        recsys_bed.main(opts, args.out or HERE / "results" / "recsys_bed.json")
        return
    started = time.perf_counter()
    per_rank = run_world(args.world, rank_main, opts, timeout=1800.0)
    result = {"config": {**opts, "tables": TABLES, "dense_features": DENSE,
                         "table_rows": table_rows(opts["rows_min"], opts["rows_max"])}}
    result.update(summarize(per_rank, opts))
    result["wall_s"] = round(time.perf_counter() - started, 1)
    text = json.dumps(result)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    main()
