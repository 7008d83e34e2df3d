"""Prompt building shared by distill and measure, the prompt plan, and the distill block's checks."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from polydraft.data.prompts import (
    build_prompt,
    chat_turns,
    encode_prompt,
    translation_messages,
    vicuna_prompt,
)
from polydraft.distill.requests import in_eval_split, sample_slots, shard_of
from polydraft.pipelines.schema import DistillConfig


def test_translation_prompt_is_the_seed_003_format():
    messages = translation_messages("fr-en", "Madame la Présidente, c'est une motion de procédure.")
    assert build_prompt(messages, "vicuna") == (
        "A chat between a curious user and an artificial intelligence assistant. The assistant gives "
        "helpful, detailed, and polite answers to the user's questions. USER: Translate French to "
        "English: Madame la Présidente, c'est une motion de procédure. ASSISTANT:"
    )


def test_chat_template_and_vicuna_agree_on_a_vicuna_tokenizer(tiny_tokenizer):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    assert build_prompt(messages, "chat_template", tiny_tokenizer) == vicuna_prompt(messages)
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        build_prompt(messages, "chat_template", None)


def test_encode_prompt_adds_bos_once(tiny_tokenizer):
    bos = tiny_tokenizer.bos_token_id
    plain = encode_prompt(tiny_tokenizer, "USER: Hi ASSISTANT:")
    written = encode_prompt(tiny_tokenizer, tiny_tokenizer.bos_token + "USER: Hi ASSISTANT:")
    assert plain[0] == bos and plain[1] != bos
    assert written[0] == bos and written[1] != bos


def test_chat_turns_regenerate_every_assistant_turn():
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"},
        {"role": "user", "content": "q3"},
    ]
    turns = chat_turns(conversation)
    assert [(i, len(m), a) for i, m, a in turns] == [(1, 2, "a1"), (3, 4, "a2"), (5, 6, None)]
    assert turns[1][1][-1] == {"role": "user", "content": "q2"} and turns[1][1][2]["content"] == "a1"
    assert "Be brief. USER: q1" in build_prompt(turns[0][1], "vicuna")


def test_slots_shards_and_eval_split_are_deterministic():
    assert sample_slots([0.0, 0.3, 1.0], 2) == [(0.0, 0), (0.3, 0), (0.3, 1), (1.0, 0), (1.0, 1)]
    ids = [f"0:row{i}" for i in range(400)]
    shards = [shard_of(i, 4) for i in ids]
    assert set(shards) == {0, 1, 2, 3} and shards == [shard_of(i, 4) for i in ids]
    held_out = [i for i in ids if in_eval_split(i, 0, 0.25)]
    assert 60 < len(held_out) < 140 and held_out == [i for i in ids if in_eval_split(i, 0, 0.25)]
    assert held_out != [i for i in ids if in_eval_split(i, 1, 0.25)]


def test_distill_block_checks():
    assert DistillConfig().temperatures == [0.0, 0.3, 0.7, 1.0]
    with pytest.raises(ValidationError, match="shard_index 2 must be below num_shards 2"):
        DistillConfig(shard_index=2, num_shards=2)
    with pytest.raises(ValidationError, match="0.0 appears twice"):
        DistillConfig(temperatures=[0.0, 0.0])
    with pytest.raises(ValidationError, match="set distill.prompt_format: chat_template"):
        DistillConfig.model_validate({"backend": "openai", "openai": {"endpoint": "chat"}})
    with pytest.raises(ValidationError, match="extra"):
        DistillConfig.model_validate({"openai": {"api_key": "sk-..."}})  # keys never go in the recipe


FAMILY_TEMPLATES = {
    # the turn structure of each family's chat template, cut to what decides the stop tokens
    "gemma": ("<end_of_turn>", "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}<start_of_turn>model\n"),
    "llama-3": ("<|eot_id|>", "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"),
    "qwen": ("<|im_end|>", "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"),
    "phi-3": ("<|end|>", "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}<|assistant|>\n"),
}  # fmt: skip


@pytest.mark.parametrize("family", list(FAMILY_TEMPLATES))
def test_the_end_of_turn_token_the_template_writes_is_found(tiny_tokenizer, family):
    import copy

    from polydraft.data.prompts import turn_end_ids

    turn_end, template = FAMILY_TEMPLATES[family]
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": [turn_end, "<|unused|>"]})
    tokenizer.chat_template = template
    assert turn_end_ids(tokenizer) == [tokenizer.convert_tokens_to_ids(turn_end)]


def test_eos_ids_come_from_the_generation_config_else_the_tokenizer(tiny_tokenizer):
    from polydraft.data.prompts import eos_ids, turn_end_ids

    assert eos_ids(tiny_tokenizer, 7) == [7] and eos_ids(tiny_tokenizer, [7, 9]) == [7, 9]
    assert eos_ids(tiny_tokenizer, None) == [tiny_tokenizer.eos_token_id]
    assert turn_end_ids(tiny_tokenizer) == []  # the Vicuna template ends turns with the EOS itself
