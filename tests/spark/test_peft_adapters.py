"""PEFT adapters on local-cluster: a LoRA-wrapped GPT-2 (peft + transformers, built from a config) fitted
with data parallel and with DiLoCo sends, checkpoints and returns only the adapter's tensors (frozen
base weights are never synced, saved or returned: model/trained_state.py), its frozen weights come
back unchanged and its adapter trained; the adapter saved in PEFT's layout loads with peft alone and
gives the same logits, merged it scores without peft; the MLflow model (base weights written once by
the driver) loads and scores; a rank killed mid-fit resumes exactly."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from sparkdl import TorchEstimator
from sparkdl.datasets import synthetic_tokens_dataframe

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 256, 16
ADAPTER_PARAMS = 2 * (64 * 4 + 4 * 192)  # two layers' c_attn: A (64 x 4) and B (4 x 192)


def config() -> "transformers.GPT2Config":
    return transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=64,
                                   bos_token_id=0, eos_token_id=0)


class LogitsOnly(nn.Module):
    """Returns `.logits` of the Hugging Face output (until the calling rule of issue 51 takes ModelOutputs)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=x).logits


def base_gpt() -> nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config())


def lora_gpt() -> nn.Module:
    return LogitsOnly(peft.get_peft_model(base_gpt(), peft.LoraConfig(r=4, target_modules=["c_attn"])))


def frozen(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}


