"""The `hf` backend: a local transformers model, batched with left padding, on a CPU or a GPU.

For small targets, the demo and the tests; big targets go through vLLM (offline or served). Its loop
(`generate_rows`) is the one `generate` runs for these settings: transformers' temperature and top-p warpers
and its stop-string criterion, one token per row a step. It differs in two ways. A row that ended (an EOS, a
stop string, its budget) leaves the batch, instead of being computed, padded, until the batch's longest
answer ends; rows are dropped from the cache a few at a time: once at most `COMPACT_SHARE` of the rows still
computed are unfinished, so a batch is compacted a handful of times, not at every answer's end (each
compaction copies every layer's cache). And the KV cache is transformers' static one, as long as the prompts
plus `max_new_tokens`, each step writing its position in place: the growing cache `generate` uses by
default concatenated every layer's keys and values at each step, a quarter of a step's time on the demo
target. There, one thread, 192 of the demo's distillation prompts: 14.3-14.7 s at 32 rows a batch and
13.4-13.9 s at 64 against `generate`'s 19.9-20.0 s, which computed 13.6k row-steps for 8.4k answer tokens
(`bench/results/distill_hf.md`; 17.1-17.2 s at 32 rows with the growing cache).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from polydraft.distill.requests import Emit, Generation, Request, request_seed
from polydraft.models.decoder_layers import cache_kwargs

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> str:
    """`auto` -> `cuda` when a GPU exists, else `cpu`."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("distill.hf.device is `cuda` but torch sees no CUDA GPU")
    return device


def torch_dtype(dtype: str, device: str) -> torch.dtype:
    """`auto` is bfloat16 on a GPU and float32 on a CPU (CPU half-precision matmuls are slow)."""
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return DTYPES[dtype]


def load_model(path: str, revision: str | None, dtype: str, trust_remote_code: bool, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    device = resolve_device(device)
    model = AutoModelForCausalLM.from_pretrained(
        path, revision=revision, dtype=torch_dtype(dtype, device), trust_remote_code=trust_remote_code
    )
    return model.to(device).eval()


def answer_text(tokenizer: Any, prompt_ids: list[int], answer_ids: list[int]) -> str:
    """The answer as the text that follows the prompt.

    Decoded together with the prompt, then the prompt's text removed: a SentencePiece tokenizer (Llama)
    drops the leading space of the first token it decodes, so the answer decoded alone would lose the
    space between a raw prompt `The cat sat on` and its continuation ` the mat`. Spaces are not cleaned
    up, so the text spells exactly the generated tokens.
    """
    options = {"skip_special_tokens": True, "clean_up_tokenization_spaces": False}
    head = tokenizer.decode(prompt_ids, **options)
    whole = tokenizer.decode(prompt_ids + answer_ids, **options)
    if whole.startswith(head):
        return whole[len(head) :]
    # a prompt ending inside a multi-byte character decodes differently alone: decode the answer alone
    return tokenizer.decode(answer_ids, **options)


def cut_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """Text before the first stop string (which the answer leaves out, as vLLM and OpenAI servers do)."""
    positions = [text.find(s) for s in stop if s and s in text]
    return (text[: min(positions)], True) if positions else (text, False)


COMPACT_SHARE = 0.75
"""A batch's finished rows leave its cache once the unfinished ones are at most this share of the rows still in
it (see the module's docstring)."""


@torch.inference_mode()
def generate_rows(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    eos: set[int],
    generator: torch.Generator | None,
    stop_criterion: Any = None,
) -> list[list[int]]:
    """Each row's new token ids, up to and including the EOS (or the token that completed a stop string of
    `stop_criterion`, a transformers `StopStringCriteria`), at most `max_new_tokens`: left-padded
    `input_ids` [B, W] and their `attention_mask`, greedy at temperature 0, else sampled from the
    temperature- and top-p-processed distribution with `generator`."""
    from transformers import StaticCache
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    warpers = []
    if temperature > 0:
        warpers.append(TemperatureLogitsWarper(temperature))
        if top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p))
    width = input_ids.shape[1]
    cache = StaticCache(config=model.config, max_cache_len=width + max_new_tokens)
    # the padding mask over the whole cache, each step's column set as its token enters
    mask = attention_mask.new_zeros(input_ids.shape[0], width + max_new_tokens)
    mask[:, :width] = attention_mask
    positions = (attention_mask.long().cumsum(-1) - 1).masked_fill_(attention_mask == 0, 1)
    sequences = input_ids
    rows = list(range(input_ids.shape[0]))  # the batch row each cache row answers
    answers: list[list[int]] = [[] for _ in rows]
    running = [True] * len(rows)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                cache_position=torch.arange(width, device=input_ids.device), logits_to_keep=1,
                **cache_kwargs(model, cache))  # fmt: skip
    positions = positions[:, -1:]
    for step in range(max_new_tokens):
        scores = out.logits[:, -1, :].float()
        for warp in warpers:
            scores = warp(sequences, scores)
        if temperature > 0:
            tokens = torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator)[:, 0]
        else:
            tokens = scores.argmax(-1)
        sequences = torch.cat([sequences, tokens[:, None]], dim=1)
        stopped = (
            stop_criterion(sequences, scores).tolist() if stop_criterion is not None else [False] * len(rows)
        )
        for row, token, stop in zip(rows, tokens.tolist(), stopped, strict=True):
            if running[row]:
                answers[row].append(token)
                running[row] = not (token in eos or stop or len(answers[row]) == max_new_tokens)
        going = [i for i, row in enumerate(rows) if running[row]]
        if not going:
            break
        if len(going) <= COMPACT_SHARE * len(rows):
            keep = torch.tensor(going, device=sequences.device)
            cache.reorder_cache(keep)  # each layer's rows `keep`, in order
            mask, positions, sequences, tokens = mask[keep], positions[keep], sequences[keep], tokens[keep]
            rows = [rows[i] for i in going]
        mask[:, width + step] = 1
        positions = positions + 1
        out = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=positions, use_cache=True,
                    cache_position=torch.tensor([width + step], device=tokens.device),
                    **cache_kwargs(model, cache))  # fmt: skip
    return answers


