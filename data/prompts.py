"""Prompt building: task prefixes per language pair, the Vicuna v1.1 conversation format (seed 003 F.2),
raw text for base targets, and document beginnings as prompts (seed 001 on SlimPajama)."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

LANGUAGES = ("de", "fr", "ru", "ja", "zh", "en")
TO_ENGLISH = ("de-en", "fr-en", "ru-en", "ja-en", "zh-en")
"""Seed 003's translation directions: its drafters translate into English."""
PAIRS = (*TO_ENGLISH, *(f"{a}-{b}" for a in LANGUAGES for b in LANGUAGES if a != b and b != "en"))
"""Every supported translation direction, source language first: seed 003's into English, then the pairs
whose answers are not English (en-de, de-fr, ...), where drafters and EAGLE-3 heads trained on English
answers fall short."""

MULTILINGUAL = "multilingual"
"""The name (folder, drafter) of the one drafter the finetune stage trains on every pair's mix."""

LANGUAGE_NAMES = {
    "de": "German",
    "fr": "French",
    "ru": "Russian",
    "ja": "Japanese",
    "zh": "Chinese",
    "en": "English",
}

VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)

# The same format as a Jinja chat template, installed on bootstrapped targets so that
# `tokenizer.apply_chat_template` and `vicuna_prompt` agree character for character.
VICUNA_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set turns = messages[1:] %}{% else %}"
    '{% set system = "' + VICUNA_SYSTEM.replace("'", "\\'") + '" %}{% set turns = messages %}{% endif %}'
    "{{ system }} "
    "{% for m in turns %}{% if m['role'] == 'user' %}USER: {{ m['content'] }} "
    "{% else %}ASSISTANT: {{ m['content'] }}</s>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def task_prefix(pair: str) -> str:
    """`de-en` -> `Translate German to English: ` (seed 003 F.2)."""
    source, target = pair.split("-")
    return f"Translate {LANGUAGE_NAMES[source]} to {LANGUAGE_NAMES[target]}: "


def vicuna_prompt(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """Vicuna v1.1 (FastChat `vicuna_v1.1`): `SYSTEM USER: q ASSISTANT: a</s>USER: q2 ASSISTANT:`."""
    system = VICUNA_SYSTEM
    if messages and messages[0]["role"] == "system":
        system, messages = messages[0]["content"], messages[1:]
    parts = [system, " "]
    for message in messages:
        if message["role"] == "user":
            parts.append(f"USER: {message['content']} ")
        else:
            parts.append(f"ASSISTANT: {message['content']}</s>")
    if add_generation_prompt:
        parts.append("ASSISTANT:")
    return "".join(parts)


PROMPT_FORMATS = ("vicuna", "chat_template", "raw")


def translation_messages(pair: str, source: str) -> list[dict[str, str]]:
    """One user turn asking for the translation, with the task prefix of seed 003 F.2."""
    return [{"role": "user", "content": task_prefix(pair) + source}]


def build_prompt(messages: list[dict[str, str]], prompt_format: str, tokenizer: Any = None) -> str:
    """The exact string the target is prompted with, ending where its answer starts.

    `vicuna`: the Vicuna v1.1 format (no tokenizer needed); `chat_template`: the tokenizer's own chat
    template with the generation prompt; `raw`: the text of the one user turn as it is, for base
    targets that continue text. Distill and measure both build prompts here so that they agree.
    """
    if prompt_format == "vicuna":
        return vicuna_prompt(messages)
    if prompt_format == "raw":
        if len(messages) != 1 or messages[0]["role"] != "user":
            roles = [m["role"] for m in messages]
            raise ValueError(
                f"prompt_format `raw` sends one text as it is, not a conversation (got turns {roles}): "
                "use prompt_format vicuna or chat_template for chat data"
            )
        return messages[0]["content"]
    if prompt_format == "chat_template":
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "prompt_format `chat_template` needs a tokenizer with a chat template "
                "(this one has none: use prompt_format `vicuna`)"
            )
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    raise ValueError(f"unknown prompt_format {prompt_format!r}; expected one of {PROMPT_FORMATS}")


