"""Fine-tune Hugging Face models on text in a DataFrame (nothing downloaded).

    python examples/fine_tune_text.py [--master local[2]] [--task lm|lora|classify|pretrained] [--epochs 8]

A word-level tokenizer is trained here with `tokenizers` on the text column; models come from configs. lm: a
GPT-2 on the text (packing=True, loss="causal_lm"), then generating() continues prompts on the executors.
lora: the same under a peft LoRA adapter (only adapter bytes travel), saved in PEFT's layout, loaded back with
peft alone. classify: a BERT-style classifier on the string column and a label. pretrained: a model and its
tokenizer saved to a directory (shared storage on a cluster) each executor loads itself; only the path travels.
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from pyspark.sql import SparkSession
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import (AutoModelForSequenceClassification, BertConfig, GPT2Config, GPT2LMHeadModel,
                          PreTrainedTokenizerFast)

import sparkdl
from sparkdl import TorchEstimator

ADJECTIVES = (["bad", "awful", "dull", "poor", "sad"], ["good", "great", "fine", "lovely", "superb"])  # label 0, 1
NOUNS, VERBS = ["cat", "dog", "film", "song", "meal", "book"], ["was", "seemed", "felt", "looked"]
PROMPTS = ["the dog was", "the film seemed", "the meal"]


def sentences(count: int, seed: int = 0) -> list[tuple[str, int]]:
    """("the dog was great and lovely .", 1): the label says which words; a grammar a tiny model learns."""
    rng = random.Random(seed)
    return [(f"the {rng.choice(NOUNS)} {rng.choice(VERBS)} {rng.choice(ADJECTIVES[i % 2])} and "
             f"{rng.choice(ADJECTIVES[i % 2])} .", i % 2) for i in range(count)]


def word_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """A vocabulary of the column's words, trained here with `tokenizers` (BPE works alike)."""
    raw = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "<|endoftext|>"]))
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="[PAD]", eos_token="<|endoftext|>")


def gpt2(tokenizer: PreTrainedTokenizerFast) -> GPT2LMHeadModel:
    torch.manual_seed(0)  # the same base weights each time (the LoRA check builds the base again)
    eos = tokenizer.eos_token_id  # GPT-2 begins and ends texts with one token
    return GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_layer=2, n_embd=64, n_head=2, n_positions=64,
                                      bos_token_id=eos, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--task", choices=("lm", "lora", "classify", "pretrained"), default="lm")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--rows", type=int, default=400)
    args = parser.parse_args(argv)
    spark = SparkSession.builder.master(args.master).getOrCreate()
    train, test = spark.createDataFrame(sentences(args.rows), "text string, label long").randomSplit([0.8, 0.2], seed=0)
    tokenizer = word_tokenizer([r["text"] for r in train.select("text").collect()])  # big tables: .limit(n) first
    common = dict(input_cols=["text"], max_length=32, num_workers=2, batch_size=16, epochs=args.epochs,
                  optimizer="adamw", strategy="data_parallel", seed=0, tracking=False, progress=False)
    result: dict = {"task": args.task}
    if args.task == "classify":
        bert = AutoModelForSequenceClassification.from_config(BertConfig(
            vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=64, num_labels=2))
        model = TorchEstimator(model=bert, tokenizer=tokenizer, label_col="label", lr=3e-3, **common).fit(train)
        scored = model.transform(test).collect()  # "prediction": the class
        result["accuracy"] = sum(r["prediction"] == r["label"] for r in scored) / len(scored)
    else:
        net, saved = gpt2(tokenizer), tempfile.mkdtemp()
        if args.task == "lora":  # GPT-2's layers are Conv1D: weights stored (in, out)
            net = get_peft_model(net, LoraConfig(r=8, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True))
        if args.task == "pretrained":  # on a cluster: a Volume, DBFS, NFS... (the same path on every executor)
            net.save_pretrained(saved), tokenizer.save_pretrained(saved)
            net, tokenizer = sparkdl.pretrained(saved, task="causal_lm"), saved  # the executors read both
        model = TorchEstimator(model=net, tokenizer=tokenizer, packing=True, label_col=None, loss="causal_lm",
                               lr=1e-2, **common).fit(train.select("text"))
        prompts = spark.createDataFrame([(p,) for p in PROMPTS], "text string")
        generated = model.generating(max_new_tokens=6).transform(prompts).collect()  # greedy, on the executors
        result["generated"] = {r["text"]: r["prediction"] for r in generated}
        if args.task == "lora":
            result["adapter_files"] = model.save_adapter(saved)  # adapter_config.json, adapter_model.safetensors
            loaded = PeftModel.from_pretrained(gpt2(tokenizer), saved)  # peft alone, on the same base
            ids = tokenizer(PROMPTS[0], return_tensors="pt")["input_ids"]
            result["adapter_logit_diff"] = float((loaded(ids).logits - model.torch_module()(ids).logits).abs().max())
    result["losses"] = [h["loss"] for h in model.history]
    result["bytes_sent"] = int(sum(h.get("bytes_sent_all_ranks", 0) for h in model.history))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
