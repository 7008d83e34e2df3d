import pytest
from num2words import num2words
from pydantic import ValidationError

from polydraft.data.offline import catalog_entries, offline_pairs
from polydraft.data.prompts import VICUNA_CHAT_TEMPLATE, task_prefix, vicuna_prompt
from polydraft.pipelines.schema.common import OfflineCorpusConfig, SourceConfig, reader_args


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


def test_a_source_with_a_limit_draws_only_the_samples_it_reads_and_the_same_first_ones():
    """A held-out split keeps about one entry in ten it draws: reading 12 rows draws 12 samples, not the
    split's 400, and those are the first 12 of the whole split however they are asked for."""
    from polydraft.data import offline
    from polydraft.data.sources import read_source

    args = {"kind": "offline", "format": "translation", "pair": "fr-en", "split": "test", "seed": 5}
    offline._stream.cache_clear()
    few = read_source(**args, limit=12).rows
    (stream,) = [offline._stream(*key) for key in [("fr-en", "test", (2, 4), 0.1, 5, ())]]
    assert len(stream.samples) == 12
    every = read_source(**args).rows
    assert len(stream.samples) == 400 and len(every) == 400
    assert few == every[:12]
    offline._stream.cache_clear()  # drawn afresh, all at once: the same rows
    assert read_source(**args).rows == every


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


def test_a_source_mix_replaces_the_corpus_mix_for_that_source_only():
    corpus = OfflineCorpusConfig(kind_weights={"catalog": 1.0, "name": 1.0, "date": 1.0, "number": 1.0})
    numbers = SourceConfig(
        kind="offline", pair="de-en", split="test", kind_weights={"number": 1.0}, entries_per_sample=[9, 11]
    )
    mixed = SourceConfig(kind="offline", pair="de-en", split="test")
    args = reader_args(numbers, 0, corpus)
    only = args["offline_kind_weights"]
    assert only == {"catalog": 0.0, "name": 0.0, "date": 0.0, "number": 1.0}  # kinds left out: never drawn
    assert args["offline_entries_per_sample"] == (9, 11)
    assert reader_args(mixed, 0, corpus)["offline_kind_weights"] == dict(corpus.kind_weights)
    assert reader_args(mixed, 0, corpus)["offline_entries_per_sample"] == (2, 4)

    number_words = {w for n in range(100) for w in num2words(n, lang="en").split("-")} | {
        "hundred",
        "thousand",
        "and",
    }
    rows = offline_pairs("de-en", "test", 40, (2, 3), 0.1, 0, only)
    words = {w for row in rows for w in row["target"].replace(",", " ").replace("-", " ").split()}
    assert words <= number_words, words - number_words


def test_source_kind_weights_are_refused_where_they_mean_nothing():
    with pytest.raises(ValidationError, match="only for `offline` translation sources"):
        SourceConfig(kind="local", path="x.jsonl", pair="de-en", kind_weights={"number": 1.0})
    with pytest.raises(ValidationError, match="only for `offline` translation sources"):
        SourceConfig(kind="offline", format="text", kind_weights={"number": 1.0})
    with pytest.raises(ValidationError, match="only for `offline` translation sources"):
        SourceConfig(kind="hf", path="wmt16", pair="de-en", entries_per_sample=[2, 3])
    with pytest.raises(ValidationError, match="at least one positive"):
        SourceConfig(kind="offline", pair="de-en", kind_weights={"number": 0.0})
    with pytest.raises(ValidationError, match="1 <= low <= high"):
        SourceConfig(kind="offline", pair="de-en", entries_per_sample=[3, 2])


def test_pairs_into_and_between_other_languages_reverse_or_join_the_same_entries():
    """en->X reverses X->en's entries, X->Y joins two languages' entries on what they share; every pair's
    held-out split is the same set of entries (hashed on the non-English side, the source's for X->Y)."""
    weights = {"catalog": 1.0, "name": 1.0, "date": 1.0, "number": 1.0}
    rows = offline_pairs("en-de", "train", 60, (2, 3), 0.1, 0, weights)
    german = {e.source: e.target for e in catalog_entries("de")}  # German message -> English original
    english = {v: k for k, v in german.items()}
    lines = [(s, t) for row in rows for s, t in zip(row["source"].split("\n"), row["target"].split("\n"))]
    catalog = [(s, t) for s, t in lines if s in english and english[s] == t]
    assert catalog, "no catalog line was drawn"
    assert all(row["source"].count("\n") == row["target"].count("\n") for row in rows)
    de_fr = offline_pairs("de-fr", "train", 60, (2, 3), 0.1, 0, {"number": 1.0})
    from num2words import num2words

    numbers = {num2words(n, lang="de"): num2words(n, lang="fr") for n in range(10, 1000)}
    pairs = [(s, t) for row in de_fr for s, t in zip(row["source"].split("\n"), row["target"].split("\n"))]
    small = [(s, t) for s, t in pairs if s in numbers]
    assert small and all(numbers[s] == t for s, t in small)  # the same number in both languages
    held_out = {line for row in offline_pairs("de-en", "test", 200, (2, 4), 0.1, 0, {"number": 1.0})
                for line in row["source"].split("\n")}  # fmt: skip
    for pair, side in (("en-de", "target"), ("de-fr", "source")):
        trained = {line for row in offline_pairs(pair, "train", 1000, (2, 4), 0.1, 0, {"number": 1.0})
                   for line in row[side].split("\n")}  # fmt: skip
        assert trained and not trained & held_out, pair


def test_pairs_outside_the_corpus_are_refused_with_what_it_has():
    for pair in ("en-en", "de-xx", "deen"):
        with pytest.raises(ValueError, match="pairs between two different languages of"):
            offline_pairs(pair, "train", 1)


def test_an_english_source_prompt_names_both_languages(tiny_tokenizer):
    assert task_prefix("en-de") == "Translate English to German: "
    assert task_prefix("de-fr") == "Translate German to French: "
