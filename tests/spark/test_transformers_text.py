"""Hugging Face models as they are, on a real SparkSession (local-cluster, 2 ranks), with tiny models
built from configs and a tokenizer trained here on the data (nothing downloaded):
- a causal LM computing its own loss from `labels` (loss="model"), GPT-2 and Llama, by data parallel,
  ends with the weights of a single-process Hugging Face loop; loss="causal_lm" is the same loss;
- DiLoCo and strategy="auto" train it;
- a BERT-style sequence classifier trains from a string column with a tokenizer (object or
  tokenizer.json path), and scores in transform;
- a causal LM trains from a text column with packing; transform generates the text model.generate
  gives on the driver (greedy), or embeddings; the MLflow model answers a prompt with text.
"""
from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from sparkdl import TorchEstimator, TorchModel
from sparkdl.datasets import synthetic_tokens_dataframe
from served_model import served_answers

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

VOCAB, SEQ, ROWS, STEPS, LR = 256, 12, 32, 3, 0.5
POSITIVE = ["good", "great", "fine", "nice", "happy", "superb"]
NEGATIVE = ["bad", "awful", "poor", "sad", "ugly", "dull"]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "<|endoftext|>"]


def gpt2(vocab: int = VOCAB) -> nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=vocab, n_positions=64, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def llama() -> nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0))


@pytest.fixture(scope="module")
def tokens(spark):  # type: ignore[no-untyped-def]
    rows = synthetic_tokens_dataframe(spark, rows=ROWS, seq_len=SEQ, vocab=VOCAB, seed=1).collect()
    df = spark.createDataFrame(rows)
    return df.withColumn("labels", df["tokens"]).repartition(2).cache()


def fit(df, model: nn.Module, **options):  # type: ignore[no-untyped-def]
    # One batch per rank holds all its rows: each epoch is one step on every row, as one process's full batch.
    settings = dict(model=model, input_cols=["tokens"], label_col="labels", loss="model", epochs=STEPS,
                    batch_size=ROWS // 2, num_workers=2, optimizer="sgd", lr=LR, shuffle=False, seed=3,
                    tracking=False, progress=False, strategy="data_parallel")
    settings.update(options)
    return TorchEstimator(**settings).fit(df)


def hugging_face_loop(df, build) -> nn.Module:  # type: ignore[no-untyped-def]
    """The model trained in this process as Hugging Face's own loop does: model(input_ids, labels).loss."""
    x = torch.tensor(df.toArrow().column("tokens").to_pylist())
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(STEPS):
        optimizer.zero_grad()
        model(input_ids=x, labels=x).loss.backward()
        optimizer.step()
    return model


def assert_same_weights(trained: nn.Module, reference: nn.Module) -> None:
    state = trained.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, atol=2e-5, rtol=1e-5, msg=key)


@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2", "llama"])
def test_a_model_computing_its_own_loss_trains_as_hugging_faces_loop(tokens, build) -> None:  # type: ignore[no-untyped-def]
    trained = fit(tokens, build())
    reference = hugging_face_loop(tokens, build)
    assert_same_weights(trained.torch_module(), reference)
    assert not torch.allclose(reference.lm_head.weight, build().lm_head.weight)


def test_causal_lm_loss_on_logits_is_the_models_own_loss(tokens) -> None:  # type: ignore[no-untyped-def]
    trained = fit(tokens, gpt2(), loss="causal_lm")
    assert_same_weights(trained.torch_module(), hugging_face_loop(tokens, gpt2))


@pytest.mark.parametrize("options", [{"sync": "diloco", "sync_every": 2}, {"strategy": "auto"}],
                         ids=["diloco", "auto"])
def test_diloco_and_auto_train_a_transformer(tokens, options) -> None:  # type: ignore[no-untyped-def]
    trained = fit(tokens, gpt2(), epochs=6, optimizer="adamw", lr=3e-3, batch_size=4, **options)
    losses = [h["loss"] for h in trained.history]
    assert losses[-1] < losses[0] - 0.05, losses


def sentiment_rows(count: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        words = POSITIVE if i % 2 else NEGATIVE
        text = " ".join(rng.choice(words + ["the", "a", "movie", "plot"]) for _ in range(rng.randint(3, 12)))
        rows.append((text, i % 2))
    return rows


def trained_tokenizer(texts: list[str]):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=SPECIALS))
    return tokenizer


