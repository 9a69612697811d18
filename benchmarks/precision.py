"""Step time under train.precision "32" vs "bf16" (and "16" on CUDA), side by side in one run.

    .venv/bin/python benchmarks/precision.py [--device cpu|cuda] [--steps 20] [--repeats 5]

Times sparkdl's own optimizer step (strategies/stepping.OptimizerSteps: autocast forward, fp32 loss,
backward, fp32 master-weight step) on two models of the tensor-columns examples: a CNN on 28x28
images and a causal transformer on token ids. The precisions alternate repeat by repeat, so load on
a shared machine hits them alike; each figure is the median over repeats of the mean step time.
Prints one JSON object as the last line of stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "tests" / "support"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def cnn() -> Any:
    from torch import nn

    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 14 * 14, 128), nn.ReLU(), nn.Linear(128, 10))


def cases(device: str) -> dict[str, tuple[Callable[[], Any], Any, Any]]:
    import torch

    from sparkdl_test_models import tiny_gpt

    generator = torch.Generator().manual_seed(0)
    images = torch.randn(64, 1, 28, 28, generator=generator)
    classes = torch.randint(0, 10, (64,), generator=generator)
    tokens = torch.randint(0, 16, (64, 16), generator=generator)
    return {"cnn_28x28_batch64": (cnn, images.to(device), classes.to(device)),
            "gpt_tokens16_batch64": (tiny_gpt, tokens.to(device), torch.roll(tokens, -1, 1).to(device))}


def step_seconds(make_model: Callable[[], Any], x: Any, y: Any, precision: str, steps: int, device: str) -> float:
    import torch

    from sparkdl.config import TrainConfig
    from sparkdl.model.losses import BuiltinLoss
    from sparkdl.strategies.stepping import OptimizerSteps, float_output

    torch.manual_seed(0)
    model = make_model().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    stepping = OptimizerSteps(TrainConfig(precision=precision), device)
    loss_fn = BuiltinLoss("cross_entropy")

    def one() -> None:
        optimizer.zero_grad()
        with stepping.autocast():
            out = model(x)
        stepping.backward(loss_fn(float_output(out), y))
        stepping.step(optimizer, model.parameters())

    for _ in range(3):  # warm-up: allocator, kernels, autocast caches
        one()
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        one()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / steps


def measure(device: str, steps: int, repeats: int) -> dict[str, Any]:
    precisions = ["32", "bf16"] + (["16"] if device == "cuda" else [])
    result: dict[str, Any] = {}
    for name, (make_model, x, y) in cases(device).items():
        times: dict[str, list[float]] = {p: [] for p in precisions}
        for _ in range(repeats):
            for precision in precisions:
                times[precision].append(step_seconds(make_model, x, y, precision, steps, device))
        medians = {p: statistics.median(t) for p, t in times.items()}
        result[name] = {**{f"step_ms_{p}": round(1e3 * s, 3) for p, s in medians.items()},
                        **{f"speedup_{p}_vs_32": round(medians["32"] / medians[p], 3) for p in precisions[1:]}}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    import torch

    threads = int(os.environ.get("SPARKDL_BENCH_THREADS", "0")) or torch.get_num_threads()
    torch.set_num_threads(threads)
    result = {"benchmark": "precision", "device": args.device, "threads": threads, "steps": args.steps,
              "repeats": args.repeats, "load_1min": round(os.getloadavg()[0], 2), "torch": torch.__version__,
              "cases": measure(args.device, args.steps, args.repeats)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
