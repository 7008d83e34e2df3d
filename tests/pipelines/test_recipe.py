"""Recipe loading: strict validation with readable errors, extends, overrides, every shipped recipe."""

from pathlib import Path

import pytest

from polydraft.pipelines.run.recipe import (
    RecipeError,
    copy_recipe,
    dump_recipe,
    header,
    load_recipe,
    parse_override,
)

ROOT = Path(__file__).resolve().parents[2]

BASE = """
target:
  path: org/some-model
data:
  pairs: [de-en]
finetune:
  optim:
    lr: 3e-5
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_minimal_recipe_fills_defaults(tmp_path):
    recipe = load_recipe(write(tmp_path, "r.yaml", BASE))
    assert recipe.finetune.optim.lr == 3e-5  # `3e-5` is a float, not the string PyYAML would make of it
    assert recipe.distill.temperatures == [0.0, 0.3, 0.7, 1.0]
    assert recipe.target.dtype == "auto"


def test_unknown_key_names_file_and_full_path(tmp_path):
    path = write(tmp_path, "r.yaml", BASE + "  loop:\n    epochz: 3\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert f"{path}: finetune.loop.epochz: unknown key" in str(err.value)


def test_wrong_type_names_file_path_expected_and_value(tmp_path):
    path = write(tmp_path, "r.yaml", BASE.replace("3e-5", "fast"))
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert f"{path}: finetune.optim.lr: expected float, got 'fast'" in str(err.value)


def test_wrong_literal_and_missing_block(tmp_path):
    path = write(tmp_path, "r.yaml", "target:\n  path: x\n  dtype: float64\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    message = str(err.value)
    assert "target.dtype: expected 'auto', 'float32', 'bfloat16' or 'float16', got 'float64'" in message
    assert "data: required key is missing" in message


def test_cross_block_check(tmp_path):
    path = write(tmp_path, "r.yaml", "target:\n  path: org/m\ndata:\n  pairs: []\n")
    with pytest.raises(RecipeError, match=f"{path}: data.pairs is empty, but finetune trains one drafter"):
        load_recipe(path)
    assert load_recipe(path, ["finetune.enabled=false"]).data.pairs == []


def test_cross_field_check(tmp_path):
    path = write(tmp_path, "r.yaml", BASE.replace("path: org/some-model", "path: org/m\n  bootstrap: {}"))
    with pytest.raises(RecipeError, match="set exactly one of target.path and target.bootstrap"):
        load_recipe(path)


def test_extends_merges_and_error_names_the_file_that_set_the_key(tmp_path):
    write(tmp_path, "base.yaml", BASE)
    (tmp_path / "lang").mkdir()
    child = write(
        tmp_path / "lang",
        "de.yaml",
        "extends: ../base.yaml\ndata:\n  pairs: [fr-en]\nfinetune:\n  loop:\n    epochs: 5.0\n",
    )
    recipe = load_recipe(child)
    assert recipe.data.pairs == ["fr-en"]
    assert recipe.finetune.loop.epochs == 5.0
    assert recipe.finetune.optim.lr == 3e-5  # from the base
    bad_base = write(tmp_path, "base.yaml", BASE.replace("3e-5", "'oops'"))
    with pytest.raises(RecipeError) as err:
        load_recipe(child)
    assert f"{bad_base}: finetune.optim.lr: expected float, got 'oops'" in str(err.value)


def test_bad_extends(tmp_path):
    missing = write(tmp_path, "a.yaml", "extends: nowhere.yaml\n")
    with pytest.raises(RecipeError, match="nowhere.yaml: no such recipe file"):
        load_recipe(missing)
    not_a_path = write(tmp_path, "b.yaml", "extends: [x]\n")
    with pytest.raises(RecipeError, match="extends: expected a relative path"):
        load_recipe(not_a_path)
    write(tmp_path, "c.yaml", "extends: d.yaml\n")
    cycle = write(tmp_path, "d.yaml", "extends: c.yaml\n")
    with pytest.raises(RecipeError, match="`extends` forms a cycle"):
        load_recipe(cycle)


def test_overrides_parse_yaml_values_and_report_their_origin(tmp_path):
    assert parse_override("finetune.optim.lr=1e-4") == (["finetune", "optim", "lr"], 1e-4)
    assert parse_override("data.pairs=[de-en, fr-en]") == (["data", "pairs"], ["de-en", "fr-en"])
    assert parse_override("target.revision=null") == (["target", "revision"], None)
    with pytest.raises(RecipeError, match="expected key.path=value"):
        parse_override("finetune.optim.lr")
    path = write(tmp_path, "r.yaml", BASE)
    recipe = load_recipe(path, ["finetune.loop.epochs=5.0", "data.pairs=[de-en, fr-en]"])
    assert recipe.finetune.loop.epochs == 5.0 and recipe.data.pairs == ["de-en", "fr-en"]
    with pytest.raises(RecipeError) as err:
        load_recipe(path, ["finetune.optim.lr=fast"])
    assert "override `finetune.optim.lr=fast`: finetune.optim.lr: expected float, got 'fast'" in str(
        err.value
    )
    with pytest.raises(RecipeError, match="finetune.nope: unknown key"):
        load_recipe(path, ["finetune.nope=1"])


def test_an_unquoted_off_switches_vllm_off(tmp_path):
    """YAML reads `off` as false: in a recipe and in an override it still means the switch's `off`."""
    path = write(tmp_path, "r.yaml", BASE + "measure:\n  vllm: off\n")
    recipe = load_recipe(path, ["export.vllm_check=off"])
    assert (recipe.measure.vllm, recipe.export.vllm_check) == ("off", "off")
    with pytest.raises(RecipeError, match="export.vllm_check: expected 'off', 'auto' or 'require', got True"):
        load_recipe(path, ["export.vllm_check=on"])