@pytest.fixture(scope="module")
def sentiment(spark):  # type: ignore[no-untyped-def]
    rows = sentiment_rows(96, seed=0)
    raw = trained_tokenizer([t for t, _ in rows])
    wrapped = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="[PAD]", unk_token="[UNK]",
                                                   eos_token="<|endoftext|>")
    return spark.createDataFrame(rows, "text string, label long").repartition(2).cache(), raw, wrapped


@pytest.mark.parametrize("given", ["object", "path"])
def test_a_sequence_classifier_trains_from_a_string_column(sentiment, tmp_path, given: str) -> None:  # type: ignore[no-untyped-def]
    df, raw, wrapped = sentiment
    if given == "path":
        raw.save(str(tmp_path / "tokenizer.json"))
        tokenizer = str(tmp_path / "tokenizer.json")
    else:
        tokenizer = wrapped
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_config(transformers.BertConfig(
        vocab_size=raw.get_vocab_size(), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, num_labels=2, max_position_embeddings=64))
    trained = TorchEstimator(model=model, input_cols=["text"], tokenizer=tokenizer, max_length=16, label_col="label",
                             num_workers=2, epochs=4, batch_size=8, lr=5e-3, strategy="data_parallel",
                             tracking=False, progress=False).fit(df)
    losses = [h["loss"] for h in trained.history]
    assert min(losses[1:]) < 0.3 < losses[0], losses  # Adam on a tiny BERT may spike an epoch: trained is enough
    scored = trained.transform(spark_rows(df, sentiment_rows(20, seed=5))).collect()
    accuracy = sum(r["prediction"] == r["label"] for r in scored) / len(scored)
    assert accuracy >= 0.85, (accuracy, losses)


def spark_rows(df, rows):  # type: ignore[no-untyped-def]
    return df.sparkSession.createDataFrame(rows, df.schema)


