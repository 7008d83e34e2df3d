"""The tokenized mix cache (`train.mix_cache`): the examples, order, labels and drop count of the old
per-process path (`read_mix` + `encode_rows`), made once and read back without tokenizing again."""

from __future__ import annotations

from contextlib import nullcontext

import pytest

from polydraft.data.mix import mix_pairs, mix_path, read_mix
from polydraft.train import mix_cache
from polydraft.train.data import encode_rows
from tests.distill_setup import write_jsonl
from tests.drafter_setup import write_tiny_mix


def cached(distill, tokenizer, cache_dir, split="train", **options):
    settings = {"temperatures": [0.0], "loss_on": "response", "max_length": 128} | options
    return mix_cache.load_examples(
        distill, tokenizer, split, cache_dir=cache_dir, main_process_first=nullcontext, **settings
    )


def reference(distill, tokenizer, split, temperatures, loss_on, max_length):
    rows = [row for pair in mix_pairs(distill) for row in read_mix(distill, pair, split, temperatures)]
    examples, dropped = encode_rows(tokenizer, rows, max_length)
    if loss_on == "all":
        examples = [{**e, "labels": list(e["input_ids"])} for e in examples]
    return examples, dropped, len(rows)


@pytest.mark.parametrize(
    ("temperatures", "loss_on", "max_length"),
    [([0.0], "response", 80), ([0.0, 1.0], "all", 128), (None, "response", 128)],
)
def test_cached_examples_are_those_of_the_per_process_encoding(
    tmp_path, tiny_tokenizer, temperatures, loss_on, max_length
):
    distill = write_tiny_mix(tmp_path / "distill", ["de-en", "fr-en"], train_rows=24, eval_rows=4)
    mix = cached(
        distill, tiny_tokenizer, tmp_path / "cache", temperatures=temperatures, loss_on=loss_on,
        max_length=max_length,
    )  # fmt: skip
    examples, dropped, rows = reference(distill, tiny_tokenizer, "train", temperatures, loss_on, max_length)
    assert len(examples) > 0 and mix.examples.to_list() == examples
    assert (mix.rows, mix.dropped) == (rows, dropped)
    if max_length == 80:  # a short max_length truncates some prompts past their response
        assert dropped > 0


def test_a_second_process_reads_the_cache_without_tokenizing_and_a_changed_mix_tokenizes_anew(
    tmp_path, tiny_tokenizer, monkeypatch
):
    distill = write_tiny_mix(tmp_path / "distill", ["de-en"], train_rows=8, eval_rows=2)
    first = cached(distill, tiny_tokenizer, tmp_path / "cache")
    made = sorted((tmp_path / "cache").glob("train-*.arrow"))
    assert len(made) == 1 and [f["filename"] for f in first.examples.cache_files] == [str(made[0])]

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(mix_cache, "encode_texts", no_tokenizing)
    again = cached(distill, tiny_tokenizer, tmp_path / "cache")
    assert again.examples.to_list() == first.examples.to_list()
    assert (again.rows, again.dropped) == (first.rows, first.dropped)

    path = mix_path(distill, "de-en", "train")
    path.write_text(path.read_text().replace("Chat.", "Talk."))
    with pytest.raises(AssertionError, match="tokenized again"):
        cached(distill, tiny_tokenizer, tmp_path / "cache")


def test_a_mix_without_a_distilled_row_is_refused_for_finetuning(tmp_path, tiny_tokenizer):
    row = {"pair": "de-en", "prompt": "p", "response": "r", "sample_index": 0}
    write_jsonl(
        mix_path(tmp_path, "de-en", "train"),
        [{**row, "id": "a", "origin": "open", "temperature": None},
         {**row, "id": "b", "origin": "distill", "temperature": 1.0}],
    )  # fmt: skip
    kept = cached(tmp_path, tiny_tokenizer, tmp_path / "cache", temperatures=[1.0], need_distilled=True)
    assert (kept.rows, kept.distilled) == (2, 1)
    with pytest.raises(
        ValueError, match=r"train.jsonl: no distilled row at temperatures \[0.0\] \(1 open rows"
    ):
        cached(tmp_path, tiny_tokenizer, tmp_path / "cache", temperatures=[0.0], need_distilled=True)


def test_a_big_mix_tokenized_by_several_processes_gives_the_same_examples_in_order(
    tmp_path, tiny_tokenizer, monkeypatch
):
    distill = write_tiny_mix(tmp_path / "distill", ["de-en", "fr-en"], train_rows=24, eval_rows=4)
    one = cached(distill, tiny_tokenizer, tmp_path / "one")
    monkeypatch.setattr(mix_cache, "PARALLEL_BYTES", 0)  # every mix counts as big
    monkeypatch.setattr(mix_cache.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert mix_cache.tokenize_processes(1) == 3
    several = cached(distill, tiny_tokenizer, tmp_path / "several")
    assert len(several.examples.cache_files) == 3  # three shards, one per process
    assert several.examples.to_list() == one.examples.to_list()
    assert (several.rows, several.dropped) == (one.rows, one.dropped)