def generate_hf(
    model: Any,
    tokenizer: Any,
    requests: list[Request],
    *,
    top_p: float,
    max_new_tokens: int,
    stop: list[str],
    stop_token_ids: list[int],
    seed: int,
    batch_size: int,
    emit: Emit,
    max_length: int | None = None,
    after_batch: Callable[[], None] | None = None,
) -> None:
    """Answer every pending sample, `batch_size` rows a batch (`generate_rows`), one temperature at a time.

    Rows of similar prompt length share a batch (less padding). Each batch's sampler is seeded from its
    first row's key, so an uninterrupted run is reproducible. `max_length` (the model's context) caps
    prompt + answer, as vLLM's max_model_len does: an answer cut there finishes with `length`.
    `after_batch` runs after each batch's rows are emitted (an engine process flushes its records there).
    """
    from transformers.generation.stopping_criteria import StopStringCriteria

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = stop_token_ids
    device = next(model.parameters()).device
    stop_criterion = StopStringCriteria(tokenizer, stop) if stop else None
    temperatures = sorted({r.temperature for r in requests})
    for temperature in temperatures:
        rows = [(r, s) for r in requests if r.temperature == temperature for s in r.sample_indices]
        rows.sort(key=lambda row: len(row[0].item.prompt_ids or []))
        for start in range(0, len(rows), batch_size):
            batch = rows[start : start + batch_size]
            prompts = [r.item.prompt_ids for r, _ in batch]
            if any(p is None for p in prompts):
                raise ValueError("the hf backend needs prompt token ids on every prompt item")
            width = max(len(p) for p in prompts)
            # left padding: every row's answer starts at the same position
            input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
            budget = max_new_tokens if max_length is None else max(1, min(max_new_tokens, max_length - width))
            first_request, first_sample = batch[0]
            generator = torch.Generator(device).manual_seed(
                request_seed(seed, first_request.key(first_sample))
            )
            answers = generate_rows(
                model, input_ids, mask, temperature=temperature, top_p=top_p, max_new_tokens=budget,
                eos=set(eos), generator=generator, stop_criterion=stop_criterion,
            )  # fmt: skip
            for (request, sample_index), prompt, ids in zip(batch, prompts, answers, strict=True):
                ended = len(ids) < budget or ids[-1] in eos  # an EOS or a stop string ended it
                text = answer_text(tokenizer, prompt, [t for t in ids if t not in eos])
                text, stopped = cut_at_stop(text, stop)
                generation = Generation(
                    text=text,
                    finish_reason="stop" if ended or stopped else "length",
                    token_ids=ids,
                    prompt_tokens=len(prompt),
                    response_tokens=len(ids),
                )
                emit(request, sample_index, generation)
            if after_batch is not None:
                after_batch()
