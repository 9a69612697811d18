"""A model larger than one worker should hold (issue 21): a GPT-style transformer given as one
factory per layer (built on the meta device: nobody materialises it whole), trained a few steps
with data parallel (where it fits), hybrid (4 pipeline stages) and sharded data parallel (ZeRO-3)
on local-cluster[2,2,...] (4 ranks), through the public API.

    .venv/bin/python benchmarks/big_model.py [--blocks 20] [--width 768] [--vocab 8192] [--seq 64]
        [--rows-per-rank 4] [--batch 2] [--strategies data_parallel,hybrid,sharded] [--no-plan]
    .venv/bin/python benchmarks/big_model.py --model-return [--blocks 18 --width 1536 --seq 16]

--model-return (issue 29): how the trained model comes back to a small driver (spark.driver.memory=1g,
spark.driver.maxResultSize=64m, 1g executors): a model of --blocks/--width (510M parameters, 2 GB fp32
by default) trained 2 steps with sharded on 4 ranks and brought back over the driver channel and
through storage; the driver's peak RSS over the model's bytes, the seconds and MB/s of the trip; and
side by side a small model (--small-blocks) that the job's rows (today's collect path) still carry.

For each strategy: every rank's peak RSS as the rank measured it (VmHWM since its task started),
what it grew by from just before its model was built, the driver's own peak RSS during the fit,
the mean step time (the epoch's seconds over its steps), and these against what data parallel keeps on every rank for this model
(fp32 parameters + gradients + Adam's two moments: 16 bytes per parameter). Then the planner's
choice (strategy="auto") with its reason. One JSON object on the last line; nothing asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPE = {"vocab": 8192, "width": 768, "seq": 64, "heads": 12}


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(SHAPE["vocab"], SHAPE["width"]), nn.Embedding(SHAPE["seq"], SHAPE["width"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))


class Block(nn.Module):
    """Pre-norm causal self-attention and a 4x MLP, from nn.Linear / nn.LayerNorm only (their
    reset_parameters materialise a meta build exactly)."""

    def __init__(self) -> None:
        super().__init__()
        d = SHAPE["width"]
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        heads = SHAPE["heads"]
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.out = nn.LayerNorm(SHAPE["width"]), nn.Linear(SHAPE["width"], SHAPE["vocab"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def on_meta(cls: type) -> Any:
    def build() -> nn.Module:
        with torch.device("meta"):
            return cls()
    build.__name__ = f"meta_{cls.__name__}"
    return build


def layers(blocks: int) -> list[Any]:
    return [on_meta(Embed)] + [on_meta(Block)] * blocks + [on_meta(Head)]


def parameter_count(blocks: int) -> int:
    d, v, t = SHAPE["width"], SHAPE["vocab"], SHAPE["seq"]
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    return v * d + t * d + blocks * block + 2 * d + d * v + v


def _driver_rss(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def run(df: Any, blocks: int, strategy: str, batch: int) -> dict[str, Any]:
    from sparkdl import TorchEstimator

    extra: dict[str, Any] = {"stages": 4, "microbatches": 4} if strategy == "hybrid" else {}
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # the driver's own peak from here
    driver_before = _driver_rss("VmRSS:")
    started = time.perf_counter()
    model = TorchEstimator(model=layers(blocks), input_cols=["tokens"], label_col="targets", epochs=1,
                           batch_size=batch, num_workers=4, optimizer="adam", lr=3e-4, strategy=strategy,
                           shuffle=False, tracking=False, progress=False, log_every=1, **extra).fit(df)
    seconds = time.perf_counter() - started
    record = model.history[-1]
    steps = int(record["steps"])
    del model
    out = {"strategy": strategy, "fit_s": round(seconds, 1), "steps": steps,
           "step_s": round(float(record["seconds"]) / max(steps, 1), 3),
           "peak_rss_mb_by_rank": [v >> 20 for v in record["peak_rss_bytes_by_rank"]],
           "grown_from_model_start_mb_by_rank": [(p - s) >> 20 for p, s in zip(record["peak_rss_bytes_by_rank"],
                                                                               record["model_start_rss_bytes_by_rank"])],
           "param_mb_per_rank_max": round(record["max_param_bytes_per_rank"] / 2**20, 1),
           "driver_peak_rss_mb": _driver_rss("VmHWM:") >> 20, "driver_rss_before_mb": driver_before >> 20}
    print(json.dumps(out), flush=True)
    return out


def model_return_run(df: Any, blocks: int, width: int, transfer: str, storage: str | None) -> dict[str, Any]:
    """One fit of `blocks` blocks `width` wide, brought back by `transfer`; the driver's peak RSS
    from its start."""
    from sparkdl import TorchEstimator

    SHAPE.update(width=width, heads=max(1, width // 64))  # read when the factories are pickled for this fit

    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    before = _driver_rss("VmRSS:")
    started = time.perf_counter()
    extra = {"checkpoint_dir": storage} if transfer == "storage" else {}
    try:
        model = TorchEstimator(model=layers(blocks), input_cols=["tokens"], label_col="targets", epochs=1,
                               batch_size=1, num_workers=4, optimizer="sgd", lr=1e-3, strategy="sharded",
                               shuffle=False, tracking=False, progress=False, model_transfer=transfer,
                               **extra).fit(df)
    except Exception as exc:  # noqa: BLE001 - the collect path failing on a large model is a result
        failed = {"transfer": transfer, "blocks": blocks, "width": width, "error": str(exc).splitlines()[0][:300]}
        print(json.dumps(failed), flush=True)
        return failed
    fit_s = time.perf_counter() - started
    params = sum(p.numel() for p in model.torch_module().parameters())
    model_bytes = model.model_return["bytes"]
    back_s = model.model_return["send_s"] + model.fit_seconds.get("load_model", 0.0)
    out = {"transfer": transfer, "blocks": blocks, "width": width, "parameters": params, "model_mb": round(model_bytes / 2**20, 1),
           "via": sorted(set(model.model_transfer.values())), "fit_s": round(fit_s, 1),
           "send_s": round(model.model_return["send_s"], 2),
           "load_on_driver_s": round(model.fit_seconds.get("load_model", 0.0), 2),
           "back_s": round(back_s, 2), "back_mb_per_s": round(model_bytes / 2**20 / max(back_s, 1e-9), 1),
           "driver_rss_before_mb": before >> 20, "driver_peak_rss_mb": _driver_rss("VmHWM:") >> 20,
           "driver_peak_over_model": round(_driver_rss("VmHWM:") / max(model_bytes, 1), 3)}
    del model
    print(json.dumps(out), flush=True)
    return out


def model_return(args: Any) -> dict[str, Any]:
    import tempfile

    from pyspark.sql import SparkSession

    from sparkdl.datasets import synthetic_tokens_dataframe

    spark = (SparkSession.builder.master("local-cluster[2,2,1024]").appName("sparkdl-bench-model-return")
             .config("spark.driver.memory", "1g").config("spark.driver.maxResultSize", "64m")
             .config("spark.executor.memory", "1g").config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    load_before = os.getloadavg()
    df = synthetic_tokens_dataframe(spark, rows=8, seq_len=args.seq, vocab=args.vocab, seed=0).repartition(4).cache()
    df.count()
    storage = tempfile.mkdtemp(prefix="sparkdl-bench-storage-")
    result: dict[str, Any] = {"benchmark": "model_return", "ranks": 4, "driver_memory": "1g",
                              "max_result_size": "64m", "executor_memory": "1g", "width": args.width,
                              "vocab": args.vocab, "seq": args.seq, "big": [], "small": []}
    for transfer in ("channel", "storage"):
        result["big"].append(model_return_run(df, args.blocks, args.width, transfer, storage))
    for transfer in ("rows", "channel", "storage"):  # today's collect path on a model it can still carry
        result["small"].append(model_return_run(df, args.small_blocks, args.small_width, transfer, storage))
    result["load_before"], result["load_after"] = [round(x, 2) for x in load_before], \
        [round(x, 2) for x in os.getloadavg()]
    spark.stop()
    print(json.dumps(result))
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--rows-per-rank", type=int, default=6)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--strategies", default="data_parallel,hybrid,sharded")
    parser.add_argument("--no-plan", action="store_true")
    parser.add_argument("--model-return", action="store_true", help="issue 29: the trip back to a 1g driver")
    parser.add_argument("--small-blocks", type=int, default=2)
    parser.add_argument("--small-width", type=int, default=384)
    args = parser.parse_args(argv)
    if args.model_return:
        defaults = {"blocks": 18, "width": 1536, "seq": 16}
        for name, value in defaults.items():
            if f"--{name}" not in (argv if argv is not None else sys.argv):
                setattr(args, name, value)
    SHAPE.update(vocab=args.vocab, width=args.width, seq=args.seq, heads=max(1, args.width // 64))
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if args.model_return:
        return model_return(args)
    from pyspark.sql import SparkSession

    import sparkdl
    from sparkdl.datasets import synthetic_tokens_dataframe

    spark = (SparkSession.builder.master("local-cluster[2,2,6144]").appName("sparkdl-bench-big-model")
             .config("spark.driver.memory", "6g").config("spark.executor.memory", "4g")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.executorEnv.SPARKDL_BENCH", "1").getOrCreate())
    load_before = os.getloadavg()
    params = parameter_count(args.blocks)
    df = synthetic_tokens_dataframe(spark, rows=4 * args.rows_per_rank, seq_len=args.seq, vocab=args.vocab,
                                    seed=0).repartition(4).cache()
    df.count()
    state = 16 * params
    result: dict[str, Any] = {"benchmark": "big_model", "parameters": params, "blocks": args.blocks,
                              "width": args.width, "vocab": args.vocab, "seq": args.seq, "ranks": 4,
                              "data_parallel_state_mb": state >> 20, "runs": []}
    for strategy in [s for s in args.strategies.split(",") if s]:
        try:
            run_result = run(df, args.blocks, strategy, args.batch)
        except Exception as exc:  # noqa: BLE001 - a layout that does not fit is a result too
            run_result = {"strategy": strategy, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
            print(json.dumps(run_result), flush=True)
        if "peak_rss_mb_by_rank" in run_result:
            run_result["max_peak_rss_over_dp_state"] = round(max(run_result["peak_rss_mb_by_rank"]) / (state >> 20), 3)
            run_result["max_grown_over_dp_state"] = round(
                max(run_result["grown_from_model_start_mb_by_rank"]) / (state >> 20), 3)
            run_result["driver_peak_over_dp_state"] = round(run_result["driver_peak_rss_mb"] / (state >> 20), 3)
        result["runs"].append(run_result)
    if not args.no_plan:
        plan = sparkdl.plan(layers(args.blocks), df, input_cols=["tokens"], label_col="targets", num_workers=4,
                            batch_size=args.batch, optimizer="adam", max_memory_per_rank=f"{int(0.6 * state)}B")
        result["planner"] = {"chosen": plan.choice.label if plan.choice is not None else plan.strategy,
                             "reason": plan.choice.reason if plan.choice is not None else "",
                             "explain": plan.explain().splitlines()[:24]}
        print("\n".join(result["planner"]["explain"]), flush=True)
    result["step_s"] = {r["strategy"]: r.get("step_s") for r in result["runs"]}
    result["load_before"], result["load_after"] = [round(x, 2) for x in load_before], \
        [round(x, 2) for x in os.getloadavg()]
    spark.stop()
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
