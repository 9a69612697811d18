"""Write notebooks/*.ipynb from the cells below (outputs empty): `python scripts/make_notebooks.py`.

Kept as code so that the notebooks stay reviewable in diffs; tests/spark/test_notebooks.py executes
every notebook with nbclient (SPARKDL_NOTEBOOK_SMALL=1: tiny settings).
"""
from __future__ import annotations

from pathlib import Path

import nbformat

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"

SESSION = '''# Databricks (and any notebook with a session) defines `spark`; elsewhere start a local one.
import os
import sys

SMALL = os.environ.get("SPARKDL_NOTEBOOK_SMALL") == "1"  # the tests run every notebook on tiny settings
try:
    spark  # noqa: F821
except NameError:
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # executors run this kernel's Python
    spark = (SparkSession.builder.master("local[2]").appName("sparkdl-notebook")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
spark.sparkContext.setLogLevel("ERROR")'''

DATA = '''from sparkdl.datasets import DIGITS_FEATURE_COLS, digits_dataframe, train_test_split_digits

train_idx, test_idx = train_test_split_digits(seed=0)
train = digits_dataframe(spark, indices=train_idx).cache()
test = digits_dataframe(spark, indices=test_idx).cache()
print(f"{train.count()} training rows, {test.count()} test rows, {len(DIGITS_FEATURE_COLS)} features")'''

QUICKSTART = [
    ("markdown", "# sparkdl quickstart\n\nA Spark DataFrame in, a trained PyTorch model out: fit with the default "
                 "strategy (`auto`: the planner chooses), look at the MLflow run, score with `transform`, plot "
                 "the loss curve."),
    ("code", SESSION),
    ("code", DATA),
    ("code", '''from torch import nn

from sparkdl import TorchEstimator

def mlp():
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

estimator = TorchEstimator(model=mlp, feature_cols=DIGITS_FEATURE_COLS, label_col="label",
                           optimizer="adam", lr=3e-3, batch_size=32, epochs=2 if SMALL else 15,
                           num_workers=2, validation_fraction=0.2, seed=0, progress=not SMALL)
model = estimator.fit(train)
print("strategy:", model.options["train.strategy"])'''),
    ("markdown", "Every fit is one MLflow run: every option as a param, the plan, metrics per step and epoch, "
                 "the model."),
    ("code", '''import mlflow

run = mlflow.get_run(model.run_id) if model.run_id else None
if run is not None:
    print("MLflow run", run.info.run_id, "status", run.info.status)
    print({k: v for k, v in run.data.params.items() if k.startswith(("plan.", "train.strategy", "dataset.rows"))})
    print("model:", model.model_uri)'''),
    ("code", '''scored = model.transform(test)
rows = scored.select("label", "prediction").collect()
accuracy = sum(r["label"] == r["prediction"] for r in rows) / len(rows)
print(f"test accuracy {accuracy:.3f}")
assert accuracy > (0.5 if SMALL else 0.9)'''),
    ("code", '''import matplotlib

matplotlib.use("Agg") if SMALL else None
import matplotlib.pyplot as plt

epochs = [h["epoch"] + 1 for h in model.history]
plt.plot(epochs, [h["loss"] for h in model.history], marker="o", label="training loss")
plt.plot(epochs, [h["val_loss"] for h in model.history], marker="o", label="validation loss")
plt.xlabel("epoch"); plt.ylabel("cross-entropy"); plt.legend(); plt.title("digits MLP, 2 workers")
plt.show()'''),
    ("markdown", "Training essentials: a warm-up + cosine lr schedule, validation metrics reduced exactly across "
                 "ranks, early stopping, and a live callback. The callback runs here, on the driver, with every "
                 "epoch record as it arrives (plot or print while training runs); returning `'stop'` ends the "
                 "fit after that epoch on every worker."),
    ("code", '''def watch(record):
    print(f"epoch {record['epoch']}: val_loss {record['val_loss']:.3f}, "
          f"val_top_3_accuracy {record['val_top_3_accuracy']:.3f}, lr {record['lr']:.2e}")
    return "stop" if record["val_accuracy"] >= 0.99 else None

tuned = TorchEstimator(model=mlp, feature_cols=DIGITS_FEATURE_COLS, label_col="label", optimizer="adam",
                       lr=3e-3, lr_schedule="cosine", warmup_steps=20, batch_size=32, epochs=2 if SMALL else 15,
                       num_workers=2, validation_fraction=0.2, metrics=["accuracy", "top_3_accuracy"],
                       early_stopping={"metric": "val_loss", "patience": 3}, callbacks=[watch], seed=0,
                       progress=False).fit(train)
print("stopped by:", tuned.history[-1].get("stopped_by", "-"), "after", len(tuned.history), "epochs")
assert all("val_top_3_accuracy" in h for h in tuned.history)'''),
]