def test_a_causal_lm_trains_from_text_with_packing_and_generates_as_on_the_driver(sentiment, tmp_path,  # type: ignore[no-untyped-def]
                                                                                   mlflow_server) -> None:
    import mlflow.pyfunc

    df, raw, wrapped = sentiment
    model = gpt2(raw.get_vocab_size())
    trained = TorchEstimator(model=model, input_cols=["text"], tokenizer=wrapped, max_length=16, packing=True,
                             label_col=None, loss="causal_lm", num_workers=2, epochs=4, batch_size=8, lr=1e-2,
                             optimizer="adamw", strategy="data_parallel", tracking_uri=mlflow_server.uri,
                             experiment="sparkdl-text", progress=False).fit(df.select("text"))
    losses = [h["loss"] for h in trained.history]
    assert losses[-1] < losses[0], losses
    assert trained.output_kind == "text"
    prompts = ["the movie was", "a good", "bad plot"]
    frame = df.sparkSession.createDataFrame([(p,) for p in prompts], "text string")
    generating = trained.generating(max_new_tokens=5)
    generated = [r["prediction"] for r in generating.transform(frame).collect()]
    generating.save(str(tmp_path / "saved"))  # the tokenizer and the generation settings are kept
    assert [r["prediction"] for r in TorchModel.load(str(tmp_path / "saved")).transform(frame).collect()] == generated
    module = trained.torch_module().eval()
    expected = []
    for prompt in prompts:  # the driver, one prompt at a time, Hugging Face's own generate
        ids = wrapped(prompt, return_tensors="pt")
        out = module.generate(**ids, max_new_tokens=5, do_sample=False, pad_token_id=wrapped.pad_token_id,
                              eos_token_id=wrapped.eos_token_id)
        expected.append(wrapped.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
    assert generated == expected
    sampling = trained.generating(max_new_tokens=8, do_sample=True, seed=11)
    sampled = [r["prediction"] for r in sampling.transform(frame).collect()]
    assert sampled == [r["prediction"] for r in sampling.transform(frame).collect()]  # seeded: the same again
    vectors = [r["prediction"] for r in trained.embedding().transform(frame).collect()]
    assert len(vectors) == 3 and all(len(v) == 64 for v in vectors)
    assert vectors[0] != vectors[1]
    mlflow.set_tracking_uri(mlflow_server.uri)
    try:
        loaded = mlflow.pyfunc.load_model(trained.model_uri)
        local = mlflow.artifacts.download_artifacts(trained.model_uri, dst_path=str(tmp_path / "served"))
    finally:
        mlflow.set_tracking_uri(None)
    default = [r["prediction"] for r in trained.transform(frame).collect()]  # the fit's own output: text
    assert list(loaded.predict(frame.toPandas())["prediction"]) == default
    assert [row["prediction"] for row in served_answers(local, {"columns": ["text"], "data": [[p] for p in prompts]})
            ] == default  # `mlflow models serve` answers a prompt with text


def test_a_model_saved_on_shared_storage_loads_on_the_executors(tokens, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """sparkdl.pretrained(path): the ranks read the weights; the task closures carry the path only
    (the barrier job's pickled task is measured as Spark ships it)."""
    import sparkdl
    import sparkdl.driver.job as job
    from pyspark import cloudpickle

    shipped: list[int] = []
    make_task = job.make_task

    def measured(spec):  # type: ignore[no-untyped-def]
        task = make_task(spec)
        shipped.append(len(cloudpickle.dumps(task)))
        return task

    monkeypatch.setattr(job, "make_task", measured)

    saved = gpt2()
    with torch.no_grad():  # weights no fresh model has: training starts from these or fails the comparison
        for p in saved.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    saved.save_pretrained(tmp_path / "gpt2")
    weights = sum(f.stat().st_size for f in (tmp_path / "gpt2").iterdir())
    spec = sparkdl.pretrained(str(tmp_path / "gpt2"))
    assert len(cloudpickle.dumps(spec)) < 1024 < weights // 100
    trained = fit(tokens, spec)
    assert shipped and max(shipped) < weights / 2, (shipped, weights)  # the weights did not ride in the task
    reference = hugging_face_loop(tokens, lambda: transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2"))
    assert_same_weights(trained.torch_module(), reference)


def test_bf16_with_activation_checkpointing_trains_a_transformer(tokens) -> None:  # type: ignore[no-untyped-def]
    trained = fit(tokens, gpt2(), epochs=5, optimizer="adamw", lr=3e-3, batch_size=4, precision="bf16",
                  activation_checkpointing=True)
    losses = [h["loss"] for h in trained.history]
    assert all(loss == loss for loss in losses) and losses[-1] < losses[0] - 0.05, losses


def test_activation_checkpointing_is_refused_for_a_model_that_cannot_recompute(tokens) -> None:  # type: ignore[no-untyped-def]
    from sparkdl.errors import ModelError

    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed(tokens))

    with pytest.raises(ModelError, match="activation_checkpointing"):
        fit(tokens, Plain(), loss="causal_lm", activation_checkpointing=True)


def test_the_plan_prices_a_transformer_from_what_it_is(tokens) -> None:  # type: ignore[no-untyped-def]
    import sparkdl

    plan = sparkdl.plan(gpt2(), tokens, input_cols=["tokens"], label_col="labels", loss="causal_lm",
                        num_workers=2, batch_size=8, tracking=False, progress=False)
    text = plan.explain()
    assert "transformer GPT2LMHeadModel: 2 blocks x hidden 64, 2 heads, sequence 12" in text, text
    assert "MFLOP forward" in text and "activations" in text


def test_auto_plans_and_trains_a_causal_lm_from_text(sentiment) -> None:  # type: ignore[no-untyped-def]
    """strategy="auto" on a text column: the plan binds the tokenizer as fit does, and ranks keep equal
    shares (a tokenizer pads and packs each batch to its own shape, which dynamic balancing cannot move)."""
    import sparkdl

    df, raw, wrapped = sentiment
    options = dict(input_cols=["text"], tokenizer=wrapped, max_length=16, packing=True, label_col=None,
                   loss="causal_lm", num_workers=2, batch_size=8, tracking=False, progress=False)
    plan = sparkdl.plan(gpt2(raw.get_vocab_size()), df.select("text"), **options)
    assert "transformer GPT2LMHeadModel" in plan.explain()
    trained = TorchEstimator(model=gpt2(raw.get_vocab_size()), epochs=4, lr=1e-2, optimizer="adamw",
                             **options).fit(df.select("text"))
    losses = [h["loss"] for h in trained.history]
    assert min(losses[1:]) < losses[0], (losses, trained.plan.explain())
    assert dict(trained.plan.settings)["batch_balance"] == "equal" == trained.options["train.batch_balance"]
