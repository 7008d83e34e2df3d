"""Prompt building: task prefixes per language pair and the Vicuna v1.1 conversation format (seed 003 F.2)."""

from __future__ import annotations

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
