"""What the distill stage has to generate: prompt items built from source rows, their
(temperature, sample) slots, per-request seeds, the shard a prompt belongs to, and open rows for the mix.

A record is identified by its key `(prompt id, temperature, sample index)`; resume, merge and the
failures file all work on these keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from polydraft.data.prompts import build_prompt, chat_turns, text_prefix, translation_messages
from polydraft.data.sources import SourceError, SourceRows

Key = tuple[str, float, int]
CHAT_PAIR = "chat"
"""The mix `pair` of prompts that belong to no language pair (chat and prompt-list sources)."""


@dataclass
class PromptItem:
    """One prompt the target answers, at every temperature of the run."""

    id: str
    source: str
    pair: str
    messages: list[dict[str, str]]
    prompt: str
    reference: str = ""
    """The reference answer of the data (translation target, original assistant turn); "" if none."""
    prompt_ids: list[int] | None = None
    """Target token ids of `prompt`, when a tokenizer was loaded."""


@dataclass
class Request:
    """The pending samples of one prompt at one temperature (a backend may send them as `n`)."""

    item: PromptItem
    temperature: float
    sample_indices: list[int]

    def key(self, sample_index: int) -> Key:
        return (self.item.id, self.temperature, sample_index)


@dataclass
class Generation:
    """One answer, in the same shape whatever backend produced it."""

    text: str
    finish_reason: str
    """`stop` (end of sequence or a stop string) or `length` (max_new_tokens reached)."""
    token_ids: list[int] | None
    """Generated token ids as the engine returned them (may include the EOS token); None if not given."""
    prompt_tokens: int
    response_tokens: int
    """-1 when the server did not report the count."""


Emit = Callable[[Request, int, Generation], None]
"""Called by a backend for every finished sample: (request, sample index, generation)."""
Fail = Callable[[Request, int, str], None]
"""Called by a backend for a sample that failed for good: (request, sample index, reason)."""


@dataclass
class Invalid:
    """Rows that could not become prompts, counted per source (nothing disappears silently)."""

    count: int = 0
    examples: list[str] = field(default_factory=list)

    def add(self, problem: str) -> None:
        self.count += 1
        if len(self.examples) < 5:
            self.examples.append(problem)


def record_id(key: Key) -> str:
    prompt_id, temperature, sample_index = key
    return f"{prompt_id}|T={temperature:g}|s={sample_index}"


def sample_slots(temperatures: list[float], samples_per_prompt: int) -> list[tuple[float, int]]:
    """(temperature, sample index) of every record a prompt gets; greedy (T=0) is generated once."""
    return [(float(t), s) for t in temperatures for s in range(1 if t == 0 else samples_per_prompt)]


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def request_seed(seed: int, key: Key) -> int:
    """A seed per (prompt, temperature, sample): samples differ from each other and reruns repeat them."""
    return _digest(f"{seed}|{record_id(key)}") % 2**31


def shard_of(prompt_id: str, num_shards: int) -> int:
    """The shard a prompt (or open row) belongs to: a hash of its id, so stable across jobs."""
    return _digest(prompt_id) % num_shards


def in_eval_split(prompt_id: str, seed: int, eval_fraction: float) -> bool:
    """Held out for eval? Decided per prompt, so that every sample of a prompt lands on one side."""
    return _digest(f"eval|{seed}|{prompt_id}") / 2**64 < eval_fraction


def _reject(invalid: Invalid, description: str, problem: str, skip_invalid: bool) -> None:
    if not skip_invalid:
        raise SourceError(f"{description}: {problem} (set skip_invalid: true to count and skip such rows)")
    invalid.add(problem)


def prompt_items(
    rows: SourceRows,
    format: str,
    source_index: int,
    prompt_format: str,
    tokenizer: Any,
    skip_invalid: bool,
    seen: set[str],
    text_prompt_tokens: int,
) -> tuple[list[PromptItem], Invalid]:
    """Prompt items of one source's normalised rows.

    `translation`: one user turn with the pair's task prefix; `chat`: one item per user turn (every
    assistant turn regenerated given the turns before it); `prompts`: the prompt as one user turn;
    `text`: a document's first `text_prompt_tokens` target tokens as one user turn, which the target
    continues (with prompt_format `raw` the prompt is exactly that text). Ids are
    `<source index>:<row id>` (plus `#<turn>` for chat) and must be unique over the run: `seen`
    collects them. A duplicate id or a conversation without a user turn is an invalid row.
    """
    invalid = Invalid(rows.invalid, list(rows.invalid_examples))
    items: list[PromptItem] = []
    for row in rows.rows:
        base_id = f"{source_index}:{row['id']}"
        if format == "translation":
            prompts = [(base_id, translation_messages(row["pair"], row["source"]), row["target"])]
        elif format == "chat":
            prompts = [
                (f"{base_id}#{turn}", messages, answer or "")
                for turn, messages, answer in chat_turns(row["conversations"])
            ]
            if not prompts:
                _reject(
                    invalid,
                    rows.description,
                    f"row id {row['id']!r}: field 'conversations' has no user turn",
                    skip_invalid,
                )
        elif format == "prompts":
            prompts = [(base_id, [{"role": "user", "content": row["prompt"]}], "")]
        elif format == "text":
            if tokenizer is None:
                raise ValueError(
                    f"{rows.description}: `text` prompts are cut in target tokens: load a tokenizer"
                )
            prefix = text_prefix(tokenizer, row["text"], text_prompt_tokens)
            prompts = [(base_id, [{"role": "user", "content": prefix}], "")]
        else:
            raise SourceError(
                f"{rows.description}: format {format!r} has no prompts (use translation, chat, prompts or text)"
            )
        for prompt_id, messages, reference in prompts:
            if prompt_id in seen:
                _reject(
                    invalid,
                    rows.description,
                    f"row id {row['id']!r}: duplicate id {prompt_id!r}",
                    skip_invalid,
                )
                continue
            seen.add(prompt_id)
            items.append(
                PromptItem(
                    id=prompt_id,
                    source=rows.description,
                    pair=row.get("pair") or CHAT_PAIR,
                    messages=messages,
                    prompt=build_prompt(messages, prompt_format, tokenizer),
                    reference=reference,
                )
            )
    return items, invalid


def open_rows(
    rows: SourceRows, format: str, source_index: int, prompt_format: str, tokenizer: Any
) -> list[dict[str, Any]]:
    """Mix rows (origin `open`) of an open-source dataset: the prompt built as for distillation, the
    data's own answer as the response (seed 001 §3.2 keeps such rows next to the distilled ones).
    A `text` row (a document) has an empty prompt and the whole document as its response, so the
    trainers learn every token of it (they add BOS before and EOS after, and cut at their max_length)."""
    out = []
    for row in rows.rows:
        base_id = f"open{source_index}:{row['id']}"
        if format == "translation":
            pairs = [(base_id, translation_messages(row["pair"], row["source"]), row["target"])]
        elif format == "chat":
            pairs = [
                (f"{base_id}#{turn}", messages, answer)
                for turn, messages, answer in chat_turns(row["conversations"])
                if answer is not None
            ]
        elif format == "text":
            pairs = [(base_id, None, row["text"])]
        else:
            raise SourceError(
                f"{rows.description}: an open source needs answers (format translation, chat or text), "
                f"not {format!r}"
            )
        for row_id, messages, answer in pairs:
            out.append(
                {
                    "id": row_id,
                    "pair": row.get("pair") or CHAT_PAIR,
                    "origin": "open",
                    "prompt": "" if messages is None else build_prompt(messages, prompt_format, tokenizer),
                    "response": answer,
                    "temperature": None,
                    "sample_index": 0,
                }
            )
    return out


def pending_requests(
    items: list[PromptItem], slots: list[tuple[float, int]], done: set[Key]
) -> list[Request]:
    """One request per (prompt, temperature) with the sample indices not written yet."""
    requests = []
    temperatures = sorted({t for t, _ in slots})
    for temperature in temperatures:
        indices = [s for t, s in slots if t == temperature]
        for item in items:
            todo = [s for s in indices if (item.id, temperature, s) not in done]
            if todo:
                requests.append(Request(item, temperature, todo))
    return requests
