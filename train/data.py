"""Training examples: mix rows tokenized with loss on the response only, padded batches, deterministic
batch order, and pretraining documents' text (`train/stream.py` reads and tokenizes them).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import torch

from polydraft.data.prompts import vicuna_prompt
from polydraft.train.losses import IGNORE_INDEX
from polydraft.train.packing import Documents, PackedStream, PackPosition

_END = object()


def encode_texts(
    tokenizer: Any, pairs: Sequence[tuple[str, str]], max_length: int, chunk: int = 1024
) -> list[dict[str, list[int]] | None]:
    """`prompt + response` of each pair tokenized as one text, then EOS; labels only on the response and
    the EOS. One result per pair, None where truncation to `max_length` leaves no response token.

    Tokenizing the joined text (not the two halves apart) gives the tokens the target reads at the
    boundary, whatever the tokenizer does with leading spaces. A token carries loss when it covers any
    character of the response, so a token straddling the boundary counts as the response's first.
    BOS is added as the target's tokenizer adds it, unless the prompt already starts with it (chat
    templates that write `<bos>` themselves). Texts are tokenized in batches (much faster).
    """
    bos = tokenizer.bos_token
    out: list[dict[str, list[int]] | None] = []
    for first in range(0, len(pairs), chunk):
        part = pairs[first : first + chunk]
        adds_bos = [not (bos and prompt.startswith(bos)) for prompt, _ in part]
        encoded: dict[int, tuple[list[int], list[tuple[int, int]]]] = {}
        for flag in set(adds_bos):
            indices = [i for i, f in enumerate(adds_bos) if f == flag]
            batch = tokenizer(
                [part[i][0] + part[i][1] for i in indices],
                add_special_tokens=flag,
                return_offsets_mapping=True,
                truncation=False,
            )
            for j, i in enumerate(indices):
                encoded[i] = (batch["input_ids"][j], batch["offset_mapping"][j])
        for i, (prompt, _) in enumerate(part):
            ids, offsets = encoded[i]
            boundary = len(prompt)
            labels = [
                token if end > boundary and end > start else IGNORE_INDEX
                for token, (start, end) in zip(ids, offsets, strict=True)
            ]
            ids = [*ids, tokenizer.eos_token_id][:max_length]
            labels = [*labels, tokenizer.eos_token_id][:max_length]
            supervised = any(label != IGNORE_INDEX for label in labels)
            out.append({"input_ids": ids, "labels": labels} if supervised else None)
    return out


def encode_rows(
    tokenizer: Any, rows: Sequence[dict[str, Any]], max_length: int
) -> tuple[list[dict[str, list[int]]], int]:
    """Encode mix rows (`prompt`, `response`); returns the examples and how many rows were dropped."""
    encoded = encode_texts(tokenizer, [(row["prompt"], row["response"]) for row in rows], max_length)
    examples = [example for example in encoded if example is not None]
    return examples, len(rows) - len(examples)


def collate(examples: Sequence[dict[str, list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example; padding gets label -100 and attention mask 0."""
    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, example in enumerate(examples):
        n = len(example["input_ids"])
        ids[i, :n] = torch.tensor(example["input_ids"])
        labels[i, :n] = torch.tensor(example["labels"])
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def pad_id_of(tokenizer: Any) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


# ----------------------------------------------------------------------------- deterministic batch order


def epoch_order(num_examples: int, seed: int, epoch: int) -> list[int]:
    """The example order of one epoch: a function of (seed, epoch) only, so a resumed run replays it."""
    order = list(range(num_examples))
    random.Random(f"{seed}/{epoch}").shuffle(order)
    return order


def length_grouped(
    order: list[int], lengths: Sequence[int], global_batch: int, window: int, seed: int, epoch: int
) -> list[int]:
    """`order` with each window of `window` global batches sorted by example length, then its global
    batches shuffled (seeded by epoch and window): each step's rows are of similar length (less padding),
    every epoch still holds every row once, and the order is a function of (seed, epoch) alone."""
    size = window * global_batch
    out: list[int] = []
    for start in range(0, len(order), size):
        chunk = sorted(order[start : start + size], key=lambda i: lengths[i])
        batches = [chunk[i : i + global_batch] for i in range(0, len(chunk), global_batch)]
        random.Random(f"{seed}/{epoch}/lengths/{start}").shuffle(batches)
        out.extend(i for batch in batches for i in batch)
    return out


def example_lengths(examples: Sequence[dict[str, list[int]]]) -> list[int]:
    """Token counts of encoded examples: from the Arrow column of a `datasets.Dataset` (no row is read),
    else one example at a time."""
    data = getattr(examples, "data", None)
    if data is not None:
        import pyarrow.compute as pc

        return pc.list_value_length(data.column("input_ids")).to_pylist()
    return [len(examples[i]["input_ids"]) for i in range(len(examples))]


GROUP_WINDOW = 64
"""Global batches per window of `length_grouped`: long enough to find rows of one length, short enough
that a step is not always of the longest (or shortest) rows of the epoch."""


