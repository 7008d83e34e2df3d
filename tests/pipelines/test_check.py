"""`polydraft check` and the check at the start of `polydraft run`: every data source of the enabled stages
opened through the stage's own reader (config, split, field mapping), every model reference loaded and
compared, one prompt rendered; every problem reported at once with exit 2, before any stage starts; a hub
reference that cannot be reached offline is said to be unchecked, not an error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from polydraft.models.folders import MIRROR_ENV
from polydraft.pipelines.cli.main import main


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def hub_dataset(mirror: Path, repo: str, configs: dict[str, dict[str, list[dict]]]) -> None:
    """A dataset repository as the hub holds one without a script: data files per config and split, and
    the README's `configs` header that maps them (what `datasets.load_dataset(repo, config, split=...)` reads)."""
    folder = mirror / "datasets" / repo
    header = []
    for config, splits in configs.items():
        files = []
        for split, rows in splits.items():
            write_jsonl(folder / config / f"{split}.jsonl", rows)
            files.append({"split": split, "path": f"{config}/{split}.jsonl"})
        header.append({"config_name": config, "data_files": files})
    (folder / "README.md").write_text(
        "---\n" + yaml.safe_dump({"configs": header}) + "---\n", encoding="utf-8"
    )


def recipe_file(tmp_path: Path, target: Path, data: dict, **blocks) -> Path:
    recipe = {"target": {"path": str(target)}, "data": {"pairs": ["de-en"], **data}, **blocks}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return path


def small_vocab_drafter(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


PROMPTS = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(4)]


def test_every_problem_is_reported_at_once_with_the_columns_and_first_row(
    tmp_path, tiny_target_dir, monkeypatch, capsys
):
    mirror = tmp_path / "mirror"
    hub_dataset(mirror, "org/quiz", {"main": {"test": PROMPTS}})
    monkeypatch.setenv(MIRROR_ENV, str(mirror))
    texts = write_jsonl(tmp_path / "texts.jsonl", [{"text": f"Satz {i}."} for i in range(5)])
    data = {
        "distill": [
            {"kind": "local", "format": "prompts", "path": str(texts), "fields": {"prompt": "text"}},
            {"kind": "local", "format": "prompts", "path": str(texts), "fields": {"prompt": "body"}},
        ],
        "eval": [
            {"kind": "hf", "format": "prompts", "path": "org/quiz", "name": "nope", "split": "test",
             "fields": {"prompt": "question"}},
            {"kind": "hf", "format": "prompts", "path": "org/quiz", "name": "main", "split": "validation",
             "fields": {"prompt": "question"}},
            {"kind": "hf", "format": "prompts", "path": "org/quiz", "name": "main", "split": "test",
             "fields": {"prompt": "question"}},
        ],
    }  # fmt: skip
    drafter = small_vocab_drafter(tmp_path / "drafter")
    recipe = recipe_file(tmp_path, tiny_target_dir, data, measure={"extra_drafters": {"small": str(drafter)}})
    assert main(["check", str(recipe)]) == 2
    out = capsys.readouterr().out
    blocks = {}
    for block in out.split("\n\n")[0].split("\n"):
        if block and not block.startswith(" "):
            status, key = block.split()[:2]
            blocks[key] = status
    assert blocks == {
        "data.distill.0": "ok", "data.distill.1": "problem", "data.eval.0": "problem", "data.eval.1": "problem",
        "data.eval.2": "ok", "target.path": "ok", "measure.extra_drafters.small": "problem",
        "distill.prompt_format": "ok", "disk": "ok",
    }  # fmt: skip
    assert "row 0: field 'body' is missing or empty" in out
    assert "its columns: ['text']; its first row: {'text': 'Satz 0.'}" in out
    assert "'nope'" in out and "'main'" in out  # the config asked for and the ones that exist
    assert "validation" in out and "test" in out
    assert "vocabulary of 300 tokens but the target has 512" in out
    assert "9 inputs: 4 problem(s), 0 not checked (offline)" in out


def test_an_unreachable_hub_reference_is_not_checked_and_not_an_error(tmp_path, tiny_target_dir, capsys):
    # the suite runs with HF_HUB_OFFLINE=1 (tests/conftest.py): the hub is not asked
    data = {"eval": [{"kind": "hf", "format": "prompts", "path": "org/not-mirrored", "split": "test"}]}
    recipe = recipe_file(tmp_path, tiny_target_dir, data, measure={"extra_drafters": {"hub": "org/drafter"}})
    assert main(["check", str(recipe)]) == 0
    out = capsys.readouterr().out
    assert "not checked (offline) data.eval.0  hf:org/not-mirrored[test]" in out
    assert "not checked (offline) measure.extra_drafters.hub  org/drafter" in out
    assert out.count("not checked (offline)") == 3  # the dataset, the drafter and the summary line
    assert "0 problem(s), 2 not checked (offline)" in out


