"""Bootstrap targets: a small Llama-family chat model built and trained here on the offline corpus.

For offline demos and tests only. The model answers `Translate X to English: ...` prompts in the
Vicuna v1.1 format (seed 003 F.2), like the real targets of the recipes, so every stage downstream runs
exactly as it would on a real target. Builds are cached by the hash of their settings.

It trains through the trainers' one loop (`train.loop.TrainingLoop`, `train.step.train_step`): every
`checkpoint_every` steps a checkpoint (model, optimizer, schedule, RNG states, the data order and its
random state) lands in `.<key>.partial/checkpoints/` beside the cache folder, with the tokenizer and the
step log; a build that was stopped (killed, or run under `timeout` in slices on a shared machine)
continues from there with the same data order, so slices add up to the same model as one uninterrupted
build.
"""

from __future__ import annotations

import json
import logging
import math
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig

from polydraft.data.offline import offline_pairs, offline_texts
from polydraft.data.prompts import VICUNA_CHAT_TEMPLATE, task_prefix, vicuna_prompt
from polydraft.models.tiny import build_llama, train_tokenizer
from polydraft.train.loop import LoopPlan, TrainingLoop
from polydraft.train.losses import ce_sum
from polydraft.train.runtime import make_accelerator
from polydraft.train.step import StepLog, StepStats, train_step

log = logging.getLogger(__name__)

DONE = "bootstrap.json"
CHECKPOINTS = "checkpoints"
LOG_FILE = "train_log.jsonl"


class _Untracked:
    """The bootstrap's tracker: no wandb run (its step log and console line are all it reports)."""

    def log(self, metrics: dict[str, Any], step: int | None = None, echo: bool = True) -> None:
        return None


def conversations(
    pairs: list[str],
    samples_per_pair: int,
    entries_per_sample: tuple[int, int],
    test_fraction: float,
    seed: int,
    kind_weights: dict[str, float],
) -> list[tuple[str, str]]:
    """(prompt, answer) strings: the Vicuna prompt of a translation request and the reference + EOS."""
    out = []
    for pair in pairs:
        for row in offline_pairs(
            pair, "train", samples_per_pair, entries_per_sample, test_fraction, seed, kind_weights
        ):
            prompt = vicuna_prompt([{"role": "user", "content": task_prefix(pair) + row["source"]}])
            out.append((prompt, " " + row["target"] + "</s>"))
    return out


def _encode(tokenizer: Any, examples: list[tuple[str, str]], seq_len: int) -> list[tuple[list[int], int]]:
    """Token ids of prompt + answer and the index where the answer starts (loss goes on the answer only)."""
    encoded = []
    for prompt, answer in examples:
        prompt_ids = tokenizer(prompt).input_ids
        answer_ids = tokenizer(answer, add_special_tokens=False).input_ids
        ids = (prompt_ids + answer_ids)[:seq_len]
        encoded.append((ids, len(prompt_ids)))
    return encoded