def micro_batch_indices(
    order: Sequence[int],
    step_in_epoch: int,
    micro: int,
    rank: int,
    num_processes: int,
    per_device: int,
    grad_accum_steps: int,
) -> list[int]:
    """Examples of one micro-batch of one process within optimizer step `step_in_epoch`.

    A step consumes `per_device * num_processes * grad_accum_steps` consecutive examples of the epoch
    order, whatever the split; so the same global batch is seen by one rank or many (incomplete final
    batches are dropped).
    """
    global_batch = per_device * num_processes * grad_accum_steps
    first = step_in_epoch * global_batch + (micro * num_processes + rank) * per_device
    return list(order[first : first + per_device])


# ----------------------------------------------------------------------------- pretraining documents


def document_text(row: dict[str, Any], format: str) -> str:
    """The text of a normalised source row for causal-LM pretraining.

    Conversations (ShareGPT) are rendered in the Vicuna v1.1 format that seed 003 pretrains on;
    translation rows become `source` and `target` on two lines.
    """
    if format == "text":
        return row["text"]
    if format == "chat":
        return vicuna_prompt(row["conversations"], add_generation_prompt=False)
    if format == "translation":
        return f"{row['source']}\n{row['target']}"
    return row["prompt"]


# ----------------------------------------------------------------------------- batches of a training step


class MixBatches:
    """Finetuning batches: examples in a (seed, epoch) order, incomplete final global batches dropped.
    `examples` is a list or the memory-mapped `datasets.Dataset` of `train.mix_cache` (indexed one
    example at a time: only a step's examples are read).

    The data position is the step itself, so there is nothing to save beyond it.
    """

    def __init__(
        self,
        examples: Sequence[dict[str, list[int]]],
        seed: int,
        per_device: int,
        rank: int,
        num_processes: int,
        grad_accum_steps: int,
        pad_id: int,
        group_by_length: bool = False,
    ):
        self.examples, self.seed, self.per_device, self.pad_id = examples, seed, per_device, pad_id
        self.rank, self.world, self.accum = rank, num_processes, grad_accum_steps
        self.global_batch = per_device * num_processes * grad_accum_steps
        self.steps_per_epoch = len(examples) // self.global_batch
        self.lengths = example_lengths(examples) if group_by_length else None
        self._epoch, self._order = -1, []

    def micro_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """This process's micro-batches of optimizer step `step` (0-based)."""
        epoch, index = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            self._epoch, self._order = epoch, epoch_order(len(self.examples), self.seed, epoch)
            if self.lengths is not None:
                self._order = length_grouped(
                    self._order, self.lengths, self.global_batch, GROUP_WINDOW, self.seed, epoch
                )
        out = []
        for micro in range(self.accum):
            indices = micro_batch_indices(
                self._order, index, micro, self.rank, self.world, self.per_device, self.accum
            )
            out.append(collate([self.examples[i] for i in indices], self.pad_id))
        return out

    def epoch(self, step: int) -> float:
        """Epochs done after `step` steps."""
        return step / self.steps_per_epoch

    def state(self) -> dict[str, Any]:
        return {}

    def restore(self, state: dict[str, Any]) -> None:
        """Nothing to restore: the batches of a step depend only on the step."""


class PackedBatches:
    """Pretraining batches: consecutive packed sequences of this process's own share of the documents
    (`train/stream.py`: each process reads and tokenizes a disjoint share), loss on every token. The
    position (the process's document stream's and its carried tokens) goes into checkpoints, one per
    process."""

    def __init__(
        self,
        documents: Documents,
        seq_len: int,
        eos_id: int,
        per_device: int,
        num_processes: int,
        grad_accum_steps: int,
    ):
        self.documents, self.seq_len, self.eos_id, self.per_device = documents, seq_len, eos_id, per_device
        self.accum = grad_accum_steps
        self.global_batch = per_device * num_processes * grad_accum_steps
        self.stream = PackedStream(documents, seq_len, eos_id)

    def micro_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """This process's micro-batches of the next step (`step` is only for symmetry with MixBatches)."""
        sequences = self.stream.take(self.per_device * self.accum)
        out = []
        for micro in range(self.accum):
            mine = sequences[micro * self.per_device : (micro + 1) * self.per_device]
            out.append(collate([{"input_ids": s, "labels": s} for s in mine], self.eos_id))
        return out

    def epoch(self, step: int) -> float:
        """The pass over the corpus being read (1: the first); `step` is only for symmetry."""
        return self.stream.epoch + 1

    def state(self) -> dict[str, Any]:
        return asdict(self.stream.position)

    def restore(self, state: dict[str, Any]) -> None:
        stream = state.get("stream", {})  # None: the start; a dict without readers: an older version's
        if stream is not None and "readers" not in stream:
            raise ValueError(
                "this checkpoint's data position is of an older version (one stream read by every process), "
                "which this version no longer reads; delete the stage's .partial folder to pretrain from the start"
            )
        self.stream = PackedStream(self.documents, self.seq_len, self.eos_id, PackPosition(**state))
