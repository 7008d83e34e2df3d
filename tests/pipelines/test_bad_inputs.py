"""Bad recipe values are refused when the recipe loads: exit 2, the file or override that set the value, the
key path and what is allowed (never a run that fails later, or silently does the wrong thing)."""

import json
import re
import struct
from pathlib import Path

import pytest

from polydraft.data.sources import SourceError, read_source
from polydraft.models.folders import ModelFolderError, check_model_folder, is_local
from polydraft.pipelines.cli.main import main
from polydraft.pipelines.run.recipe import RecipeError, load_recipe

BASE = """
target:
  path: org/some-model
data:
  pairs: [de-en, fr-en]
  distill:
    - {kind: offline, pair: de-en, limit: 10}
distill:
  temperatures: [0.0, 0.5, 1.0]
finetune:
  temperatures: [0.0, 0.5]
"""

# (override, key path in the message, fragment of what is allowed)
BAD_VALUES = [
    ("finetune.optim.lr=-1e-4", "finetune.optim.lr", "greater than 0, got -0.0001"),
    ("pretrain.optim.weight_decay=-0.1", "pretrain.optim.weight_decay", "greater than or equal to 0"),
    ("early_exit.optim.warmup_ratio=1.5", "early_exit.optim.warmup_ratio", "less than or equal to 1"),
    ("calibrate.optim.max_grad_norm=-1", "calibrate.optim.max_grad_norm", "greater than or equal to 0"),
    ("finetune.optim.betas=[0.9]", "finetune.optim.betas", "two values in [0, 1)"),
    ("finetune.optim.betas=[0.9, 1.0]", "finetune.optim.betas", "two values in [0, 1)"),
    ("finetune.loop.epochs=0", "finetune.loop.epochs", "greater than 0"),
    ("finetune.loop.max_steps=0", "finetune.loop.max_steps", "greater than or equal to 1"),
    ("pretrain.token_budget=0", "pretrain.token_budget", "greater than or equal to 1"),
    ("finetune.kd_top_k=0", "finetune.kd_top_k", "greater than or equal to 1"),
    ("finetune.kd_weight=-1", "finetune.kd_weight", "greater than or equal to 0"),
    ("pretrain.drafter.num_layers=0", "pretrain.drafter.num_layers", "greater than or equal to 1"),
    (
        "pretrain.drafter={arch: custom, hidden_size: 100, num_layers: 1, num_heads: 3, intermediate_size: 8}",
        "pretrain.drafter.hidden_size",
        "multiple of num_heads 3",
    ),
    (
        "data.distill=[{kind: offline, pair: de-en, limit: 0}]",
        "data.distill.0.limit",
        "greater than or equal",
    ),
    ("data.pairs=[de-en, de-en]", "data.pairs", "'de-en' appears twice"),
    ("data.offline.test_fraction=0", "data.offline.test_fraction", "greater than 0"),
    ("data.offline.samples_per_pair=0", "data.offline.samples_per_pair", "greater than or equal to 1"),
    ("data.eval=[{kind: offline, pair: ru-en}]", "data.eval.0.pair", "not in data.pairs"),
    ("distill.temperatures=[]", "distill.temperatures", "at least 1 item"),
    ("distill.temperatures=[-0.5]", "distill.temperatures.0", "greater than or equal to 0"),
    ("distill.openai.base_urls=[http://a/v1, http://a/v1]", "distill.openai.base_urls", "appears twice"),
    ("finetune.temperatures=[0.0, 0.0]", "finetune.temperatures", "0.0 appears twice"),
    ("finetune.temperatures=[0.7]", "finetune.temperatures", "[0.7] were never distilled"),
    ("early_exit.temperatures=[0.3]", "early_exit.temperatures", "[0.3] were never distilled"),
    ("heads={enabled: true, temperatures: [0.3]}", "heads.temperatures", "[0.3] were never distilled"),
    ("heads.temperatures=[0.0, 0.0]", "heads.temperatures", "0.0 appears twice"),
    ("heads.temperatures=[-0.5]", "heads.temperatures.0", "greater than or equal to 0"),
    ("eagle3={enabled: true, temperatures: [0.3]}", "eagle3.temperatures", "[0.3] were never distilled"),
    ("measure.seeds=[0, 0]", "measure.seeds", "0 appears twice"),
    ("measure.temperatures=[1.0, 1.0]", "measure.temperatures", "1.0 appears twice"),
    ("measure.decoders=[ar, sd, sd]", "measure.decoders", "'sd' appears twice"),
    ("measure.controls=[fixed, fixed]", "measure.controls", "'fixed' appears twice"),
    ("measure.k_sweep=[0]", "measure.k_sweep.0", "greater than or equal to 1"),
    ("measure.eesd_draft_length=0", "measure.eesd_draft_length", "greater than or equal to 1"),
    ("measure.top_p=0", "measure.top_p", "greater than 0"),
    ("measure.num_prompts=0", "measure.num_prompts", "greater than or equal to 1"),
    ("measure.max_prompt_tokens=0", "measure.max_prompt_tokens", "greater than or equal to 1"),
    ("measure.branching=[2, 0]", "measure.branching.1", "greater than or equal to 1"),
    ("measure.cali_theta0=1.5", "measure.cali_theta0", "less than or equal to 1"),
    ("measure.assisted_confidence_threshold=-1", "measure.assisted_confidence_threshold", "greater than"),
    ("measure.beta_prior=[1.0]", "measure.beta_prior", "two positive numbers"),
    ("measure.vllm_batch_sizes=[1, 1]", "measure.vllm_batch_sizes", "1 appears twice"),
    ("measure.vllm_batch_sizes=[0]", "measure.vllm_batch_sizes.0", "greater than or equal to 1"),
    ("launch.num_processes=0", "launch.num_processes", "greater than or equal to 1"),
    ("tracking.tags=[a, a]", "tracking.tags", "'a' appears twice"),
    ("target.bootstrap={}", "target.bootstrap", "set exactly one of target.path and target.bootstrap"),
    ("target={bootstrap: {steps: 0}}", "target.bootstrap.steps", "greater than or equal to 1"),
    ("target={bootstrap: {hidden_size: 130}}", "target.bootstrap.hidden_size", "multiple of num_heads 4"),
]


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize("override,key,allowed", BAD_VALUES, ids=[row[0] for row in BAD_VALUES])
def test_bad_value_names_override_key_and_what_is_allowed(tmp_path, override, key, allowed):
    path = write(tmp_path / "r.yaml", BASE)
    assert load_recipe(path).finetune.temperatures == [0.0, 0.5]  # the base itself is good
    with pytest.raises(RecipeError) as err:
        load_recipe(path, [override])
    message = str(err.value)
    assert f"override `{override}`: {key}" in message and allowed in message