def trainable(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.fixture(scope="module")
def tokens(spark):  # type: ignore[no-untyped-def]
    # Exactly two partitions: each rank's rows are the same in every run (resumes compare weights).
    rows = synthetic_tokens_dataframe(spark, rows=160, seq_len=SEQ, vocab=VOCAB, seed=0).collect()
    df = spark.createDataFrame(rows)
    return df.withColumn("labels", df["tokens"]).repartition(2).cache()


SYNCS = {"data_parallel": {}, "diloco": {"sync": "diloco", "sync_every": 3, "outer_lr": 0.7, "outer_momentum": 0.9}}
# The PeftModel itself, unwrapped: bound to its forward's parameters, its own causal-LM loss on `labels`.
OWN_LOSS = {"label_col": "labels", "loss": "model"}


def peft_gpt() -> nn.Module:
    return peft.get_peft_model(base_gpt(), peft.LoraConfig(r=4, target_modules=["c_attn"], task_type="CAUSAL_LM"))


def logits(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x) if isinstance(module, LogitsOnly) else module(input_ids=x).logits


def fit(df, start: nn.Module, **options):  # type: ignore[no-untyped-def]
    settings = dict(model=start, input_cols=["tokens"], label_col="targets", batch_size=8, epochs=2, num_workers=2,
                    optimizer="adamw", lr=1e-2, seed=5, strategy="data_parallel", tracking=False, progress=False,
                    peer_failure_delay_s=0.5)
    settings.update(options)
    return TorchEstimator(**settings).fit(df)


@pytest.mark.parametrize("sync", [*sorted(SYNCS), "own_loss"])
def test_a_lora_fit_sends_checkpoints_and_returns_only_the_adapter(spark, tokens, tmp_path, sync) -> None:  # type: ignore[no-untyped-def]
    start = peft_gpt() if sync == "own_loss" else lora_gpt()
    base_bytes, adapter_bytes = nbytes(frozen(start)), nbytes(trainable(start))
    assert adapter_bytes == ADAPTER_PARAMS * 4 and base_bytes > 50 * adapter_bytes
    tracked = {"tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "tracking": True} if sync == "data_parallel" else {}
    model = fit(tokens, start, checkpoint_dir=str(tmp_path / "checkpoints"), checkpoint_every=3,
                **SYNCS.get(sync, OWN_LOSS), **tracked)
    trained = model.torch_module()

    # returned: the adapter's bytes (one rank's part for data parallel, every replica agrees for DiLoCo)
    assert 0 < model.model_return["bytes"] < 2 * adapter_bytes + 16_384, model.model_return
    # synced: per step and rank far below one copy of the base (DiLoCo: far below the adapter too)
    steps = sum(h["steps"] for h in model.history)
    sent = sum(h["bytes_sent_all_ranks"] for h in model.history)
    assert sent < steps * 2 * (adapter_bytes + 4096), (sent, steps)
    print(f"{sync}: base {base_bytes} B, adapter {adapter_bytes} B, returned {model.model_return['bytes']} B, "
          f"sent {sent} B in {steps} steps (all ranks)")
    # checkpointed: each part holds the adapter (and its optimizer state), none of the base
    parts = sorted((tmp_path / "checkpoints").rglob("rank-*.pt"))
    assert parts and all(p.stat().st_size < base_bytes / 8 for p in parts), [(p, p.stat().st_size) for p in parts]
    print(f"{sync}: checkpoint parts {sorted({p.stat().st_size for p in parts})} B")
    saved = torch.load(parts[-1].parent / "rank-0.pt", weights_only=True)["strategy"]["module"]
    assert set(saved) == {f"{n}" for n in trainable(start)}

    # the frozen base came back as it went; the adapter trained
    for name, value in frozen(start).items():
        assert torch.equal(dict(trained.named_parameters())[name], value), name
    moved = [n for n, v in trainable(start).items() if not torch.equal(dict(trained.named_parameters())[n], v)]
    assert len(moved) == 4
    assert model.history[-1]["loss"] < model.history[0]["loss"]

    # PEFT's layout, loaded by peft alone on a base built from the same config and seed: the same logits
    written = model.save_adapter(str(tmp_path / "adapter"))
    assert {os.path.basename(p) for p in written} >= {"adapter_config.json", "adapter_model.safetensors"}
    assert os.path.getsize(tmp_path / "adapter" / "adapter_model.safetensors") < adapter_bytes + 4096
    loaded = peft.PeftModel.from_pretrained(base_gpt(), str(tmp_path / "adapter")).eval()
    rows = tokens.limit(4).collect()  # fixed rows: limit() over a repartition may pick others each time
    x = torch.tensor([r["tokens"] for r in rows])
    with torch.no_grad():
        want = logits(trained.eval(), x)
        torch.testing.assert_close(loaded(input_ids=x).logits, want, atol=1e-6, rtol=0)
        merged = model.merged()
        plain = merged.torch_module()
        assert type(plain.inner if isinstance(plain, LogitsOnly) else plain) is transformers.GPT2LMHeadModel
        torch.testing.assert_close(logits(plain, x), want, atol=1e-5, rtol=1e-5)
    assert model.torch_module() is trained  # merging left the trained model as it was

    if sync == "data_parallel":  # the MLflow model: the ranks' adapter part plus the driver's frozen part
        import mlflow

        mlflow.set_tracking_uri(tracked["tracking_uri"])
        try:
            weights = Path(mlflow.artifacts.download_artifacts(model.model_uri, dst_path=str(tmp_path / "logged")))
            served = mlflow.pyfunc.load_model(model.model_uri)
            frame = spark.createDataFrame(rows[:3], tokens.schema).select("tokens").toPandas()
            predicted = served.predict(frame)["prediction"]
        finally:
            mlflow.set_tracking_uri(None)
        files = sorted(p.name for p in weights.rglob("*.safetensors"))
        assert "frozen.safetensors" in files and len(files) == 2, files
        expected = want[:3].argmax(-1).tolist()
        assert [list(p) for p in predicted] == expected


CALLS: dict[int, int] = {}  # per process: the driver's probe calls the loss too, before it is shipped
MARKER = {"path": ""}


def killing_loss(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-position cross-entropy; rank 1 kills itself (SIGKILL) at its 8th step, once per marker file."""
    CALLS[os.getpid()] = calls = CALLS.get(os.getpid(), 0) + 1
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 1 and calls == 8 and MARKER["path"] and not os.path.exists(MARKER["path"]):
        Path(MARKER["path"]).touch()
        from sparkdl.executor.checkpoint_async import wait_idle

        wait_idle(60)
        os.kill(os.getpid(), signal.SIGKILL)
    return nn.functional.cross_entropy(output.flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("sync", sorted(SYNCS))
def test_a_killed_rank_resumes_a_lora_fit_exactly(spark, tokens, tmp_path, sync) -> None:  # type: ignore[no-untyped-def]
    start = lora_gpt()
    MARKER["path"] = str(tmp_path / "killed")
    Path(MARKER["path"]).touch()  # present: the reference run never kills
    reference = fit(tokens, start, loss=killing_loss, **SYNCS[sync])
    os.remove(MARKER["path"])
    resumed = fit(tokens, start, loss=killing_loss, checkpoint_dir=str(tmp_path / "checkpoints"), checkpoint_every=3,
                  **SYNCS[sync])
    assert os.path.exists(MARKER["path"]), "the worker was never killed"
    assert [h.get("resumed_from_step") for h in resumed.history] == [3, None], resumed.history
    got, want = resumed.torch_module().state_dict(), reference.torch_module().state_dict()
    assert set(got) == set(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=0, msg=key)
    for name, value in frozen(start).items():
        assert torch.equal(got[name], value), name
    assert np.isclose(resumed.history[-1]["loss"], reference.history[-1]["loss"], rtol=1e-5)
