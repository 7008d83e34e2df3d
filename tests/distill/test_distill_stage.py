"""The distill stage end to end with the `hf` backend on the tiny target, resume after `kill -9`,
invalid rows, and the refusal to mix two configurations in one work dir."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from polydraft.data.mix import read_mix
from polydraft.data.prompts import vicuna_prompt
from polydraft.distill.requests import record_id
from polydraft.distill.store import iter_records, record_files, record_key
from polydraft.pipelines.runtime.contract import StageFailed
from tests.distill_setup import (
    PROJECT_ROOT,
    local_source,
    make_recipe,
    run_distill,
    translation_file,
    write_jsonl,
)


def keys_of(work_dir: Path) -> list[tuple]:
    return [record_key(r) for r in iter_records(work_dir)]


def test_hf_backend_end_to_end(tmp_path, tiny_target_dir, caplog):
    """Every (prompt, temperature, sample) once, with the exact prompt, token ids, metrics and the mix,
    and progress lines with the total."""
    import datasets

    data = translation_file(tmp_path, 4)
    recipe = make_recipe(tiny_target_dir, [local_source(data)], eval_fraction=0.25, stop=["xyz"])
    work = tmp_path / "run" / "distill"
    with caplog.at_level("INFO", logger="polydraft.train.progress"):
        result = run_distill(recipe, tiny_target_dir, work, quiet=False)
    lines = [r.getMessage() for r in caplog.records if r.name == "polydraft.train.progress"]
    assert lines[-1].startswith("[distill] generated 12/12 samples (100%), ")
    assert all(
        re.fullmatch(r"\[distill\] generated \d+/12 samples \(\d+%\), .* (left|done)", m) for m in lines
    )

    keys = keys_of(work)
    assert len(keys) == len(set(keys)) == 4 * 3  # greedy once + 2 samples at T=1
    assert result.metrics["records"] == 12
    assert (
        result.metrics["records_per_temperature"]["0"] == 4
        and result.metrics["records_per_temperature"]["1"] == 8
    )
    assert result.metrics["failures"] == 0
    assert result.metrics["response_tokens"] > 0 and result.metrics["tokens_per_s"] > 0
    assert result.metrics["truncated_responses"] + result.metrics["empty_responses"] <= 12

    records = list(iter_records(work))
    first = next(r for r in records if r["temperature"] == 0.0)
    german = first["messages"][0]["content"].removeprefix("Translate German to English: ")
    assert first["prompt"] == vicuna_prompt(first["messages"])
    assert first["prompt"].endswith(f"USER: Translate German to English: {german} ASSISTANT:")
    assert first["reference"].startswith("english ")
    assert first["backend"] == "hf" and first["model"] == str(tiny_target_dir)
    assert all(r["response_tokens"] == len(r["token_ids"]) <= 6 for r in records)
    assert {r["finish_reason"] for r in records} <= {"stop", "length"}
    # the two samples at T=1 carry different seeds
    assert len({r["seed"] for r in records if r["prompt_id"] == first["prompt_id"]}) == 3

    loaded = datasets.load_dataset("json", data_files=[str(p) for p in record_files(work)], split="train")
    assert loaded.num_rows == 12 and "token_ids" in loaded.column_names

    train, evaluation = read_mix(work, "de-en", "train"), read_mix(work, "de-en", "eval")
    assert len(train) + len(evaluation) == 12
    # all samples of a prompt fall on one side of the split
    eval_prompts = {r["id"].split("|")[0] for r in evaluation}
    assert not eval_prompts & {r["id"].split("|")[0] for r in train}
    assert result.metrics["mix"]["de-en"]["train"] == len(train)


def test_rerun_skips_done_records_and_open_rows_join_the_mix(tmp_path, tiny_target_dir):

    data = translation_file(tmp_path, 3)
    open_data = write_jsonl(
        tmp_path / "open.jsonl", [{"de": f"offen {i}", "en": f"open {i}"} for i in range(10)]
    )
    recipe = make_recipe(
        tiny_target_dir,
        [local_source(data)],
        temperatures=[0.0],
        open_fraction=1.0,
        data={"open": [local_source(open_data)]},
    )
    work = tmp_path / "run" / "distill"
    run_distill(recipe, tiny_target_dir, work)
    again = run_distill(recipe, tiny_target_dir, work)
    assert again.metrics["generated_this_run"] == 0
    assert len(keys_of(work)) == 3
    rows = read_mix(work, "de-en", "train") + read_mix(work, "de-en", "eval")
    assert sum(r["origin"] == "open" for r in rows) == 3  # open_fraction 1.0 x 3 distilled records
    opened = next(r for r in rows if r["origin"] == "open")
    assert opened["prompt"].endswith(" ASSISTANT:") and opened["response"].startswith("open ")
    assert opened["temperature"] is None


def test_changed_config_in_same_work_dir_is_refused(tmp_path, tiny_target_dir):

    data = translation_file(tmp_path, 2)
    work = tmp_path / "run" / "distill"
    run_distill(
        make_recipe(tiny_target_dir, [local_source(data)], temperatures=[0.0]),
        tiny_target_dir,
        work,
    )
    changed = make_recipe(tiny_target_dir, [local_source(data)], temperatures=[0.0], max_new_tokens=3)
    with pytest.raises(StageFailed, match="another distill configuration"):
        run_distill(changed, tiny_target_dir, work)
    # operational fields (batch size, mix fractions) may change and still resume
    resumed = make_recipe(
        tiny_target_dir, [local_source(data)], temperatures=[0.0], batch_size=1, eval_fraction=0.5
    )
    assert run_distill(resumed, tiny_target_dir, work).metrics["generated_this_run"] == 0


def test_invalid_row_error_names_source_row_and_field(tmp_path, tiny_target_dir):

    rows = [{"de": "Hallo", "en": "hello"}, {"de": "", "en": "empty"}, {"en": "no source"}]
    data = write_jsonl(tmp_path / "bad.jsonl", rows)
    work = tmp_path / "run" / "distill"
    with pytest.raises(StageFailed) as err:
        run_distill(make_recipe(tiny_target_dir, [local_source(data)]), tiny_target_dir, work)
    message = str(err.value)
    assert f"local:{data}" in message and "field 'de'" in message
    assert "row 1" in message or "row 2" in message
    assert "skip_invalid" in message

    result = run_distill(
        make_recipe(tiny_target_dir, [local_source(data, skip_invalid=True)], temperatures=[0.0]),
        tiny_target_dir,
        tmp_path / "run2" / "distill",
    )
    assert result.metrics["invalid_rows"] == 2
    assert result.metrics["prompts"] == 1 and result.metrics["records"] == 1


def test_chat_and_prompt_sources_go_to_the_chat_mix(tmp_path, tiny_target_dir):

    conversations = [
        {
            "id": "c1",
            "conversations": [
                {"from": "human", "value": "Hi"},
                {"from": "gpt", "value": "Hello!"},
                {"from": "human", "value": "Name a colour"},
                {"from": "gpt", "value": "Blue"},
            ],
        }
    ]
    chat = write_jsonl(tmp_path / "chat.jsonl", conversations)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"text": "Write a haiku"}])
    sources = [
        {"kind": "local", "format": "chat", "path": str(chat)},
        {"kind": "local", "format": "prompts", "path": str(prompts), "fields": {"prompt": "text"}},
    ]
    work = tmp_path / "run" / "distill"
    run_distill(
        make_recipe(tiny_target_dir, sources, temperatures=[0.0], eval_fraction=0.0),
        tiny_target_dir,
        work,
    )
    records = {r["prompt_id"]: r for r in iter_records(work)}
    assert set(records) == {"0:c1#0", "0:c1#2", "1:local:" + str(prompts) + "/train/0"}
    second_turn = records["0:c1#2"]
    # the second assistant turn is regenerated given the first exchange as it is in the data
    assert second_turn["prompt"] == (
        vicuna_prompt([]).removesuffix("ASSISTANT:")
        + "USER: Hi ASSISTANT: Hello!</s>USER: Name a colour ASSISTANT:"
    )
    assert second_turn["reference"] == "Blue" and second_turn["pair"] == "chat"
    assert len(read_mix(work, "chat", "train")) == 3


# ----------------------------------------------------------------------------- kill -9 and resume


def test_kill_mid_run_then_rerun_writes_every_record_exactly_once(tmp_path, tiny_target_dir):

    data = translation_file(tmp_path, 16)
    recipe = make_recipe(
        tiny_target_dir, [local_source(data)], samples_per_prompt=1, batch_size=1, max_new_tokens=8
    )
    work = tmp_path / "run" / "distill"
    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps(
            {"recipe": recipe.model_dump(mode="json"), "target": str(tiny_target_dir), "work": str(work)}
        )
    )
    code = "import sys; from tests.distill_setup import run_stage_from_json; run_stage_from_json(sys.argv[1])"
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    process = subprocess.Popen([sys.executable, "-c", code, str(spec)], env=env, cwd=PROJECT_ROOT)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and process.poll() is None:
            if sum(len(p.read_bytes().splitlines()) for p in record_files(work)) >= 3:
                break
            time.sleep(0.05)
        assert process.poll() is None, "the stage ended before it could be killed"
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.wait()
    assert process.returncode == -signal.SIGKILL
    written_before = len(keys_of(work))
    assert 0 < written_before < 16 * 2
    # a kill in the middle of a write leaves a torn last line: the rerun must cut it, not choke on it
    with open(record_files(work)[-1], "a", encoding="utf-8") as handle:
        handle.write('{"id": "0:torn|T=1|s=0", "prompt_id": "0:to')

    # the batch size is operational: the rerun may use bigger batches and still resume
    result = run_distill(
        recipe.model_copy(update={"distill": recipe.distill.model_copy(update={"batch_size": 16})}),
        tiny_target_dir,
        work,
    )
    keys = keys_of(work)
    expected = {(f"0:local:{data}/train/{i}", t, 0) for i in range(16) for t in (0.0, 1.0)}
    assert len(keys) == len(set(keys)), "a record was written twice"
    assert set(keys) == expected, "a record is missing"
    assert result.metrics["generated_this_run"] == 16 * 2 - written_before
    assert all(p.read_bytes().endswith(b"\n") for p in record_files(work))
    assert record_id(sorted(expected)[0]) in {r["id"] for r in iter_records(work)}


def test_long_prompts_are_counted_and_answers_fit_the_context(
    tmp_path, tiny_target_dir, tiny_target, tiny_tokenizer
):
    from polydraft.data.prompts import encode_prompt
    from polydraft.distill.hf_backend import generate_hf
    from polydraft.distill.requests import PromptItem, Request

    data = write_jsonl(
        tmp_path / "mixed.jsonl", [{"de": "kurz", "en": "short"}, {"de": "lang " * 100, "en": "long"}]
    )
    recipe = make_recipe(tiny_target_dir, [local_source(data)], temperatures=[0.0], max_prompt_tokens=200)
    result = run_distill(recipe, tiny_target_dir, tmp_path / "run" / "distill")
    assert result.metrics["long_prompts"] == 1 and result.metrics["prompts"] == 1

    # the engine's context caps prompt + answer: the answer ends with `length` where the context ends
    ids = encode_prompt(tiny_tokenizer, "USER: Hallo ASSISTANT:")
    item = PromptItem("p", "s", "de-en", [], "USER: Hallo ASSISTANT:", prompt_ids=ids)
    answers = []
    generate_hf(
        tiny_target, tiny_tokenizer, [Request(item, 0.0, [0])], top_p=1.0, max_new_tokens=10, stop=[],
        stop_token_ids=[tiny_tokenizer.eos_token_id], seed=0, batch_size=1, emit=lambda r, s, g: answers.append(g), max_length=len(ids) + 2,
    )  # fmt: skip
    assert len(answers[0].token_ids) <= 2
    assert answers[0].finish_reason == "length" or answers[0].token_ids[-1] == tiny_tokenizer.eos_token_id


def test_the_hf_backend_stops_at_the_stop_token_ids(tiny_target, tiny_tokenizer):
    """An end-of-turn id that is not the EOS ends the answer there (finish `stop`), the token kept in the
    ids and left out of the text, as vLLM does."""
    from polydraft.data.prompts import encode_prompt
    from polydraft.distill.hf_backend import generate_hf
    from polydraft.distill.requests import PromptItem, Request

    ids = encode_prompt(tiny_tokenizer, "USER: Hallo ASSISTANT:")
    item = PromptItem("p", "s", "de-en", [], "USER: Hallo ASSISTANT:", prompt_ids=ids)

    def answer(stops: list[int]):
        out = []
        generate_hf(
            tiny_target, tiny_tokenizer, [Request(item, 0.0, [0])], top_p=1.0, max_new_tokens=16, stop=[],
            stop_token_ids=stops, seed=0, batch_size=1, emit=lambda r, s, g: out.append(g),
        )  # fmt: skip
        return out[0]

    free = answer([tiny_tokenizer.eos_token_id])
    assert len(free.token_ids) > 1 and free.token_ids[0] != tiny_tokenizer.eos_token_id
    cut = answer([tiny_tokenizer.eos_token_id, free.token_ids[0]])  # the first token ends the turn
    assert cut.token_ids == free.token_ids[:1] and cut.finish_reason == "stop" and cut.text == ""


GEMMA_STYLE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}<start_of_turn>model\n"
)


def test_a_target_that_ends_its_turn_with_end_of_turn_stops_there(tmp_path, tiny_target, tiny_tokenizer):
    """A tiny target whose chat template ends turns with `<end_of_turn>` (Gemma's), a token its generation
    config does not list as EOS, and which says it first: the stage stops its answers there by itself;
    with `distill.stop_token_ids: []` they run on past it."""
    import copy

    import torch

    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<end_of_turn>", "<start_of_turn>"]})
    tokenizer.chat_template = GEMMA_STYLE_TEMPLATE
    end = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    data = local_source(translation_file(tmp_path, 1))

    def distill(target: torch.nn.Module, name: str, stops: list[int] | None) -> list[dict]:
        folder = tmp_path / name / "target"
        target.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        recipe = make_recipe(
            folder, [data], prompt_format="chat_template", temperatures=[0.0], max_new_tokens=6,
            stop_token_ids=stops,
        )  # fmt: skip
        run_distill(recipe, folder, tmp_path / name / "distill")
        return list(iter_records(tmp_path / name / "distill"))

    target = copy.deepcopy(tiny_target)
    target.resize_token_embeddings(len(tokenizer))
    (plain,) = distill(target, "plain", [])
    first = plain["token_ids"][0]  # the target's first greedy token becomes <end_of_turn>: head rows swapped
    head = target.get_output_embeddings()  # untied, so that only the output rows move
    head.weight = torch.nn.Parameter(head.weight.detach().clone())
    target.config.tie_word_embeddings = False
    with torch.no_grad():
        head.weight[[first, end]] = head.weight[[end, first]]
    (auto,) = distill(target, "auto", None)
    assert auto["token_ids"] == [end] and auto["finish_reason"] == "stop"
    (none,) = distill(target, "none", [])
    assert none["token_ids"][0] == end and len(none["token_ids"]) > 1


def test_hf_processes_answer_their_share_each_and_every_sample_once(tmp_path, tiny_target_dir):
    """`distill.hf.processes: 2`: two generating processes of one thread each, the requests dealt between
    them, every (prompt, temperature, sample) written once, by the process it was dealt to."""
    data = translation_file(tmp_path, 6)
    one = run_distill(
        make_recipe(tiny_target_dir, [local_source(data)]), tiny_target_dir, tmp_path / "one" / "distill"
    )
    work = tmp_path / "two" / "distill"
    two = run_distill(
        make_recipe(tiny_target_dir, [local_source(data)], hf={"processes": 2}), tiny_target_dir, work
    )
    keys = keys_of(work)
    assert len(keys) == len(set(keys)) == 6 * 3 and set(keys) == set(keys_of(tmp_path / "one" / "distill"))
    assert two.metrics["records"] == one.metrics["records"] == 18 and two.metrics["failures"] == 0
    for engine in (0, 1):
        written = [
            r for f in record_files(work) if f"-engine{engine:02d}-" in f.name for r in iter_records_of(f)
        ]
        assert len(written) == 9  # 3 of the 6 prompts, each greedy once and sampled twice
    assert {r["backend"] for r in iter_records(work)} == {"hf"}


def iter_records_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