def test_cross_field_errors_blame_the_child_recipe_not_the_base(tmp_path):
    write(tmp_path / "base.yaml", BASE + "measure:\n  decoders: [ar, sd]\n")
    child = write(tmp_path / "child.yaml", "extends: base.yaml\ndistill:\n  temperatures: [0.0, 1.0]\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(child)
    # the child dropped 0.5, which the base's finetune.temperatures still lists
    assert f"{child}: distill.temperatures: finetune.temperatures [0.5] were never distilled" in str(
        err.value
    )
    assert f"finetune.temperatures set in {tmp_path / 'base.yaml'}" in str(err.value)
    child.write_text("extends: base.yaml\nmeasure:\n  decoders: [sd]\n")
    with pytest.raises(RecipeError, match=f"{child}: measure.decoders must include `ar`"):
        load_recipe(child)
    child.write_text("extends: base.yaml\ntarget:\n  bootstrap: {}\n")
    with pytest.raises(RecipeError, match=f"{child}: target.bootstrap: set exactly one"):
        load_recipe(child)


def test_cli_exit_code_2_and_no_traceback(tmp_path, capsys):
    path = write(tmp_path / "r.yaml", BASE)
    assert main(["show", str(path), "data.distill=[{kind: offline, pair: de-en, limit: 0}]"]) == 2
    err = capsys.readouterr().err
    assert "data.distill.0.limit: must be greater than or equal to 1, got 0" in err
    assert "Traceback" not in err


def model_folder(path: Path, weights: bytes | None = None) -> Path:
    """A folder shaped like a Hugging Face model: config.json and a one-tensor model.safetensors."""
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "llama"}')
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    full = struct.pack("<Q", len(header)) + header + bytes(16)
    (path / "model.safetensors").write_bytes(full if weights is None else weights)
    return path


