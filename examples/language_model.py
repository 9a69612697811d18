"""A small GPT trained on token columns: bytes of the Python standard library's own sources.

    python examples/language_model.py [--master local[2]] [--strategy data_parallel|diloco|hybrid]
        [--epochs 2] [--seq-len 64] [--rows 2048] [--d-model 64] [--layers 2]

`tokens` and `targets` are array<int> columns (targets = tokens shifted by one byte); the model maps
(B, T) int64 token ids to (B, T, 256) logits and the built-in cross_entropy scores every position.
The GPT is an nn.Sequential of one-tensor layers, so `--strategy hybrid` can cut it between blocks.
"""
from __future__ import annotations

import argparse
import functools
import time

import torch
import torch.nn.functional as F
from pyspark.sql import SparkSession
from torch import nn

from sparkdl import TorchEstimator
from sparkdl.datasets import text_tokens_dataframe

VOCAB = 256  # byte-level


class Embed(nn.Module):  # (B, T) int64 -> (B, T, d): token + learned position embedding
    def __init__(self, d_model: int, seq_len: int) -> None:
        super().__init__()
        self.token, self.position = nn.Embedding(VOCAB, d_model), nn.Embedding(seq_len, d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.token(tokens) + self.position.weight[: tokens.shape[1]]


class Block(nn.Module):  # pre-LN causal self-attention + MLP, (B, T, d) -> (B, T, d)
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads, self.ln1, self.ln2 = heads, nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).chunk(3, dim=-1))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


def gpt(d_model: int = 64, layers: int = 2, heads: int = 4, seq_len: int = 64) -> nn.Sequential:
    head = nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, VOCAB))  # -> (B, T, vocab) logits
    return nn.Sequential(Embed(d_model, seq_len), *[Block(d_model, heads) for _ in range(layers)], head)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--strategy", choices=("data_parallel", "diloco", "hybrid"), default="data_parallel")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)

    spark = SparkSession.builder.master(args.master).getOrCreate()
    train, test = text_tokens_dataframe(spark, seq_len=args.seq_len, max_rows=args.rows).randomSplit([0.9, 0.1], seed=0)
    layout = {"data_parallel": dict(strategy="data_parallel"),
              "diloco": dict(strategy="data_parallel", sync="diloco", sync_every=20),
              "hybrid": dict(strategy="hybrid", stages=2, microbatches=4)}[args.strategy]
    started = time.perf_counter()
    model = TorchEstimator(model=functools.partial(gpt, args.d_model, args.layers, 4, args.seq_len),
                           input_cols=["tokens"], label_col="targets", loss="cross_entropy", **layout,
                           optimizer="adamw", lr=3e-3, lr_schedule="cosine", warmup_steps=10, min_lr=3e-4,
                           batch_size=32, epochs=args.epochs, num_workers=2, validation_fraction=0.1,
                           metrics=["perplexity"], seed=0, progress=False).fit(train)
    seconds = time.perf_counter() - started
    perplexity = model.history[-1]["val_perplexity"]  # exp(mean token cross entropy), exact over ranks
    rows = model.transform(test).select("targets", "prediction").collect()
    hits = sum(p == t for r in rows for p, t in zip(r["prediction"], r["targets"]))
    accuracy = hits / max(1, sum(len(r["targets"]) for r in rows))
    bytes_sent = int(sum(h["bytes_sent_all_ranks"] for h in model.history))
    print(f"GPT {args.layers}x{args.d_model} ({args.strategy}): validation perplexity {perplexity:.2f} (uniform: "
          f"{VOCAB}), test next-byte accuracy {accuracy:.3f}, {bytes_sent / 1e6:.1f} MB sent, fit {seconds:.1f} s")
    return {"perplexity": perplexity, "test_accuracy": accuracy, "bytes_sent": bytes_sent, "seconds": seconds,
            "history": model.history}


if __name__ == "__main__":
    main()