def _batch(
    encoded: list[tuple[list[int], int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids, _ in encoded)
    input_ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    labels = torch.full((len(encoded), width), -100, dtype=torch.long)
    attention = torch.zeros((len(encoded), width), dtype=torch.long)
    for row, (ids, answer_start) in enumerate(encoded):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
        labels[row, answer_start : len(ids)] = torch.tensor(ids[answer_start:])
    return input_ids, labels, attention


@dataclass(frozen=True)
class TargetShape:
    """The bootstrap Llama's shape (`models.tiny.build_llama`; the vocabulary is the tokenizer's size)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int


@dataclass(frozen=True)
class BootstrapTraining:
    """Its training: `steps` of `batch_size` conversations cut to `seq_len` tokens, AdamW at `lr`."""

    steps: int
    batch_size: int
    seq_len: int
    lr: float
    seed: int
    checkpoint_every: int = 25


@dataclass(frozen=True)
class Corpus:
    """The offline corpus it learns from (`data.offline.offline_pairs`)."""

    samples_per_pair: int
    entries_per_sample: tuple[int, int]
    test_fraction: float
    kind_weights: dict[str, float]


def build_bootstrap_target(
    out_dir: Path,
    pairs: list[str],
    shape: TargetShape,
    training: BootstrapTraining,
    corpus: Corpus,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Train a tokenizer and a small Llama on the offline corpus and save them as a Hugging Face folder.

    Written into a temporary sibling folder and renamed at the end, so `out_dir` is complete or absent;
    resumed from `.<name>.partial/` when an earlier build of the same folder was stopped.
    """
    from transformers import AutoTokenizer

    seed, steps, batch_size = training.seed, training.steps, training.batch_size
    started = time.perf_counter()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    partial = out_dir.with_name(f".{out_dir.name}.partial")
    langs = [pair.split("-")[0] for pair in pairs]
    examples = conversations(
        pairs,
        corpus.samples_per_pair,
        corpus.entries_per_sample,
        corpus.test_fraction,
        seed,
        corpus.kind_weights,
    )
    if (partial / "tokenizer.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(partial)
    else:
        texts = [row["text"] for row in offline_texts(langs, 2000, seed)] + [p + a for p, a in examples]
        tokenizer = train_tokenizer(texts, shape.vocab_size, VICUNA_CHAT_TEMPLATE)
        partial.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(partial)
    encoded = _encode(tokenizer, examples, training.seq_len)
    model = build_llama(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        num_layers=shape.num_layers,
        num_heads=shape.num_heads,
        intermediate_size=shape.intermediate_size,
        max_position_embeddings=shape.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        seed=seed,
    ).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=training.lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))) * 0.9 + 0.1

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    accelerator = make_accelerator(1, "no")
    model, optimizer = accelerator.prepare(model, optimizer)
    plan = LoopPlan(
        steps, log_every=10, eval_every=0, checkpoint_every=training.checkpoint_every, keep_checkpoints=1
    )
    training = TrainingLoop(
        accelerator, plan, label="bootstrap target", checkpoints=partial / CHECKPOINTS,
        log_path=partial / LOG_FILE, scheduler=scheduler, quiet=not show_progress,
    )  # fmt: skip
    order: list[int] = []
    spent, slices = 0.0, 0
    saved = training.resume()
    if saved is not None:  # the data order and its random state, as the stopped build left them
        version, internal, gauss = saved["rng"]
        rng.setstate((version, tuple(internal), gauss))
        order, spent, slices = saved["order"], saved["seconds"], saved["slices"]

    def one_step(step: int) -> StepStats:
        nonlocal order
        if len(order) < batch_size:
            order += rng.sample(range(len(encoded)), len(encoded))
        chunk, order = order[:batch_size], order[batch_size:]
        input_ids, labels, attention = _batch([encoded[i] for i in chunk], tokenizer.pad_token_id)
        batch = {"input_ids": input_ids, "attention_mask": attention, "labels": labels}

        def loss_sum(b: dict[str, torch.Tensor]) -> torch.Tensor:
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
            return ce_sum(logits, b["labels"])[0]

        return train_step(accelerator, model, optimizer, scheduler, [batch], loss_sum, 1.0)

    def state() -> dict[str, Any]:
        seconds = spent + time.perf_counter() - started
        return {"rng": rng.getstate(), "order": order, "seconds": seconds, "slices": slices + 1}

    steplog = StepLog(
        _Untracked(), partial / LOG_FILE, prefix="", log_every=10, flops_per_token=0.0, peak_flops=None,
        world=1, main_process=True,
    )  # fmt: skip
    result = training.run(one_step, steplog, state=state)
    model = accelerator.unwrap_model(model)
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_new_tokens=256,
        do_sample=False,
    )
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{random.getrandbits(32):08x}")
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    stats = {
        "pairs": pairs,
        "parameters": sum(p.numel() for p in model.parameters()),
        "examples": len(encoded),
        "steps": steps,
        "final_loss": result.train_loss,
        "seconds": round(spent + time.perf_counter() - started, 1),
        "slices": slices + 1,
    }
    (tmp / DONE).write_text(json.dumps(stats, indent=2) + "\n")
    try:
        tmp.rename(out_dir)
    except OSError:  # another process finished the same build first: keep theirs
        shutil.rmtree(tmp)
    shutil.rmtree(partial, ignore_errors=True)
    log.info(
        "bootstrap target ready in %s (loss %.3f after %d steps, %.0f s)",
        out_dir,
        stats["final_loss"],
        steps,
        stats["seconds"],
    )
    return stats