def test_model_folder_checks(tmp_path):
    good = model_folder(tmp_path / "good")
    check_model_folder(str(good))
    whole = (good / "model.safetensors").read_bytes()
    cases = [
        (tmp_path / "nowhere", "no such folder"),
        (good / "config.json", "a file, not a model folder"),
        (
            model_folder(tmp_path / "cut", whole[:-3]),
            "model.safetensors: truncated (83 bytes, its header needs 86)",
        ),
        (model_folder(tmp_path / "head", whole[:20]), "model.safetensors: truncated (header of"),
    ]
    (tmp_path / "bare").mkdir()
    cases.append((tmp_path / "bare", "no config.json (not a Hugging Face model folder)"))
    for path, fragment in cases:
        with pytest.raises(ModelFolderError, match=re.escape(fragment)):
            check_model_folder(str(path))
    assert is_local(str(tmp_path / "nowhere")) and is_local("./x") and not is_local("org/model")


def cli_cases(tmp_path: Path) -> list[tuple[list[str], str]]:
    good = model_folder(tmp_path / "good")
    cut = model_folder(tmp_path / "cut", (good / "model.safetensors").read_bytes()[:-1])
    (tmp_path / "bare").mkdir()
    (tmp_path / "file").write_text("")
    run = ["--run-dir", str(tmp_path / "run")]
    return [
        (
            [f"target.path={tmp_path / 'nowhere'}", *run],
            f"target.path: {tmp_path / 'nowhere'}: no such folder",
        ),
        (
            [f"target.path={tmp_path / 'bare'}", *run],
            "target.path: " + str(tmp_path / "bare") + ": no config",
        ),
        ([f"target.path={cut}", *run], f"target.path: {cut / 'model.safetensors'}: truncated"),
        (
            [
                f"target.path={good}",
                f"finetune.drafter.init={tmp_path / 'bare'}",
                "pretrain.enabled=false",
                *run,
            ],
            "finetune.drafter.init: ",
        ),
        ([f"target.path={good}", "--run-dir", str(tmp_path / "file")], "a file, not a directory"),
        ([f"target.path={good}", "--run-dir", str(tmp_path / "file" / "run")], "cannot write there"),
        # a directory nobody may write in, root included (tests run as root, so chmod proves nothing)
        (
            [f"target.path={good}", "--run-dir", "/sys/polydraft-run"],
            "cannot write there (Permission denied: /sys)",
        ),
    ]


def test_cli_refuses_bad_folders_before_any_stage(tmp_path, capsys):
    path = write(tmp_path / "r.yaml", BASE)
    for extra, fragment in cli_cases(tmp_path):
        assert main(["run", str(path), *extra]) == 2, extra
        err = capsys.readouterr().err
        assert fragment in err and "Traceback" not in err, (extra, err)
    assert not (tmp_path / "run").exists()  # nothing started


def test_an_unexpected_error_exits_3_with_the_traceback_in_a_file(
    tmp_path, capsys, monkeypatch, tiny_target_dir
):
    import polydraft.pipelines.run.runner

    def broken(*args, **kwargs):
        raise ZeroDivisionError("planted")

    monkeypatch.setattr(polydraft.pipelines.run.runner, "run_pipeline", broken)
    path = write(tmp_path / "r.yaml", BASE)
    assert main(["run", str(path), f"target.path={tiny_target_dir}", "--run-dir", str(tmp_path / "run")]) == 3
    err = capsys.readouterr().err
    assert "unexpected error: ZeroDivisionError: planted" in err and "Traceback" not in err
    log = Path(re.search(r"traceback: (\S+) ", err).group(1))
    assert "ZeroDivisionError" in log.read_text()
    log.unlink()


