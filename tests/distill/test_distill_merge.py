"""Sharded distillation: shards split the prompts, `merge_shards` joins them and refuses gaps,
duplicates, foreign records and missing shards; and the record store's crash handling."""

from __future__ import annotations

import json

import pytest

from polydraft.data.mix import read_mix
from polydraft.distill.merge import MergeError, merge_shards
from polydraft.distill.store import RecordStore, StoreError, iter_records, record_files, record_key
from tests.distill_setup import local_source, make_recipe, run_distill, translation_file

PROMPTS = 20
"""A prompt's shard is a hash of its id, which holds the data file's temporary path: with 6 prompts one
shard came out empty in ~3% of paths (it did on a CI machine); with 20, in ~2 of a million."""


@pytest.fixture(scope="module")
def shards(tmp_path_factory, tiny_target_dir):
    """Two shards of one distillation (PROMPTS prompts, greedy + 1 sample at T=1), with an open source."""

    root = tmp_path_factory.mktemp("shards")
    data = translation_file(root, PROMPTS)
    folders = []
    for index in range(2):
        recipe = make_recipe(
            tiny_target_dir,
            [local_source(data)],
            samples_per_prompt=1,
            max_new_tokens=3,
            num_shards=2,
            shard_index=index,
            open_fraction=0.5,
            data={"open": [local_source(data)]},
        )
        work = root / f"shard{index}" / "distill"
        run_distill(recipe, tiny_target_dir, work)
        folders.append(work)
    return data, folders


def test_shards_split_the_prompts_and_merge_into_one_complete_folder(tmp_path, shards):
    data, folders = shards
    per_shard = [{record_key(r) for r in iter_records(f)} for f in folders]
    assert per_shard[0] and per_shard[1] and not per_shard[0] & per_shard[1]
    expected = {(f"0:local:{data}/train/{i}", t, 0) for i in range(PROMPTS) for t in (0.0, 1.0)}
    assert per_shard[0] | per_shard[1] == expected

    summary = merge_shards(folders, tmp_path / "merged")
    merged = tmp_path / "merged"
    keys = [record_key(r) for r in iter_records(merged)]
    assert len(keys) == len(set(keys)) and set(keys) == expected
    assert summary["records"] == 2 * PROMPTS and summary["shards"] == 2 and summary["prompts"] == PROMPTS
    rows = read_mix(merged, "de-en", "train") + read_mix(merged, "de-en", "eval")
    assert sum(r["origin"] == "distill" for r in rows) == 2 * PROMPTS
    opened = [r["id"] for r in rows if r["origin"] == "open"]
    assert len(opened) == len(set(opened)) > 0  # shards never pick the same open row
    assert json.loads((merged / "plan.json").read_text())["num_shards"] == 1


def _copy(folders, tmp_path):
    import shutil

    copies = []
    for i, folder in enumerate(folders):
        copies.append(tmp_path / f"copy{i}")
        shutil.copytree(folder, copies[-1])
    return copies


def test_merge_lists_missing_and_duplicated_records(tmp_path, shards):
    _, folders = shards
    first, second = _copy(folders, tmp_path)
    path = record_files(first)[0]
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[1:]))  # a record lost
    extra = record_files(second)[0]
    extra.write_text(extra.read_text() + extra.read_text().splitlines(keepends=True)[0])  # one twice
    with pytest.raises(MergeError) as err:
        merge_shards([first, second], tmp_path / "merged")
    message = str(err.value)
    lost = json.loads(lines[0])["id"]
    assert f"{first}: 1 records missing ({lost})" in message
    assert f"{second}: 1 records written twice" in message
    assert not (tmp_path / "merged").exists()


def test_merge_refuses_an_absent_or_repeated_shard(tmp_path, shards):
    _, folders = shards
    with pytest.raises(MergeError, match=r"shards missing: \[1\] of 0..1"):
        merge_shards([folders[0]], tmp_path / "a")
    with pytest.raises(MergeError, match=r"shard index given by more than one folder: \[0\]"):
        merge_shards([folders[0], folders[0]], tmp_path / "b")
    with pytest.raises(MergeError, match="exists already"):
        merge_shards(folders, folders[0])


def test_merge_names_a_corrupt_record_by_file_and_line(tmp_path, shards):
    _, folders = shards
    first, second = _copy(folders, tmp_path)
    path = record_files(first)[0]
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + '{"id": "x", "text": "valid JSON, not a record"}\n' + "".join(lines[1:]))
    bad = record_files(second)[0]
    bad.write_bytes(bad.read_bytes().replace(b'"response": "', b'"response": "\xff', 1))
    with pytest.raises(MergeError) as err:
        merge_shards([first, second], tmp_path / "merged")
    message = str(err.value)
    assert f"{path}:2: not a distill record: missing or mistyped prompt_id, pair, prompt" in message
    assert f"{bad}:1: not UTF-8 (byte 0xff" in message
    assert not (tmp_path / "merged").exists()


def record(index: int) -> dict:
    return {
        "id": f"r{index}",
        "prompt_id": f"p{index}",
        "pair": "de-en",
        "prompt": "p",
        "temperature": 0.0,
        "sample_index": 0,
        "response": "r",
        "finish_reason": "stop",
        "prompt_tokens": 1,
        "response_tokens": 1,
    }


def test_store_names_a_record_line_of_the_wrong_shape(tmp_path):
    store = RecordStore(tmp_path, shard_index=0, records_per_file=5)
    store.append([record(0), {**record(1), "sample_index": "0"}, [1, 2]])
    store.close()
    path = record_files(tmp_path)[0]
    with pytest.raises(StoreError, match=f"{path}:2: not a distill record: missing or mistyped sample_index"):
        RecordStore(tmp_path, 0, 5).keys()
    path.write_text(json.dumps(record(0)) + "\n[1, 2]\n")
    with pytest.raises(StoreError, match=f"{path}:2: a record is a JSON object, got list"):
        RecordStore(tmp_path, 0, 5).keys()


def test_store_cuts_a_torn_tail_and_refuses_a_key_written_twice(tmp_path):
    store = RecordStore(tmp_path, shard_index=0, records_per_file=2)
    records = [record(i) for i in range(3)]
    store.append(records)
    store.close()
    files = record_files(tmp_path)
    assert [len(p.read_text().splitlines()) for p in files] == [2, 1]  # rotated after 2 records
    with open(files[-1], "a") as handle:
        handle.write('{"id": "r3", "prompt')
    assert RecordStore(tmp_path, 0, 2).repair() == len('{"id": "r3", "prompt')
    assert RecordStore(tmp_path, 0, 2).keys() == {(f"p{i}", 0.0, 0) for i in range(3)}

    again = RecordStore(tmp_path, 0, 2)
    again.append(records[:1])
    again.close()
    assert len(record_files(tmp_path)) == 3  # a new run appends to a new part file
    with pytest.raises(StoreError, match="written twice"):
        RecordStore(tmp_path, 0, 2).keys()
