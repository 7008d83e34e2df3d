"""The `hf` backend: local transformers `generate`, batched with left padding, on a CPU or a GPU.

For small targets, the demo and the tests; big targets go through vLLM (offline or served).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from polydraft.distill.requests import Emit, Generation, Request, request_seed

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


def _generation_config(
    temperature: float, top_p: float, max_new_tokens: int, stop: list[str], pad_id: int, eos: list[int]
) -> Any:
    from transformers import GenerationConfig

    sampling = temperature > 0
    return GenerationConfig(
        do_sample=sampling,
        # pure temperature sampling: top_k=0 switches off the top-50 cut other defaults would apply
        temperature=temperature if sampling else None,
        top_p=top_p if sampling else None,
        top_k=0 if sampling else None,
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_id,
        eos_token_id=eos,
        stop_strings=stop or None,
    )


def cut_answer(ids: list[int], eos: list[int], pad_id: int, max_new_tokens: int) -> tuple[list[int], bool]:
    """Generated ids up to and including the first EOS (padding after a finished row dropped);
    returns (ids, ended) where `ended` says the model stopped before max_new_tokens."""
    for position, token in enumerate(ids):
        if token in eos:
            return ids[: position + 1], True
    if pad_id not in eos:
        while ids and ids[-1] == pad_id:
            ids = ids[:-1]
    return ids, len(ids) < max_new_tokens


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
    """Answer every pending sample, `batch_size` rows per `generate` call, one temperature at a time.

    Rows of similar prompt length share a batch (less padding). Each batch seeds torch from its first
    row's key, so an uninterrupted run is reproducible. `max_length` (the model's context) caps
    prompt + answer, as vLLM's max_model_len does: an answer cut there finishes with `length`.
    `after_batch` runs after each batch's rows are emitted (an engine process flushes its records there).
    """
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = stop_token_ids
    device = next(model.parameters()).device
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
            config = _generation_config(temperature, top_p, budget, stop, pad_id, eos)
            first_request, first_sample = batch[0]
            torch.manual_seed(request_seed(seed, first_request.key(first_sample)))
            with torch.inference_mode():
                out = model.generate(
                    input_ids=input_ids,
                    attention_mask=mask,
                    generation_config=config,
                    tokenizer=tokenizer if stop else None,
                )
            for (request, sample_index), prompt, row in zip(
                batch, prompts, out[:, width:].tolist(), strict=True
            ):
                ids, ended = cut_answer(row, eos, pad_id, budget)
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