def test_a_data_file_with_a_non_utf8_byte_is_named_with_its_line(tmp_path):
    data = tmp_path / "data.jsonl"
    rows = [json.dumps({"source": f"s{i}", "target": f"t{i}"}).encode() for i in range(3)]
    rows[1] = rows[1].replace(b"s1", b"s\xe91")
    data.write_bytes(b"\n".join(rows) + b"\n")
    with pytest.raises(SourceError, match=re.escape(f"{data}:2: not UTF-8 (byte 0xe9 at column 14)")):
        read_source(kind="local", format="translation", path=str(data), pair="de-en")


def test_relative_paths_resolve_against_the_recipe_file_not_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "recipes" / "lang").mkdir(parents=True)
    write(
        tmp_path / "recipes" / "base.yaml",
        "target:\n  bootstrap: {cache_dir: cache}\ndata:\n  pairs: [de-en]\n"
        "  eval: [{kind: local, pair: de-en, path: data/eval.jsonl}]\n",
    )
    child = write(tmp_path / "recipes" / "lang" / "de.yaml", "extends: ../base.yaml\n")
    monkeypatch.chdir(tmp_path / "recipes" / "lang")  # anywhere but the recipes folder
    recipe = load_recipe(child)
    assert recipe.target.bootstrap.cache_dir == str(tmp_path / "recipes" / "cache")
    assert recipe.data.eval[0].path == str(tmp_path / "recipes" / "data" / "eval.jsonl")
    overridden = load_recipe(child, ["target.bootstrap.cache_dir=here"])
    assert overridden.target.bootstrap.cache_dir == "here"  # an override's path: the working directory
    (tmp_path / "recipes" / "models" / "draft").mkdir(parents=True)
    folders = write(
        tmp_path / "recipes" / "folders.yaml",
        "target: {path: ../target}\npretrain: {enabled: false}\nfinetune: {drafter: {init: models/draft}}\n"
        "measure: {extra_drafters: {hub: org/other, mine: ./mine}}\n"
        "data:\n  pairs: [de-en]\n",
    )
    models = load_recipe(folders)
    assert models.target.path == str(tmp_path / "recipes" / ".." / "target")  # ./ or ../: a local folder
    assert models.finetune.drafter.init == str(
        tmp_path / "recipes" / "models" / "draft"
    )  # an existing folder
    mine = str(tmp_path / "recipes" / "mine")
    assert models.measure.extra_drafters == {"hub": "org/other", "mine": mine}  # a hub id stays as written
    demo = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "demo" / "demo.yaml")
    assert (Path(demo.target.bootstrap.cache_dir) / "659066c489eb7c49").is_dir()  # the committed build


def test_merge_shards_on_a_folder_that_is_not_a_shard_exits_2(tmp_path, capsys):
    (tmp_path / "shard").mkdir()
    (tmp_path / "shard" / "plan.json").write_text('{"fingerprint": "x"')
    assert main(["merge-shards", str(tmp_path / "shard"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'shard' / 'plan.json'}: corrupt plan" in err and "Traceback" not in err


def test_a_distill_source_that_yields_no_prompt_fails_before_generating(tmp_path, tiny_target_dir):
    from polydraft.pipelines.runtime.contract import StageFailed
    from tests.distill_setup import local_source, make_recipe, run_distill, write_jsonl

    data = write_jsonl(tmp_path / "data" / "empty.jsonl", [{"de": "", "en": "x"}, {"de": " ", "en": "y"}])
    recipe = make_recipe(tiny_target_dir, [local_source(data, skip_invalid=True)])
    with pytest.raises(StageFailed, match=r"data.distill yields no prompt for shard 0 of 1 \(2 invalid rows"):
        run_distill(recipe, tiny_target_dir, tmp_path / "distill")
    assert not (tmp_path / "distill" / "records").exists()