PLANNER = [
    ("markdown", "# The planner: which layout, and why\n\n`sparkdl.plan` profiles the model, measures the "
                 "cluster once and prices data parallel, DiLoCo, hybrid and IST. Here across model widths and "
                 "emulated network bandwidths (`emulate_network`), without training."),
    ("code", SESSION),
    ("code", DATA),
    ("code", '''from torch import nn

import sparkdl

def mlp(width):
    return lambda: nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                 nn.Linear(width, 10))

widths = [256, 1024] if SMALL else [128, 512, 1024, 2048]
networks = {"10 Gbit/s": (10.0, 0.05), "10 Mbit/s": (0.01, 2.0)} if SMALL else \\
    {"10 Gbit/s": (10.0, 0.05), "1 Gbit/s": (1.0, 0.2), "100 Mbit/s": (0.1, 0.5), "10 Mbit/s": (0.01, 2.0)}
plans = {}
for width in widths:
    for name, (gbps, latency) in networks.items():
        plans[width, name] = sparkdl.plan(mlp(width), train, feature_cols=DIGITS_FEATURE_COLS, label_col="label",
                                          batch_size=64, num_workers=2, epochs=10,
                                          emulate_network={"latency_ms": latency, "gbps": gbps})
for (width, name), plan in plans.items():
    print(f"width {width:5d}, {name:>10}: {plan.choice.label:35s} {plan.choice.predicted_step_s * 1e3:8.2f} ms/step")'''),
    ("code", '''print(plans[widths[-1], list(networks)[-1]].explain())'''),
    ("code", '''import matplotlib

matplotlib.use("Agg") if SMALL else None
import matplotlib.pyplot as plt

fig, axes = plt.subplots(1, len(networks), figsize=(5 * len(networks), 4), sharey=False)
for ax, name in zip(axes, networks):
    for strategy in ("data_parallel", "diloco", "hybrid", "ist"):
        best = [min((c.predicted_step_s * 1e3 for c in plans[w, name].candidates
                     if c.strategy == strategy and c.feasible), default=float("nan")) for w in widths]
        ax.plot(widths, best, marker="o", label=strategy)
    ax.set_xscale("log"); ax.set_yscale("log"); ax.set_title(name); ax.set_xlabel("hidden width")
axes[0].set_ylabel("predicted step (ms)"); axes[0].legend()
plt.show()'''),
]


def strategy_notebook(title: str, intro: str, options: str, report: str) -> list[tuple[str, str]]:
    return [
        ("markdown", f"# {title}\n\n{intro}"),
        ("code", SESSION),
        ("code", DATA),
        ("code", f'''from torch import nn

from sparkdl import TorchEstimator

common = dict(feature_cols=DIGITS_FEATURE_COLS, label_col="label", batch_size=32, epochs=2 if SMALL else 8,
              num_workers=2, validation_fraction=0.2, seed=0, progress=False, tracking=False)
{options}'''),
        ("code", report),
    ]


HYBRID = strategy_notebook(
    "Hybrid: pipeline stages x data-parallel replicas",
    "The model is cut into stages by measured layer time; each replica's micro-batches flow through the "
    "stages (1F1B); the result equals data parallel's update.",
    '''deep = lambda: nn.Sequential(nn.Linear(64, 128), nn.ReLU(), *[nn.Sequential(nn.Linear(128, 128), nn.ReLU())
                                                            for _ in range(4)], nn.Linear(128, 10))
hybrid = TorchEstimator(model=deep, strategy="hybrid", stages=2, microbatches=8, optimizer="adam", lr=2e-3,
                        **common).fit(train)
dp = TorchEstimator(model=deep, strategy="data_parallel", optimizer="adam", lr=2e-3, **common).fit(train)''',
    '''for name, m in (("hybrid", hybrid), ("data parallel", dp)):
    last = m.history[-1]
    print(f"{name:14s} val accuracy {last['val_accuracy']:.3f}  parameters per rank "
          f"{last['max_param_bytes_per_rank'] / 1e3:.0f} kB")
assert hybrid.history[-1]["max_param_bytes_per_rank"] < dp.history[-1]["max_param_bytes_per_rank"]''')

