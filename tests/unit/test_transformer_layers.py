"""A Hugging Face transformer cut between its blocks (model/transformer_layers.py), without Spark:
the cut's logits are the model's own, its layers hold the model's own tensors under the model's
keys, and two pipeline stages on real gloo ranks train it to the weights of one process, tied
embedding and head included (strategies/pipeline_stages.py; 2 stages x 2 replicas through Spark:
tests/spark/test_hybrid_transformers.py)."""
from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")

from gloo_world import run_world  # noqa: E402
from sparkdl.config import RunConfig, TrainConfig  # noqa: E402
from sparkdl.errors import ConfigError, ModelError  # noqa: E402
from sparkdl.model.layouts import HybridLayout, default_grid  # noqa: E402
from sparkdl.model.transformer_layers import check_cut, cut_transformer, transformer_layers  # noqa: E402

V, T, H = 256, 8, 64


def tiny(family: str, **options: Any) -> nn.Module:
    torch.manual_seed(0)
    if family == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=H, n_head=2, vocab_size=V, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, **options))
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=H, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=V, **options))
    if family == "gpt2-lora":  # a LoRA adapter on the attention: the base frozen, its tied embedding too
        from peft import LoraConfig, get_peft_model

        return get_peft_model(tiny("gpt2"), LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True,
                                                       init_lora_weights=False))
    if family == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(
            hidden_size=H, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=V, sliding_window=3))
    if family == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            hidden_size=H, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=V))
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        hidden_size=H, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, vocab_size=V, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def token_batch(rows: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (rows, T), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    mask[-1, -2:] = 0  # right padding
    return ids, mask


def run_cut(cut: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    x = cut.layers[0](**inputs)
    for layer in cut.layers[1:]:
        x = layer(x)
    return x


@pytest.mark.parametrize("family,options", [("gpt2", {}), ("llama", {}), ("llama", {"tie_word_embeddings": True}),
                                            ("bert", {}), ("mistral", {}), ("qwen2", {})])
def test_the_cut_gives_the_model_s_own_logits(family: str, options: dict) -> None:
    model = tiny(family, **options).eval()
    cut = transformer_layers(model)
    assert cut is not None and len(cut.layers) == model.config.num_hidden_layers + 2
    ids, mask = token_batch()
    for inputs in ({"input_ids": ids}, {"input_ids": ids, "attention_mask": mask}):
        with torch.no_grad():
            expected, got = model(**inputs).logits, run_cut(cut, inputs)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    with torch.no_grad():  # the mask matters: padding changes the logits, and the cut follows it
        assert not torch.allclose(run_cut(cut, {"input_ids": ids}), run_cut(cut, {"input_ids": ids, "attention_mask": mask}))
    with torch.no_grad():  # one positional input, as input_cols=["tokens"] calls it
        torch.testing.assert_close(cut.sequential()(ids), model(ids).logits, atol=1e-6, rtol=0)


def test_layers_hold_the_model_s_own_tensors_under_its_keys() -> None:
    model = tiny("gpt2")
    cut = transformer_layers(model)
    assert cut is not None and cut.family == "gpt2"
    keys = [set(cut.keys(i)) for i in range(len(cut.layers))]
    assert set().union(*keys) == set(model.state_dict())
    assert keys[0] == {"transformer.wte.weight", "transformer.wpe.weight"}
    assert all(k.startswith("transformer.h.0.") for k in keys[1])
    assert keys[-1] == {"transformer.ln_f.weight", "transformer.ln_f.bias", "lm_head.weight"}
    own = dict(model.named_parameters(remove_duplicate=False))
    stage = cut.stage(range(2, 4))  # the last stage: block 1 and the head
    assert set(stage.state_dict()) == keys[2] | keys[3]
    for key, param in stage.named_parameters(remove_duplicate=False):
        assert param is own[key]  # shared, not copied
    # The tied pair: the embedding on the first layer, the head on the last, one tensor.
    assert cut.tied == (((0, "transformer.wte.weight"), (3, "lm_head.weight")),)
    untied = transformer_layers(tiny("llama"))
    tied = transformer_layers(tiny("llama", tie_word_embeddings=True))
    assert untied is not None and untied.tied == ()
    assert tied is not None and tied.tied == (((0, "model.embed_tokens.weight"), (3, "lm_head.weight")),)


def test_a_peft_model_is_cut_under_its_own_keys() -> None:
    pytest.importorskip("peft")
    model = tiny("gpt2-lora").eval()
    cut = transformer_layers(model)
    assert cut is not None and cut.family == "gpt2"
    assert set().union(*(set(cut.keys(i)) for i in range(len(cut.layers)))) == set(model.state_dict())
    assert "base_model.model.transformer.h.0.attn.c_attn.lora_A.default.weight" in cut.keys(1)
    assert cut.tied == (((0, "base_model.model.transformer.wte.weight"), (3, "base_model.model.lm_head.weight")),)
    ids, mask = token_batch()
    with torch.no_grad():
        torch.testing.assert_close(run_cut(cut, {"input_ids": ids, "attention_mask": mask}),
                                   model(input_ids=ids, attention_mask=mask).logits, atol=1e-6, rtol=0)


def test_bert_keys_and_the_classifier_head() -> None:
    model = tiny("bert")
    cut = transformer_layers(model)
    assert cut is not None and cut.family == "bert"
    assert {"classifier.weight", "bert.pooler.dense.weight"} <= set(cut.keys(len(cut.layers) - 1))
    assert all(k.startswith("bert.embeddings.") for k in cut.keys(0))
    token_types = torch.zeros(3, T, dtype=torch.long)
    token_types[:, T // 2:] = 1
    ids, mask = token_batch()
    inputs = {"input_ids": ids, "attention_mask": mask, "token_type_ids": token_types}
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(run_cut(cut, inputs), model(**inputs).logits, atol=1e-6, rtol=0)


def test_models_it_cannot_cut_are_named() -> None:
    assert transformer_layers(nn.Sequential(nn.Linear(2, 2))) is None
    assert transformer_layers(nn.Linear(2, 2)) is None
    with pytest.raises(ModelError, match=r"Linear cannot be cut into pipeline stages: looked for a ModuleList of "
                                         r"blocks at `h`.*`layers`.*`encoder.layer`"):
        cut_transformer(nn.Linear(2, 2))
    config = transformers.GPT2Config(n_layer=2, n_embd=H, n_head=2, vocab_size=V)
    with pytest.raises(ModelError, match=r"head module\(s\) \['score'\]"):
        transformer_layers(transformers.GPT2ForSequenceClassification(config))  # its head reads input_ids
    with pytest.raises(ModelError, match=r"head module\(s\) \['cls'\]"):
        transformer_layers(transformers.BertForMaskedLM(transformers.BertConfig(
            hidden_size=H, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, vocab_size=V)))


def test_a_variant_the_cut_does_not_reproduce_is_refused() -> None:
    class ScaledLogits(transformers.GPT2LMHeadModel):  # a family variant: its forward does one thing more
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            output = super().forward(*args, **kwargs)
            output.logits = output.logits * 2
            return output

    torch.manual_seed(0)
    model = ScaledLogits(transformers.GPT2Config(n_layer=2, n_embd=H, n_head=2, vocab_size=V))
    cut = transformer_layers(model)
    assert cut is not None
    with pytest.raises(ModelError, match="does not reproduce its own output"):
        check_cut(model, cut, token_batch()[0])
    check_cut(tiny("gpt2"), transformer_layers(tiny("gpt2")), token_batch()[0])  # type: ignore[arg-type]


def test_the_planner_cuts_a_transformer_between_its_blocks() -> None:
    from sparkdl.planner.profile import ModelInput
    from sparkdl.planner.stages import plan_hybrid

    run = RunConfig.from_kwargs(input_cols={"input_ids": "ids", "attention_mask": "mask"}, label_col="y",
                                strategy="hybrid", stages=2, num_workers=2, batch_size=4, loss="cross_entropy").validate()
    ids, mask = token_batch(4)
    sample = ModelInput.from_sample({"input_ids": ids, "attention_mask": mask}, ids)
    layout, profile, memory = plan_hybrid(tiny("llama"), run.data, run.train, run.launch, sample, "int64")
    assert [layer.kind for layer in profile.layers] == ["Embeddings", "Block", "Block", "Head"]
    assert layout.cuts[0] == 0 and layout.cuts[-1] == 4 and 0 < layout.cuts[1] < 4
    assert layout.boundary_shapes == ((T, H + 1),)  # hidden states and the mask channel
    assert len(memory) == 2
    model_loss = RunConfig.from_kwargs(input_cols=["ids"], label_col="y", strategy="hybrid", stages=2, num_workers=2,
                                       batch_size=4, loss="model").validate()
    with pytest.raises(ConfigError, match="loss='model'.*cannot train a pipeline"):
        plan_hybrid(tiny("gpt2"), model_loss.data, model_loss.train, model_loss.launch, sample, "int64")
    with pytest.raises(ModelError, match="cuts an nn.Sequential at its top-level layers, or a Hugging Face"):
        plan_hybrid(nn.Linear(2, 2), run.data, run.train, run.launch, sample, "int64")


# -- two stages on real gloo ranks against one process ------------------------------------------
STEPS, ROWS, LR = 3, 4, 0.1


def rank_rows(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels: next tokens, -100 where padded) of one rank's batch."""
    ids, mask = token_batch(ROWS, seed=1000 * rank + step)
    labels = torch.cat([ids[:, 1:], torch.full((ROWS, 1), -100)], dim=1).masked_fill(mask == 0, -100)
    return ids, mask, labels


def _pipeline_rank(comm: Any, family: str, options: dict, grad_clip: float) -> tuple[int, dict | None, list]:
    from sparkdl.model.losses import BuiltinLoss
    from sparkdl.strategies.hybrid import Hybrid

    layout = HybridLayout(stages=2, replicas=comm.size // 2, cuts=(0, 2, 4), boundary_shapes=((T, H + 1),),
                          boundary_dtypes=("float32",), input_shape=(), input_dtype="int64", label_dtype="int64",
                          microbatches=2, schedule="1f1b", grid=default_grid(2, comm.size // 2), label_shape=(T,),
                          input_specs=(("input_ids", (T,), "int64"), ("attention_mask", (T,), "int64")))
    strategy = Hybrid(comm, layout, TrainConfig(grad_clip=grad_clip))
    loss_fn = BuiltinLoss("cross_entropy")
    strategy.setup(tiny(family, **options), lambda p: torch.optim.SGD(p, lr=LR), loss_fn)
    for step in range(STEPS):
        ids, mask, labels = rank_rows(comm.rank, step)
        # Weights of 1: the executor loop's rule for labels with ignored positions (the global token mean).
        strategy.train_step({"input_ids": ids, "attention_mask": mask}, labels, torch.ones(ROWS))
    ids, mask, labels = rank_rows(comm.rank, STEPS)  # held out: validation through the pipeline
    sums = comm.allreduce(strategy.evaluate([({"input_ids": ids, "attention_mask": mask}, labels, None)], loss_fn,
                                            True), "sum")
    state = strategy.result_state()
    return comm.rank, {k: v.numpy() for k, v in state.items()} if state else None, sums.tolist()


def validation_sums(model: nn.Module, world: int) -> list[float]:
    """(loss sum, correct, rows, counted) as the pipeline validates: each replica's rows in one
    batch, its mean token loss times its rows."""
    sums = np.zeros(4)
    model.eval()
    for ranks in default_grid(2, world // 2):
        ids, mask, labels = (torch.cat(parts) for parts in zip(*(rank_rows(r, STEPS) for r in ranks)))
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
        counted = labels != -100
        sums += [float(F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100)) * len(ids),
                 float(((logits.argmax(-1) == labels) & counted).sum()), len(ids), float(counted.sum())]
    return sums.tolist()


def one_process(family: str, options: dict, grad_clip: float, world: int) -> nn.Module:
    """A plain training loop on every rank's rows at once: Hugging Face's model, SGD, the token mean."""
    model = tiny(family, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        ids, mask, labels = (torch.cat(parts) for parts in zip(*(rank_rows(r, step) for r in range(world))))
        logits = model(input_ids=ids, attention_mask=mask).logits
        loss = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
    return model


@pytest.mark.parametrize("family,options,world,grad_clip", [
    ("gpt2", {}, 2, 0.0), ("llama", {"tie_word_embeddings": True}, 2, 0.05), ("gpt2-lora", {}, 2, 0.0)])
def test_two_stages_train_the_weights_of_one_process(family: str, options: dict, world: int,
                                                     grad_clip: float) -> None:
    results = run_world(world, _pipeline_rank, family, options, grad_clip, timeout=300.0)
    merged: dict[str, np.ndarray] = {}
    for _, part, _ in results:
        for key, value in (part or {}).items():
            assert key not in merged
            merged[key] = value
    reference = one_process(family, options, grad_clip, world)
    expected = reference.state_dict()
    start = tiny(family, **options).state_dict()
    trainable = {k for k, p in reference.named_parameters(remove_duplicate=False) if p.requires_grad}
    if family == "gpt2-lora":  # frozen tensors are not returned: the adapter is what trained
        assert trainable <= set(merged) and not any(k.endswith("wte.weight") for k in merged)
        expected = {k: v for k, v in expected.items() if k in merged}
    assert set(merged) == set(expected)
    for key, value in expected.items():
        np.testing.assert_allclose(merged[key], value.numpy(), atol=1e-5, rtol=0, err_msg=key)
    assert sum(not np.allclose(merged[k], start[k].numpy()) for k in trainable) > len(trainable) // 2  # it trained
    tied = transformer_layers(reference)
    assert tied is not None
    for group in tied.tied if family != "gpt2-lora" else ():  # both stages' copies of a tied tensor stayed bit-equal
        first, *others = (merged[key] for _, key in group)
        assert all(np.array_equal(first, other) for other in others)
    np.testing.assert_allclose(results[0][2], validation_sums(reference, world), rtol=1e-5)
    # The stages' states load back into the model, still tied.
    model = copy.deepcopy(reference)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in merged.items()}, strict=family != "gpt2-lora")
    if options.get("tie_word_embeddings", family.startswith("gpt2")):
        assert model.lm_head.weight is model.get_input_embeddings().weight