def text_prefix(tokenizer: Any, text: str, max_tokens: int) -> str:
    """The beginning of a document, at most `max_tokens` target tokens, as a prompt the target continues.

    The document is cut after a whole token and the kept tokens are decoded back to text, so the prompt
    ends on a token boundary. A document of at most `max_tokens` tokens is returned whole. A byte-level
    tokenizer can split one character over several tokens: tokens are then dropped until the cut no
    longer leaves half a character (which would decode to U+FFFD).
    """
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text
    keep = max_tokens
    # no clean-up of spaces: the prompt keeps the document's own characters (` .` stays ` .`)
    prefix = tokenizer.decode(ids[:keep], clean_up_tokenization_spaces=False)
    while keep > 1 and prefix.endswith("\ufffd"):
        keep -= 1
        prefix = tokenizer.decode(ids[:keep], clean_up_tokenization_spaces=False)
    return prefix


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of a prompt string, with the tokenizer's BOS unless the string already writes it.

    Chat templates such as Llama 3's put the BOS token into the text; adding another one would shift
    the target's input away from what it was trained on.
    """
    bos = getattr(tokenizer, "bos_token", None)
    add_special = not (bos and prompt.startswith(bos))
    return tokenizer(prompt, add_special_tokens=add_special)["input_ids"]


def chat_turns(conversation: list[dict[str, str]]) -> list[tuple[int, list[dict[str, str]], str | None]]:
    """The prompts of a conversation: `(turn index, messages up to that user turn, original answer)`.

    Every user turn that an assistant turn follows (or that ends the conversation) becomes a prompt
    with the turns before it as they are in the data, so that every assistant turn is regenerated.
    """
    turns = []
    for index, message in enumerate(conversation):
        if message["role"] != "user":
            continue
        following = conversation[index + 1] if index + 1 < len(conversation) else None
        if following is None or following["role"] == "assistant":
            answer = following["content"] if following is not None else None
            turns.append((index, conversation[: index + 1], answer))
    return turns


TURN_ENDS = ("<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|end|>")
"""End-of-turn tokens of chat templates (Gemma, Llama 3, Qwen / ChatML, Phi-3): special tokens that a
model ends its answer with, which its generation config does not always list as EOS."""


def turn_end_ids(tokenizer: Any) -> list[int]:
    """Ids of the end-of-turn tokens that the tokenizer's chat template writes."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return []
    vocab = tokenizer.get_vocab()
    return [vocab[token] for token in TURN_ENDS if token in template and token in vocab]


def eos_ids(tokenizer: Any, generation_eos: int | list[int] | None) -> list[int]:
    """The target's EOS ids: its generation config's (`generation_eos`), else its tokenizer's."""
    eos = generation_eos if generation_eos is not None else tokenizer.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])


def answer_stop_ids(override: list[int] | None, target: Any, tokenizer: Any) -> tuple[list[int], list[int]]:
    """(the target's EOS ids, the other token ids that end an answer: the recipe's
    `distill.stop_token_ids`, else the end-of-turn token of the target's chat template). Without a
    tokenizer (an `openai` server, which knows its EOS): ([], the recipe's ids or none)."""
    if tokenizer is None:
        return [], list(override or [])
    from transformers import GenerationConfig

    try:
        generation_eos = GenerationConfig.from_pretrained(target.path, revision=target.revision).eos_token_id
    except OSError:  # no generation_config.json
        generation_eos = None
    eos = eos_ids(tokenizer, generation_eos)
    extra = [i for i in (override if override is not None else turn_end_ids(tokenizer)) if i not in eos]
    stops = eos + extra
    log.info("distill: answers end at token ids %s (%s)", stops, tokenizer.convert_ids_to_tokens(stops))
    return eos, extra