IST = strategy_notebook(
    "IST: independent subnet training",
    "Each worker trains a disjoint 1/W of every hidden layer for `ist_sync_every` steps; far fewer bytes "
    "than data parallel for wide MLPs.",
    '''wide = lambda: nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
ist = TorchEstimator(model=wide, strategy="ist", ist_sync_every=30, optimizer="adam", lr=2e-3, **common).fit(train)
dp = TorchEstimator(model=wide, strategy="data_parallel", optimizer="adam", lr=2e-3, **common).fit(train)''',
    '''for name, m in (("IST", ist), ("data parallel", dp)):
    sent = sum(h["bytes_sent_all_ranks"] for h in m.history)
    print(f"{name:14s} val accuracy {m.history[-1]['val_accuracy']:.3f}  sent {sent / 1e6:8.1f} MB")
assert sum(h["bytes_sent_all_ranks"] for h in ist.history) < sum(h["bytes_sent_all_ranks"] for h in dp.history) / 10''')

DILOCO = strategy_notebook(
    "DiLoCo: synchronise every H steps",
    "Each worker takes H inner steps alone, then an outer Nesterov step applies the averaged change: one "
    "allreduce every H steps instead of every step.",
    '''mlp = lambda: nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
diloco = TorchEstimator(model=mlp, sync="diloco", sync_every=20, optimizer="adamw", lr=2e-3, **common).fit(train)
dp = TorchEstimator(model=mlp, strategy="data_parallel", optimizer="adamw", lr=2e-3, **common).fit(train)''',
    '''for name, m in (("DiLoCo H=20", diloco), ("data parallel", dp)):
    sent = sum(h["bytes_sent_all_ranks"] for h in m.history)
    print(f"{name:14s} val accuracy {m.history[-1]['val_accuracy']:.3f}  sent {sent / 1e6:8.2f} MB")
assert sum(h["bytes_sent_all_ranks"] for h in diloco.history) < sum(h["bytes_sent_all_ranks"] for h in dp.history) / 5''')


CNN_IMAGES = [
    ("markdown", "# Images in a DataFrame: a CNN on PNG bytes\n\nThe 8x8 digits as a binary `png` column, decoded "
                 "on the executors batch by batch with `transform_fn`, and as an array<float> `pixels` column "
                 "reshaped per row with `input_shapes`. Either way the CNN sees float32 (B, 1, 8, 8) batches."),
    ("code", SESSION),
    ("code", '''from sparkdl.datasets import decode_digit_png, digits_images_dataframe, train_test_split_digits

train_idx, test_idx = train_test_split_digits(seed=0)
train = digits_images_dataframe(spark, indices=train_idx).cache()
test = digits_images_dataframe(spark, indices=test_idx).cache()
train.printSchema()
print(f"{train.count()} training images, {test.count()} test images; one PNG is {len(train.first()['png'])} bytes")'''),
    ("markdown", "`decode_digit_png` is a module-level function of an importable module, so it pickles by "
                 "reference; it gets the input columns of a batch (binary as a list of bytes) and returns the "
                 "model inputs under the same names."),
    ("code", '''from torch import nn

from sparkdl import TorchEstimator

def cnn():
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))

common = dict(model=cnn, label_col="label", optimizer="adam", lr=3e-3, batch_size=32, epochs=2 if SMALL else 8,
              num_workers=2, validation_fraction=0.2, seed=0, progress=False, tracking=False)
from_png = TorchEstimator(input_cols=["png"], transform_fn=decode_digit_png, **common).fit(train)
from_pixels = TorchEstimator(input_cols=["pixels"], input_shapes={"pixels": [1, 8, 8]}, **common).fit(train)'''),
    ("code", '''accuracy = {}
for name, m in (("png + transform_fn", from_png), ("pixels + input_shapes", from_pixels)):
    rows = m.transform(test).select("label", "prediction").collect()
    accuracy[name] = sum(r["label"] == r["prediction"] for r in rows) / len(rows)
    print(f"{name:22s} val accuracy {m.history[-1]['val_accuracy']:.3f}  test accuracy {accuracy[name]:.3f}")
assert min(accuracy.values()) > (0.5 if SMALL else 0.9)'''),
    ("code", '''import matplotlib

matplotlib.use("Agg") if SMALL else None
import matplotlib.pyplot as plt

sample = from_png.transform(test.limit(8)).select("png", "label", "prediction").collect()
images = decode_digit_png({"png": [r["png"] for r in sample]})["png"]
fig, axes = plt.subplots(1, len(sample), figsize=(2 * len(sample), 2.4))
for ax, image, r in zip(axes, images, sample):
    ax.imshow(image[0], cmap="gray_r"); ax.axis("off"); ax.set_title(f"{r['label']} -> {r['prediction']}")
plt.show()'''),
]

