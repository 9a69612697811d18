"""What both sides of benchmarks/llm_finetune.py share: the corpus, the tokenizer trained on it, the
model, the Hugging Face `Trainer` run under PySpark's TorchDistributor and the sparkdl fit.

The corpus is a made-up language (a Markov chain over invented words: an LM can learn it, so the
loss curve means something) whose every text is exactly `block - 1` tokens under the tokenizer
trained on it. With the end-of-text token each text is one block, so sparkdl's per-batch packing
(`packing=True`) and the Trainer's usual `group_texts` (the whole corpus joined and cut into blocks)
give the same blocks, with no padding: both sides see the same tokens, blocks and steps.

Nothing is downloaded: the tokenizer is trained here (`tokenizers`), the model built from a config.
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

EOS, PAD, UNK = "<|endoftext|>", "[PAD]", "[UNK]"
SYLLABLES = ["ka", "lo", "mi", "ne", "tu", "ra", "si", "po", "de", "gu", "ve", "zo", "ba", "fi", "ha", "ju"]


# -- the corpus and its tokenizer ------------------------------------------------------------------
def invented_words(count: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    words: set[str] = set()
    while len(words) < count:
        words.add("".join(rng.choice(SYLLABLES, size=int(rng.integers(1, 4)))))
    return sorted(words)


class Language:
    """A first-order Markov chain over invented words: each word has a few likely successors."""

    def __init__(self, words: int, seed: int) -> None:
        self.words = invented_words(words, seed)
        rng = np.random.default_rng(seed + 1)
        n = len(self.words)
        self.successors = rng.integers(0, n, size=(n, 4))
        self.weights = np.array([0.55, 0.25, 0.12, 0.08])

    def walk(self, rng: np.random.Generator, length: int) -> list[int]:
        word = int(rng.integers(0, len(self.words)))
        out = [word]
        for _ in range(length - 1):
            word = int(self.successors[word, rng.choice(4, p=self.weights)])
            out.append(word)
        return out


def train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    """A byte-level BPE trained on the texts, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token=UNK))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    raw.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, UNK, EOS]))
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token=PAD, eos_token=EOS, unk_token=UNK)


def exact_texts(language: Language, tokenizer: Any, count: int, tokens: int, seed: int) -> list[str]:
    """`count` texts of exactly `tokens` tokens each: a walk is cut where the next word would pass
    the length, then ended with words that fill it exactly (their lengths add up: the byte-level
    pre-tokenizer encodes each word alone); each text is checked by tokenizing it whole."""
    size = {w: len(tokenizer(" " + w, add_special_tokens=False)["input_ids"]) for w in language.words}
    fillers = sorted(language.words, key=lambda w: size[w])
    rng = np.random.default_rng(seed)
    out: list[str] = []
    while len(out) < count:
        chosen, used = [], 0
        for index in language.walk(rng, tokens):
            word = language.words[index]
            if used + size[word] > tokens:
                break
            chosen.append(word)
            used += size[word]
        while used < tokens:
            word = next((w for w in reversed(fillers) if size[w] <= tokens - used), None)
            if word is None:
                break
            chosen.append(word)
            used += size[word]
        text = " ".join(chosen)
        if len(tokenizer(text, add_special_tokens=False)["input_ids"]) == tokens:
            out.append(text)
    return out


def make_corpus(opts: dict[str, Any]) -> tuple[Any, list[str], list[str]]:
    """(tokenizer, training texts, held-out texts): each text one block with its end-of-text token."""
    language = Language(opts["words"], opts["seed"])
    rng = np.random.default_rng(opts["seed"] + 2)
    sample = [" ".join(language.words[i] for i in language.walk(rng, 60)) for _ in range(2000)]
    tokenizer = train_tokenizer(sample, opts["vocab"])
    texts = exact_texts(language, tokenizer, opts["rows"] + opts["held_out"], opts["block"] - 1, opts["seed"] + 3)
    return tokenizer, texts[: opts["rows"]], texts[opts["rows"]:]


def check_one_block_each(tokenizer: Any, texts: list[str], block: int) -> None:
    """sparkdl's own packing of a batch of these texts gives one full block per text (no padding)."""
    from sparkdl.data.text import Tokenization

    packed = Tokenization(tokenizer, ("text",), ("input_ids",), max_length=block, packing=True)({"text": texts})
    if packed["text"].shape != (len(texts), block) or not packed["attention_mask"].all():
        raise RuntimeError(f"the texts do not pack one block each: {packed['text'].shape}")


def blocks(tokenizer: Any, texts: list[str]) -> np.ndarray:
    """group_texts (Hugging Face's run_clm): the texts joined, each ended by EOS, cut into blocks;
    here every text is one block already."""
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return np.array([row + [tokenizer.eos_token_id] for row in ids], dtype=np.int64)


# -- the model --------------------------------------------------------------------------------
def build_model(opts: dict[str, Any], vocab: int, lora: bool) -> Any:
    """A GPT-2 from a config under the run's seed (the same initial weights on every side); with
    `lora`, a peft LoRA on it (base frozen)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(opts["seed"])
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=opts["block"], n_embd=opts["n_embd"],
                                       n_layer=opts["layers"], n_head=opts["heads"], bos_token_id=2, eos_token_id=2))
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=opts["lora_r"], lora_alpha=2 * opts["lora_r"], lora_dropout=0.0,
                                                 target_modules=opts["lora_targets"].split(",")))
    return model


# -- the Hugging Face Trainer under TorchDistributor ---------------------------------------------
def ask(directory: str, request: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    """The bed's controller answers `request` (benchmarks/recsys_bed_driver.ask)."""
    path = Path(directory) / f"{time.time_ns()}-{socket.gethostname()}-{os.getpid()}.json"
    path.with_suffix(".part").write_text(json.dumps(request))
    path.with_suffix(".part").replace(path)
    done, deadline = path.with_suffix(".done"), time.monotonic() + timeout
    while not done.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the controller did not answer {request}")
        time.sleep(0.02)
    return json.loads(done.read_text())


