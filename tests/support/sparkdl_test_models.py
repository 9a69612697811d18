"""An importable model factory for the `model.factory` tests (installed on the test path)."""
import torch
import torch.nn.functional as F
from torch import nn

TOKEN_VOCAB, TOKEN_LEN, TOKEN_WIDTH = 16, 16, 32
V, T, D = TOKEN_VOCAB, TOKEN_LEN, TOKEN_WIDTH


def small_digits_net() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, D), nn.Embedding(T, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.qkv = nn.LayerNorm(D), nn.Linear(D, 3 * D)
        self.mlp = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln(x)).view(x.shape[0], x.shape[1], 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(x.shape)
        return x + self.mlp(x)


def tiny_gpt() -> nn.Sequential:
    """A two-block causal transformer as an nn.Sequential (hybrid cuts between blocks)."""
    return nn.Sequential(Embed(), Block(), Block(), nn.Sequential(nn.LayerNorm(D), nn.Linear(D, V)))




def stop_after_first_epoch(record: dict) -> str | None:
    """A driver callback for TOML/CLI runs (train.callbacks = ["sparkdl_test_models:stop_after_first_epoch"])."""
    return "stop" if record["epoch"] >= 0 else None