LANGUAGE_MODEL = [
    ("markdown", "# A small GPT on token columns\n\nByte-level windows of the Python standard library's own "
                 "sources as array<int> `tokens` and `targets` (shifted by one). The model maps (B, T) int64 "
                 "ids to (B, T, 256) logits; the built-in `cross_entropy` scores every position. Trained data "
                 "parallel and with DiLoCo; perplexity = exp(validation loss)."),
    ("code", SESSION),
    ("code", '''from sparkdl.datasets import text_tokens_dataframe

SEQ_LEN = 64
tokens = text_tokens_dataframe(spark, seq_len=SEQ_LEN, max_rows=512 if SMALL else 4096)
train, test = tokens.randomSplit([0.9, 0.1], seed=0)
train = train.cache()
print(train.count(), "training windows; one of them:")
print(bytes(train.first()["tokens"]).decode("utf-8", "replace"))'''),
    ("markdown", 'The GPT is an `nn.Sequential` whose top-level layers each take and return one tensor '
                 '(`strategy="hybrid"` could cut it between blocks).'),
    ("code", '''import torch
import torch.nn.functional as F
from torch import nn

class Embed(nn.Module):  # (B, T) int64 -> (B, T, d)
    def __init__(self, d, seq_len):
        super().__init__()
        self.token, self.position = nn.Embedding(256, d), nn.Embedding(seq_len, d)

    def forward(self, ids):
        return self.token(ids) + self.position.weight[: ids.shape[1]]

class Block(nn.Module):  # pre-LN causal self-attention + MLP
    def __init__(self, d, heads=4):
        super().__init__()
        self.heads, self.ln1, self.ln2 = heads, nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(self.ln1(x)).chunk(3, dim=-1))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))

def gpt(d=64, layers=2):
    head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 256))  # -> (B, T, 256) logits
    return nn.Sequential(Embed(d, SEQ_LEN), *[Block(d) for _ in range(layers)], head)'''),
    ("code", '''import math

from sparkdl import TorchEstimator

common = dict(model=gpt, input_cols=["tokens"], label_col="targets", loss="cross_entropy", optimizer="adamw",
              lr=3e-3, batch_size=32, epochs=1 if SMALL else 4, num_workers=2, validation_fraction=0.1, seed=0,
              progress=False, tracking=False)
dp = TorchEstimator(strategy="data_parallel", **common).fit(train)
diloco = TorchEstimator(strategy="data_parallel", sync="diloco", sync_every=10, **common).fit(train)
for name, m in (("data parallel", dp), ("DiLoCo H=10", diloco)):
    sent = sum(h["bytes_sent_all_ranks"] for h in m.history)
    print(f"{name:14s} validation perplexity {math.exp(m.history[-1]['val_loss']):7.2f}  sent {sent / 1e6:7.2f} MB")
assert math.exp(dp.history[-1]["val_loss"]) < 256, "better than a uniform guess over bytes"'''),
    ("markdown", "`transform` predicts the next byte at every position (array<long>); the trained module "
                 "also generates text greedily."),
    ("code", '''rows = dp.transform(test).select("targets", "prediction").collect()
hits = sum(p == t for r in rows for p, t in zip(r["prediction"], r["targets"]))
print(f"test next-byte accuracy {hits / sum(len(r['targets']) for r in rows):.3f}")

module = dp.torch_module().eval()
ids = list(b"def ")
with torch.no_grad():
    for _ in range(48):
        ids.append(int(module(torch.tensor([ids[-SEQ_LEN:]]))[0, -1].argmax()))
print(bytes(ids).decode("utf-8", "replace"))'''),
]