def test_run_stops_before_any_stage_when_an_input_is_wrong(tmp_path, tiny_target_dir, capsys):
    texts = write_jsonl(tmp_path / "texts.jsonl", [{"text": "Hallo."}])
    data = {
        "distill": [{"kind": "local", "format": "prompts", "path": str(texts), "fields": {"prompt": "body"}}],
        "eval": [{"kind": "local", "format": "prompts", "path": str(tmp_path / "missing.jsonl")}],
    }
    recipe = recipe_file(tmp_path, tiny_target_dir, data)
    run_dir = tmp_path / "run"
    assert main(["run", str(recipe), "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "2 problem(s) in the recipe's inputs, found before any stage ran" in err
    assert "- data.distill.0: local:" in err and "field 'body' is missing" in err
    assert "- data.eval.0 (local:" in err and "missing.jsonl: no .jsonl/.json/.parquet file found" in err
    assert not run_dir.exists() or not any(run_dir.glob("distill*"))


# ----------------------------------------------------------------------------- the shipped recipes


@pytest.fixture(scope="module")
def mirror(tmp_path_factory):
    from tests.hub_fixtures import build_mirror

    return build_mirror(tmp_path_factory.mktemp("hub"))


def shipped() -> list:
    from polydraft.pipelines.run.recipe import shipped_recipes
    from polydraft.pipelines.runtime.contract import PROJECT_ROOT

    return list(shipped_recipes(PROJECT_ROOT / "recipes"))


@pytest.mark.parametrize("name", [r.name for r in shipped()])
def test_every_shipped_recipe_reads_its_datasets_as_their_cards_describe_them(name, mirror, monkeypatch):
    """Every data source of every shipped recipe against the local copies of its datasets (real configs,
    splits and columns: tests/hub_fixtures.py); the models stay unchecked (offline)."""
    from polydraft.pipelines.run.preflight import check_recipe, recipe_sources
    from polydraft.pipelines.run.recipe import load_recipe
    from polydraft.pipelines.runtime.target import resolve_target

    monkeypatch.setenv(MIRROR_ENV, str(mirror))
    (recipe_path,) = [r.path for r in shipped() if r.name == name]
    recipe = load_recipe(recipe_path)
    target = resolve_target(recipe.target, recipe.data, show_progress=False, build=False)
    findings = check_recipe(recipe, target)
    sources = [f for f in findings if f.key.startswith("data.")]
    assert len(sources) == len(recipe_sources(recipe)) > 0
    assert [f for f in sources if f.status != "ok"] == []


def test_wrong_references_of_real_datasets_are_problems(
    tmp_path, tiny_target_dir, mirror, monkeypatch, capsys
):
    """What the shipped recipes used to say: WMT22-Test's `ja-en` (no such config), xsum without its
    parquet revision (a script), wmt19's `test` split (none); and a field path that is not there."""
    monkeypatch.setenv(MIRROR_ENV, str(mirror))
    translation = {"kind": "hf", "format": "translation", "pair": "de-en", "split": "test"}
    data = {
        "eval": [
            {**translation, "path": "haoranxu/WMT22-Test", "name": "ja-en", "fields": {"source": "ja-en.ja", "target": "ja-en.en"}},
            {"kind": "hf", "format": "prompts", "path": "EdinburghNLP/xsum", "split": "test", "fields": {"prompt": "document"}},
            {**translation, "path": "wmt/wmt19", "name": "zh-en", "fields": {"source": "translation.zh", "target": "translation.en"}},
            {**translation, "path": "wmt/wmt16", "name": "de-en", "fields": {"source": "translation.fr", "target": "translation.en"}},
            {"kind": "hf", "format": "prompts", "path": "EdinburghNLP/xsum", "revision": "refs/convert/parquet", "split": "test", "fields": {"prompt": "document"}},
        ]
    }  # fmt: skip
    recipe = recipe_file(tmp_path, tiny_target_dir, data)
    assert main(["check", str(recipe)]) == 2
    out = capsys.readouterr().out
    assert "BuilderConfig 'ja-en' not found" in out
    assert "xsum.py" in out or "script" in out.lower()
    assert "Bad split: test. Available splits: ['train', 'validation']" in out
    assert "field 'translation.fr' is missing or empty" in out and "its columns: ['translation']" in out
    assert "4 problem(s)" in out


def test_eagle3_layers_and_draft_vocabulary_are_checked_against_the_target(tmp_path, tiny_target_dir, capsys):
    """The tiny target has 4 layers: the default feature layers (2, 2, 1) cannot be a head's; a draft
    vocabulary below the 256 byte tokens and the specials cannot hold what every one keeps."""
    texts = write_jsonl(tmp_path / "texts.jsonl", [{"text": "Hallo."}])
    data = {
        "distill": [{"kind": "local", "format": "prompts", "path": str(texts), "fields": {"prompt": "text"}}]
    }
    recipe = recipe_file(tmp_path, tiny_target_dir, data, eagle3={"enabled": True})
    assert main(["check", str(recipe)]) == 2
    out = capsys.readouterr().out
    assert "problem  eagle3.aux_layers  feature layers [2, 2, 1]" in out and "strictly increasing" in out
    recipe = recipe_file(
        tmp_path,
        tiny_target_dir,
        data,
        eagle3={"enabled": True, "aux_layers": [1, 2, 3], "draft_vocab_size": 100},
    )
    assert main(["check", str(recipe)]) == 2
    assert "below the 260 special and byte tokens every draft vocabulary keeps" in capsys.readouterr().out
    recipe = recipe_file(
        tmp_path,
        tiny_target_dir,
        data,
        eagle3={"enabled": True, "aux_layers": [1, 2, 3], "draft_vocab_size": 300},
    )
    assert main(["check", str(recipe)]) == 0
    assert "ok       eagle3  feature layers [1, 2, 3], draft vocabulary 300" in capsys.readouterr().out


def test_wandb_online_without_a_key_or_a_server_is_a_problem_with_its_fix(tmp_path, monkeypatch):
    """Found before the first stage, not when a stage's wandb run starts after hours of distillation."""
    import socket

    from polydraft.pipelines.run.preflight import check_tracking
    from polydraft.pipelines.schema import Recipe

    recipe = Recipe.model_validate({"target": {"path": "org/m"}, "data": {"pairs": ["de-en"]},
                                    "tracking": {"mode": "online"}})  # fmt: skip
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", f"https://127.0.0.1:{server.getsockname()[1]}")
    netrc = tmp_path / "netrc"
    netrc.write_text("")
    monkeypatch.setenv("NETRC", str(netrc))
    missing = check_tracking(recipe)
    assert missing.status == "problem" and "no wandb API key" in missing.detail
    assert "`wandb login`" in missing.detail and "tracking.mode=offline" in missing.detail
    netrc.write_text("machine 127.0.0.1\n  login user\n  password 0123456789abcdef\n")
    found = check_tracking(recipe)
    assert found.status == "ok" and str(netrc) in found.detail
    server.close()  # the server is gone: a compute node without the internet
    monkeypatch.setenv("WANDB_BASE_URL", "https://127.0.0.1:9")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    unreachable = check_tracking(recipe)
    assert unreachable.status == "problem" and "cannot be reached" in unreachable.detail
    offline = recipe.model_copy(update={"tracking": recipe.tracking.model_copy(update={"mode": "offline"})})
    assert check_tracking(offline) is None


def test_a_run_directory_without_room_for_the_run_is_a_problem(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from polydraft.pipelines.plan.disk import disk_estimate
    from polydraft.pipelines.run.preflight import check_disk
    from polydraft.pipelines.run.recipe import load_recipe
    from polydraft.pipelines.runtime.contract import PROJECT_ROOT

    recipe = load_recipe(PROJECT_ROOT / "recipes" / "vicuna-7b" / "en-de.yaml")
    needed = disk_estimate(recipe)
    assert {"distill records and mix", "finetune checkpoints", "eagle3 checkpoints", "eagle3 exports"} <= set(
        needed
    )
    total = sum(needed.values())
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 * total, 0, 2 * total))
    assert check_disk(recipe, tmp_path / "run").status == "ok"
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 * total, 0, total / 2))
    short = check_disk(recipe, tmp_path / "run" / "deeper")
    assert short.status == "problem" and "free some space or choose another --run-dir" in short.detail
    assert f"at {tmp_path.resolve()}" in short.detail  # the nearest folder that exists


def test_more_training_processes_per_node_than_its_gpus_is_a_problem():
    """`launch.num_processes` counts one node's processes: a total over two 8-GPU nodes written as 16 (what
    accelerate's own flag means) would start 32; on an 8-GPU node the check says so."""
    from polydraft.pipelines.run.preflight import check_launch
    from polydraft.pipelines.schema import Recipe

    def recipe(count):
        return Recipe.model_validate({"target": {"path": "org/m"}, "data": {"pairs": ["de-en"]},
                                      "launch": {"num_processes": count}})  # fmt: skip

    problem = check_launch(recipe(16), 8)
    assert problem.status == "problem" and "set it to at most 8" in problem.detail
    assert check_launch(recipe(8), 8).status == "ok"
    assert check_launch(recipe(16), 0) is None  # no GPU: the CPU runs gloo ranks, any count
    assert check_launch(recipe(None), 8) is None
