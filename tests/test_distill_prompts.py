"""Prompt building shared by distill and measure, the prompt plan, and the distill block's checks."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from polydraft.distill.plan import in_eval_split, sample_slots, shard_of
from polydraft.distill.prompts import (
    build_prompt,
    chat_turns,
    encode_prompt,
    translation_messages,
    vicuna_prompt,
)
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