RECOMMENDER = [
    ("markdown", "# A click-through model: categorical columns, embedding tables sharded over the workers\n\n"
                 "User ids, item names and weighted tag lists (`sparse_cols`) beside two dense features; "
                 "sparkdl's DLRM looks each column up in its embedding table. The tables live sharded over the "
                 "workers (or replicated, when the planner finds that cheaper: `explain()` says), the dense "
                 "layers train data parallel. docs/recommenders.md has the details."),
    ("code", SESSION),
    ("code", '''import numpy as np

rng = np.random.default_rng(0)
rows = []
for _ in range(2000 if SMALL else 20000):  # every 4th item popular, every 3rd user keen, tag 7 helps
    user, item = int(rng.integers(0, 150)), int(rng.integers(0, 60))
    tags = [int(t) for t in rng.integers(0, 20, size=int(rng.integers(0, 4)))]
    x0, x1 = float(rng.normal()), float(rng.normal())
    logit = 2.5 * (item % 4 == 0) + 1.5 * (user % 3 == 0) + 1.5 * (7 in tags) + 0.8 * x0 - 2.0
    rows.append((x0, x1, user, f"item-{item}", tags, [1.0] * len(tags), int(rng.random() < 1 / (1 + np.exp(-logit)))))
clicks = spark.createDataFrame(rows, "f0 double, f1 double, user bigint, item string, tags array<int>, "
                                     "tag_w array<double>, clicked int").cache()
clicks.show(3)'''),
    ("markdown", "The model is a factory: every process builds it with deferred tables and keeps only its rows. "
                 "`features` binds the columns to the tables; strings (and ids beyond a table) are hashed onto "
                 "its rows by Spark's xxhash64, the same way when MLflow serves the model."),
    ("code", '''import sparkdl
from sparkdl import TorchEstimator
from sparkdl.embeddings import DLRM, TableSpec

tables = [TableSpec("users", 200, 8), TableSpec("items", 64, 8), TableSpec("tags", 32, 8)]

def dlrm():
    return DLRM(2, tables, bottom=[16, 8], top=[16], features={"user": "users", "item": "items", "tags": "tags"})

options = dict(feature_cols=["f0", "f1"], label_col="clicked", loss="bce_with_logits",
               sparse_cols={"user": {"table": "users", "num_rows": 200}, "item": {"table": "items", "num_rows": 64},
                            "tags": {"num_rows": 32, "weights_col": "tag_w"}},
               embedding_lr=0.1, lr=0.01, batch_size=64, epochs=3 if SMALL else 8, num_workers=2,
               validation_fraction=0.2, metrics=["auc"], progress=False, tracking=False)
print(sparkdl.plan(dlrm, clicks, **options).explain())'''),
    ("code", '''model = TorchEstimator(model=dlrm, **options).fit(clicks)
for h in model.history:
    print(f"epoch {h['epoch']}: loss {h['loss']:.4f}  val AUC {h['val_auc']:.3f}  "
          f"embedding bytes/step {sum(h['embedding_bytes_per_step'].values())}")
assert model.history[-1]["val_auc"] > 0.6
model.transform(clicks.limit(5)).select("user", "item", "tags", "probability", "prediction").show(truncate=False)'''),
]

