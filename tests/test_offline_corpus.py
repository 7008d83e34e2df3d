from distill.offline import offline_pairs
from distill.prompts import VICUNA_CHAT_TEMPLATE, task_prefix, vicuna_prompt


def test_offline_pairs_are_deterministic_and_split_disjoint():
    train = offline_pairs("de-en", "train", 300, seed=0)
    again = offline_pairs("de-en", "train", 300, seed=0)
    test = offline_pairs("de-en", "test", 100, seed=0)
    assert train == again
    train_entries = {line for row in train for line in row["source"].split("\n")}
    test_entries = {line for row in test for line in row["source"].split("\n")}
    assert train_entries and test_entries
    assert not train_entries & test_entries
    assert all(row["source"].count("\n") == row["target"].count("\n") for row in train)


def test_vicuna_prompt_matches_chat_template(tiny_tokenizer):
    messages = [
        {"role": "user", "content": task_prefix("fr-en") + "Bonjour"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Merci"},
    ]
    assert tiny_tokenizer.chat_template == VICUNA_CHAT_TEMPLATE
    rendered = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == vicuna_prompt(messages)
    assert rendered.endswith("USER: Merci ASSISTANT:")
    assert "Translate French to English: Bonjour" in rendered