def test_dump_round_trips(tmp_path):
    recipe = load_recipe(write(tmp_path, "r.yaml", BASE))
    again = load_recipe(write(tmp_path, "resolved.yaml", dump_recipe(recipe)))
    assert again == recipe


RECIPES = sorted(p for p in (ROOT / "recipes").rglob("*.yaml") if "accelerate" not in p.parts)


@pytest.mark.parametrize("path", RECIPES, ids=[str(p.relative_to(ROOT)) for p in RECIPES])
def test_every_shipped_recipe_loads_and_starts_with_its_launch_command(path, tmp_path):
    recipe = load_recipe(path)
    assert recipe.data.pairs or not recipe.finetune.enabled
    launch, description = header(path)
    commands = [f"polydraft {command} {path.relative_to(ROOT)}" for command in ("run", "study")]
    assert launch in commands, "the first line is its own launch command"
    assert description.endswith(".") and len(description) > 20, "then a sentence that says what it is"
    copy = tmp_path / "copy" / "standalone.yaml"
    copy_recipe(path, copy)  # standalone: `extends` merged, local paths absolute, loading to the same recipe
    assert "\nextends:" not in copy.read_text() and load_recipe(copy) == recipe
    assert header(copy)[0] == f"polydraft run {copy}"


def test_polydraft_recipes_lists_every_recipe_and_copies_one(tmp_path, capsys):
    from polydraft.pipelines.cli.main import main

    assert main(["recipes"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if not line.startswith(" ")] == [
        str(p.relative_to(ROOT / "recipes").with_suffix("")) for p in RECIPES
    ]
    assert "    $ polydraft run recipes/vicuna-7b/de.yaml" in out
    destination = tmp_path / "mine.yaml"
    assert main(["recipes", "--copy", "vicuna-7b/de", str(destination)]) == 0
    assert load_recipe(destination) == load_recipe(ROOT / "recipes" / "vicuna-7b" / "de.yaml")
    assert main(["recipes", "--copy", "vicuna-7b/de", str(destination)]) == 2  # never overwritten
    assert "already exists" in capsys.readouterr().err
    assert main(["recipes", "--copy", "vicuna-7b/xx", str(tmp_path / "other.yaml")]) == 2


def test_accelerate_configs_are_valid_yaml():
    import yaml

    configs = sorted((ROOT / "recipes" / "accelerate").glob("*.yaml"))
    assert {p.stem for p in configs} >= {
        "single",
        "ddp",
        "fsdp",
        "deepspeed_zero2",
        "deepspeed_zero3",
        "multinode",
    }
    for path in configs:
        config = yaml.safe_load(path.read_text())
        assert config["distributed_type"] in {"NO", "MULTI_GPU", "FSDP", "DEEPSPEED"}


def test_gpu_only_accelerate_configs_are_flagged_on_a_cpu():
    from polydraft.pipelines.runtime.launch import cpu_fallback

    flagged = {}
    for path in sorted((ROOT / "recipes" / "accelerate").glob("*.yaml")):
        message = cpu_fallback(path)
        flagged[path.stem] = message is not None
        if message:
            assert "plain DDP (gloo)" in message and "not sharded" in message
    assert flagged == {
        "single": False,
        "ddp": False,
        "multinode": False,
        "fsdp": True,
        "deepspeed_zero2": True,
        "deepspeed_zero3": True,
    }


def test_the_readme_recipe_for_a_new_language_loads_and_plans(tmp_path):
    """The README's dozen-line recipe is a working one: it loads (extends the shipped base) and plans its
    stages, the EAGLE-3 head among them."""
    import re

    from polydraft.pipelines.plan.estimate import estimate
    from polydraft.pipelines.runtime.cluster import parse_gpus

    block = re.search(r"```yaml\n(# my-en-de.yaml.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block is not None, "the README lost its recipe"
    text = block[1].replace("extends: recipes/", f"extends: {ROOT}/recipes/")
    recipe = load_recipe(write(tmp_path, "my-en-de.yaml", text))
    assert recipe.data.pairs == ["en-de"] and recipe.eagle3.enabled
    stages = [stage.name for stage in estimate(recipe, parse_gpus("8xA100-80GB")).stages]
    assert stages == ["distill", "pretrain", "finetune en-de", "eagle3 en-de", "measure", "export"]