TRANSFORMERS = [
    ("markdown", "# Hugging Face models, LoRA and text columns\n\n"
                 "Fine-tune a language model on text in a DataFrame, adapt it with a LoRA adapter, train a "
                 "sequence classifier on a string column, and point sparkdl at pretrained weights on shared "
                 "storage. Models come from configs and the tokenizer is trained here on the data with the "
                 "`tokenizers` package: nothing is downloaded. docs/transformers.md has the details."),
    ("code", SESSION),
    ("code", '''import random

GOOD = ["good", "great", "fine", "lovely", "superb", "charming"]
BAD = ["bad", "awful", "dull", "poor", "sad", "boring"]
rng = random.Random(0)
rows = []
for i in range(400 if SMALL else 2000):  # short reviews: the label says which words they use
    words = GOOD if i % 2 else BAD
    noun, verb = rng.choice(["film", "book", "song", "meal", "play", "show"]), rng.choice(["was", "seemed", "felt"])
    rows.append((f"the {noun} {verb} {rng.choice(words)} and {rng.choice(words)} .", i % 2))
reviews = spark.createDataFrame(rows, "text string, label long")
train, test = reviews.randomSplit([0.8, 0.2], seed=0)
train = train.cache()
train.show(3, truncate=False)'''),
    ("markdown", "A byte-level BPE tokenizer (GPT-2's kind) trained on the text column. On a large table, train "
                 "it on a sample (`.sample(0.01).collect()`); the tokenizer itself travels to the executors, "
                 "which tokenize each batch: there is no tokenizing pass through Spark first."),
    ("code", '''from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

texts = [r["text"] for r in train.select("text").collect()]
bpe = Tokenizer(models.BPE(unk_token="[UNK]"))
bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=100, special_tokens=["[PAD]", "[UNK]", "<|endoftext|>"]))
tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="[PAD]", eos_token="<|endoftext|>")
print(len(tokenizer), "tokens;", tokenizer.tokenize(texts[0]))'''),
    ("markdown", "## Fine-tune a language model on text in a DataFrame\n\n"
                 "A GPT-2 built from a config. `packing=True` joins each batch's texts (each ended by the "
                 "end-of-text token) into blocks of `max_length` tokens; with `label_col=None` the labels are "
                 "the texts' own tokens and `loss=\"causal_lm\"` shifts them (Hugging Face's causal LM loss)."),
    ("code", '''import torch
from transformers import GPT2Config, GPT2LMHeadModel

from sparkdl import TorchEstimator

def gpt2():
    torch.manual_seed(0)
    eos = tokenizer.eos_token_id
    return GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_layer=2, n_embd=64, n_head=2, n_positions=64,
                                      bos_token_id=eos, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id))

common = dict(input_cols=["text"], tokenizer=tokenizer, max_length=32, num_workers=2, batch_size=16,
              optimizer="adamw", strategy="data_parallel", seed=0, progress=False, tracking=False)
lm = TorchEstimator(model=gpt2(), packing=True, label_col=None, loss="causal_lm", lr=1e-2,
                    epochs=3 if SMALL else 8, **common).fit(train.select("text"))
print("loss per epoch:", [round(h["loss"], 3) for h in lm.history])
assert lm.history[-1]["loss"] < lm.history[0]["loss"]'''),
    ("markdown", "`transform` on a DataFrame of prompts writes each prompt continued, generated batch by batch on "
                 "the executors (their GPU when they have one): greedy, or sampled under a seed. `embedding()` "
                 "writes mean-pooled hidden states instead."),
    ("code", '''prompts = spark.createDataFrame([("the film was",), ("the meal seemed",), ("the show",)], "text string")
lm.generating(max_new_tokens=8).transform(prompts).show(truncate=False)
lm.generating(max_new_tokens=8, do_sample=True, top_p=0.9, seed=7).transform(prompts).show(truncate=False)
vectors = lm.embedding().transform(prompts).collect()
print(len(vectors[0]["prediction"]), "numbers per prompt")'''),
    ("markdown", "## LoRA: adapt the model with a few parameters\n\n"
                 "The language model above stands in for a pretrained base: a LoRA adapter (`peft`) teaches it "
                 "to write only good reviews. Only the adapter trains, so only its bytes are averaged between "
                 "the workers, checkpointed and sent back."),
    ("code", '''import copy

from peft import LoraConfig, get_peft_model

base = lm.torch_module()
lora = get_peft_model(copy.deepcopy(base), LoraConfig(r=8, target_modules=["c_attn", "c_proj", "c_fc"],
                                                      fan_in_fan_out=True))  # GPT-2's layers are Conv1D
lora.print_trainable_parameters()
good = train.where("label = 1").select("text")
tuned = TorchEstimator(model=lora, packing=True, label_col=None, loss="causal_lm", lr=3e-3,
                       epochs=2 if SMALL else 4, **common).fit(good)
print("loss per epoch:", [round(h["loss"], 3) for h in tuned.history])
per_step = {name: m.history[-1]["bytes_sent_all_ranks"] / max(1, m.history[-1]["steps"])
            for name, m in (("full model", lm), ("LoRA", tuned))}
print({name: f"{b / 1e3:.0f} kB per step" for name, b in per_step.items()})
tuned.generating(max_new_tokens=8).transform(prompts).show(truncate=False)
assert per_step["LoRA"] < per_step["full model"] / 4'''),
    ("markdown", "The adapter in PEFT's own layout loads back with `peft` alone; `merged()` folds it into the "
                 "base for scoring without peft."),
    ("code", '''import os

from peft import PeftModel

files = tuned.save_adapter(os.path.abspath("adapters/good-reviews"))
print([os.path.basename(f) for f in files])
loaded = PeftModel.from_pretrained(copy.deepcopy(base), "adapters/good-reviews")
ids = tokenizer("the film was", return_tensors="pt")["input_ids"]
with torch.no_grad():
    same = torch.allclose(loaded(ids).logits, tuned.torch_module()(ids).logits, atol=1e-5)
print("peft alone gives the same logits:", same)
assert same
merged = tuned.merged()  # a TorchModel of the plain GPT-2 with the adapter folded in'''),
    ("markdown", "## A sequence classifier on a text column\n\n"
                 "A BERT-style `AutoModelForSequenceClassification` from a config, the string column and a label; "
                 "the tokenizer pads each batch to its longest row."),
    ("code", '''from transformers import AutoModelForSequenceClassification, BertConfig

torch.manual_seed(0)
bert = AutoModelForSequenceClassification.from_config(BertConfig(
    vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
    max_position_embeddings=64, num_labels=2))
classifier = TorchEstimator(model=bert, label_col="label", lr=3e-3, epochs=4 if SMALL else 6, **common).fit(train)
scored = classifier.transform(test).collect()  # "prediction": the class
accuracy = sum(r["prediction"] == r["label"] for r in scored) / len(scored)
print(f"held-out accuracy {accuracy:.3f}")
assert accuracy > 0.8'''),
    ("markdown", "## Pretrained weights on shared storage\n\n"
                 "A model saved with `save_pretrained` to a directory every executor can read (a Databricks "
                 "Volume, DBFS, NFS; here a local directory) is named by its path: each worker loads the "
                 "weights itself, and the task closures carry the path only, however large the model. The "
                 "tokenizer can be the same directory."),
    ("code", '''from pyspark import cloudpickle

import sparkdl

path = os.path.abspath("models/gpt2-reviews")  # on a cluster: e.g. /Volumes/main/models/gpt2-reviews
base.save_pretrained(path)
tokenizer.save_pretrained(path)
model = sparkdl.pretrained(path, task="causal_lm")
weights = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
print(f"weights and tokenizer on disk {weights / 1e3:.0f} kB; the tasks carry {len(cloudpickle.dumps(model))} bytes")
more = TorchEstimator(model=model, packing=True, label_col=None, loss="causal_lm", lr=3e-3, epochs=1,
                      **{**common, "tokenizer": path}).fit(train.select("text"))
print("loss:", round(more.history[-1]["loss"], 3))
# A LoRA adapter on top of the weights each worker loads: the driver reads the frozen base once, for the result.
adapted = sparkdl.pretrained(path, adapter=LoraConfig(r=8, target_modules=["c_attn"], fan_in_fan_out=True))'''),
]


def write(name: str, cells: list[tuple[str, str]]) -> None:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_markdown_cell(text) if kind == "markdown" else nbformat.v4.new_code_cell(text)
                      for kind, text in cells]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    NOTEBOOKS.mkdir(exist_ok=True)
    nbformat.write(notebook, NOTEBOOKS / name)


if __name__ == "__main__":
    for filename, cells in (("quickstart.ipynb", QUICKSTART), ("planner.ipynb", PLANNER), ("hybrid.ipynb", HYBRID),
                            ("ist.ipynb", IST), ("diloco.ipynb", DILOCO), ("cnn_images.ipynb", CNN_IMAGES),
                            ("language_model.ipynb", LANGUAGE_MODEL), ("recommender.ipynb", RECOMMENDER),
                            ("transformers.ipynb", TRANSFORMERS)):
        write(filename, cells)
        print("wrote", NOTEBOOKS / filename)