def held_out_loss(model: Any, held: np.ndarray, batch: int) -> float:
    """Mean next-token loss over the held-out blocks (every block full: the token mean)."""
    import torch

    model.eval()
    losses = []
    with torch.no_grad():
        for start in range(0, len(held), batch):
            ids = torch.from_numpy(held[start:start + batch])
            losses.append(float(model(input_ids=ids, labels=ids).loss) * len(ids))
    model.train()
    return sum(losses) / len(held)


def trainer_train(opts: dict[str, Any], texts_path: str, tokenizer_dir: str, out_dir: str) -> Any:
    """TorchDistributor's train function, as Databricks documents it: each process tokenizes the
    rows, groups them into blocks and runs transformers.Trainer (DDP over gloo from torchrun's
    environment). Rank 0 returns its step clock, its logged losses, the held-out loss at the end and
    (on the bed) the worker hosts' link counters at the first timed step and the last."""
    import torch
    from transformers import AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

    fn_started_at = time.time()
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    data = json.loads(Path(texts_path).read_text())
    train, held = blocks(tokenizer, data["train"]), blocks(tokenizer, data["held"])
    rows = [{"input_ids": torch.from_numpy(r), "attention_mask": torch.ones_like(torch.from_numpy(r)),
             "labels": torch.from_numpy(r)} for r in train]
    model = build_model(opts, len(tokenizer), opts["lora"])
    clock: dict[str, Any] = {"step_end": [], "links": {}}
    started = time.perf_counter()

    class Clock(TrainerCallback):  # rank 0's step ends; the links at the first timed step and the last
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            clock["train_began_at"] = time.time()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            clock["step_end"].append(time.perf_counter() - started)
            clock["last_step_at"] = time.time()  # the bed's hosts share this machine's clock
            if rank == 0 and opts.get("ask") and state.global_step in (opts["warm_steps"], opts["steps"]):
                clock["links"][str(state.global_step)] = ask(opts["ask"], {"do": "counters"})

    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=opts["batch"], max_steps=opts["steps"],
        learning_rate=opts["lr"], weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=0.0, logging_steps=opts["log_every"],
        save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True, seed=opts["seed"],
        data_seed=opts["seed"], dataloader_num_workers=0, ddp_backend="gloo")
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[Clock()])
    result = trainer.train()
    trained_s = time.perf_counter() - started
    if rank != 0:
        return None
    return {"step_end_s": clock["step_end"], "last_step_at": clock["last_step_at"],
            "fn_started_at": fn_started_at, "train_began_at": clock["train_began_at"], "links": clock["links"], "train_runtime_s": result.metrics["train_runtime"],
            "trained_s": trained_s, "log": [h for h in trainer.state.log_history if "loss" in h],
            "held_out_loss": held_out_loss(trainer.model, held, opts["batch"]),
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "world": int(os.environ.get("WORLD_SIZE", "1")), "host": socket.gethostname()}


def run_trainer(opts: dict[str, Any], shared: Path, tokenizer: Any, train: list[str], held: list[str]) -> dict[str, Any]:
    """The Trainer under pyspark.ml.torch.distributor.TorchDistributor(local_mode=False); the wall
    clock from `run` to its return."""
    from pyspark.ml.torch.distributor import TorchDistributor

    texts_path, tokenizer_dir = shared / "texts.json", shared / "tokenizer"
    if not texts_path.exists():
        texts_path.write_text(json.dumps({"train": train, "held": held}))
        tokenizer.save_pretrained(str(tokenizer_dir))
    started = time.perf_counter()
    out = TorchDistributor(num_processes=opts["world"], local_mode=False, use_gpu=False).run(
        trainer_train, opts, str(texts_path), str(tokenizer_dir), str(shared / "trainer-out"))
    return {**out, "run_wall_s": time.perf_counter() - started}


# -- sparkdl ----------------------------------------------------------------------------------
def fit_sparkdl(df: Any, tokenizer: Any, opts: dict[str, Any], options: dict[str, Any], epochs: int,
                validation: Any = None, on_epoch: Callable[[dict[str, Any]], str | None] | None = None
                ) -> tuple[Any, list[float], float]:
    """TorchEstimator on the text column (packing into blocks, the causal LM loss): the fitted
    model, the driver's clock at each epoch end (from fit start) and the fit's wall seconds."""
    from sparkdl import TorchEstimator

    ends: list[float] = []
    started = time.perf_counter()

    def stamp(record: dict[str, Any]) -> str | None:  # rank 0 waits for it: no step runs meanwhile
        ends.append(time.perf_counter() - started)
        return on_epoch(record) if on_epoch is not None else None

    fitted = TorchEstimator(
        model=build_model(opts, len(tokenizer), opts["lora"]), input_cols=["text"], tokenizer=tokenizer,
        max_length=opts["block"], packing=True, label_col=None, loss="causal_lm", optimizer="adamw",
        lr=opts["lr"], batch_size=opts["batch"], epochs=epochs, num_workers=opts["world"], seed=opts["seed"],
        shuffle=False, threads_per_worker=1, tracking=False, progress=False, validation_df=validation,
        callbacks=[stamp], **options).fit(df)
    return fitted, ends, time.perf_counter() - started
