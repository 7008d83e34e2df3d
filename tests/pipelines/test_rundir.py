"""Runs never overwrite each other (a default run directory per recipe file, refused when another recipe
file made it, nothing deleted without --force) and stale code is visible (code fingerprints in the
manifests, `polydraft status`)."""

from __future__ import annotations

import importlib
import json
import logging
from pathlib import Path

import pytest

import polydraft.pipelines.stages
from polydraft.pipelines.cli.main import main
from polydraft.pipelines.cli.status import stage_states
from polydraft.pipelines.run.recipe import load_recipe, shipped_recipes
from polydraft.pipelines.run.rundir import ORIGIN_FILE, RunDirTaken, claim_run_dir, default_run_dir
from polydraft.pipelines.run.runner import run_pipeline
from polydraft.pipelines.runtime.contract import PROJECT_ROOT, Stage
from tests.fake_stages import TARGET, TOPOLOGY, _make, fake_stages, reuse, run
from tests.pipelines.test_runner import RECIPE, ran

RECIPES = PROJECT_ROOT / "recipes"


@pytest.fixture
def setup(tmp_path, monkeypatch):
    recipe_path = tmp_path / "recipe.yaml"
    recipe_path.write_text(RECIPE)
    log = tmp_path / "ran.log"
    monkeypatch.setenv("FAKE_STAGE_LOG", str(log))
    return recipe_path, tmp_path / "run", log


# ----------------------------------------------------------------------------- one directory per recipe file


def test_every_shipped_recipe_has_its_own_default_run_dir():
    recipes = shipped_recipes(RECIPES)
    assert len(recipes) >= 30
    dirs = [default_run_dir(r.path) for r in recipes]
    assert len(set(dirs)) == len(dirs)
    assert default_run_dir(RECIPES / "vicuna-7b" / "de.yaml") == Path("runs/vicuna-7b/de")
    assert default_run_dir(RECIPES / "gemma-7b-it" / "de.yaml") == Path("runs/gemma-7b-it/de")
    assert default_run_dir(RECIPES / "eesd" / "vicuna-13b.yaml") == Path("runs/eesd/vicuna-13b")
    assert default_run_dir(RECIPES / "blockwise" / "vicuna-13b.yaml") == Path("runs/blockwise/vicuna-13b")


def test_recipes_outside_a_recipes_folder_with_one_name_get_two_run_dirs(tmp_path):
    first, second = tmp_path / "a" / "de.yaml", tmp_path / "b" / "de.yaml"
    assert default_run_dir(first) != default_run_dir(second)
    assert default_run_dir(first).name.startswith("de-") and default_run_dir(first) == default_run_dir(first)


def test_a_run_dir_another_recipe_file_made_is_refused_naming_both_unless_force(tmp_path, caplog):
    run_dir, first, second = tmp_path / "run", tmp_path / "a.yaml", tmp_path / "b.yaml"
    claim_run_dir(run_dir, first, ["x=1"], "cmd", force=False)
    claim_run_dir(run_dir, first, ["x=2"], "cmd", force=False)  # the same file with other overrides: fine
    assert json.loads((run_dir / ORIGIN_FILE).read_text())["overrides"] == ["x=2"]
    with pytest.raises(
        RunDirTaken, match=f"{run_dir} holds the run of {first.resolve()}, not of {second.resolve()}"
    ):
        claim_run_dir(run_dir, second, [], "cmd", force=False)
    with caplog.at_level(logging.WARNING):
        claim_run_dir(run_dir, second, [], "cmd", force=True)
    assert "--force" in caplog.text
    assert json.loads((run_dir / ORIGIN_FILE).read_text())["recipe"] == str(second.resolve())


def test_a_run_dir_made_before_origins_were_kept_is_told_by_its_run_json(tmp_path):
    run_dir = tmp_path / "runs" / "de"
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(
        json.dumps({"command": "polydraft run recipes/vicuna-7b/de.yaml --force"})
    )
    with pytest.raises(RunDirTaken, match="vicuna-7b/de.yaml"):
        claim_run_dir(run_dir, Path("recipes/gemma-7b-it/de.yaml"), [], "cmd", force=False)
    claim_run_dir(run_dir, Path("recipes/vicuna-7b/de.yaml"), [], "cmd", force=False)


def test_polydraft_run_refuses_another_recipes_run_dir_with_exit_2_before_any_stage(
    tmp_path, capsys, tiny_target_dir
):
    from tests.pipelines.test_bad_inputs import BASE, write

    good = tiny_target_dir
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    first, second = write(tmp_path / "a" / "r.yaml", BASE), write(tmp_path / "b" / "r.yaml", BASE)
    run_dir = tmp_path / "run"
    claim_run_dir(run_dir, first, [], "cmd", force=False)
    code = main(["run", str(second), f"target.path={good}", "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    assert code == 2 and str(first.resolve()) in err and str(second.resolve()) in err and "--force" in err
    assert sorted(p.name for p in run_dir.iterdir()) == [ORIGIN_FILE]


# ----------------------------------------------------------------------------- nothing deleted without --force


def aside(run_dir: Path) -> list[str]:
    return (
        sorted(p.name.rsplit("-", 2)[0] for p in (run_dir / "aside").iterdir())
        if (run_dir / "aside").is_dir()
        else []
    )


def test_a_partial_left_by_another_config_is_moved_aside_with_a_message(setup, monkeypatch, caplog):
    recipe_path, run_dir, log = setup
    monkeypatch.setenv("FAKE_STAGE_FAIL", "distill")
    with pytest.raises(RuntimeError):
        run(recipe_path, run_dir)
    (run_dir / "distill.partial" / "hanging").write_text("")
    monkeypatch.delenv("FAKE_STAGE_FAIL")
    with caplog.at_level(logging.WARNING, logger="polydraft.pipelines.run.rundir"):
        outcomes = run(recipe_path, run_dir, "distill.seed=5")
    assert [o.metrics["resumed"] for o in outcomes if o.name == "distill"] == [False]
    assert aside(run_dir) == ["distill.partial"]
    (moved,) = (run_dir / "aside").iterdir()
    assert (moved / "hanging").exists() and (moved / "failure.json").exists()
    assert f"was left by a run with another config; moved it to {moved}" in caplog.text


def test_a_rerun_with_another_config_moves_the_folders_it_replaces_aside_and_force_deletes(setup):
    recipe_path, run_dir, log = setup
    run(recipe_path, run_dir)
    old = (run_dir / "export" / "manifest.json").read_text()
    run(recipe_path, run_dir, "export.license=mit")
    assert aside(run_dir) == ["export"]
    assert (next((run_dir / "aside").iterdir()) / "manifest.json").read_text() == old
    run(recipe_path, run_dir, "export.license=apache-2.0", force=True, only="export")
    assert aside(run_dir) == ["export"]  # --force replaced it without keeping a copy
    assert not list(run_dir.glob(".*"))


def test_reuse_moves_aside_the_folders_and_partials_it_replaces(setup):
    recipe_path, run_dir, log = setup
    donor = run_dir.with_name("donor")
    run(recipe_path, donor, "measure.num_prompts=7")
    reuse(recipe_path, run_dir, [donor])
    run(recipe_path, run_dir)  # measure and export with the recipe's own num_prompts
    (run_dir / "export.partial").mkdir()
    assert reuse(recipe_path, run_dir, [donor], "measure.num_prompts=7") == ["measure", "export"]
    assert aside(run_dir) == ["export", "export.partial", "measure"]


# ----------------------------------------------------------------------------- stale code


def code_module(tmp_path: Path, monkeypatch, text: str) -> str:
    """A stage module of the test's own, importable, whose source the test then edits."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "measure_code_under_test.py").write_text(text)
    importlib.invalidate_caches()
    return "measure_code_under_test"


def stages_with_measure_code(module: str) -> list[Stage]:
    """The stand-in stages, `measure` running from `module`'s code (the stand-in function, renamed)."""
    stages = fake_stages()
    measure = _make("measure")
    measure.__module__ = module
    return [Stage(s.name, measure, s.inputs, s.upstream) if s.name == "measure" else s for s in stages]


def test_a_stage_made_by_other_code_is_named_with_its_modules_kept_and_rerun_on_request(
    setup, tmp_path, monkeypatch, caplog
):
    recipe_path, run_dir, log = setup
    module = code_module(tmp_path, monkeypatch, "import polydraft.decoding.sd\nVERSION = 1\n")
    recipe = load_recipe(recipe_path)
    stages = stages_with_measure_code(module)
    run_pipeline(recipe, run_dir, stages, TARGET, command="test")
    manifest = json.loads((run_dir / "measure" / "manifest.json").read_text())
    assert {module, "polydraft.decoding.sd", "polydraft.decoding.engine"} <= set(manifest["code"]["modules"])
    ran(log)
    (tmp_path / f"{module}.py").write_text("import polydraft.decoding.sd\nVERSION = 20\n")
    with caplog.at_level(logging.WARNING):
        outcomes = run_pipeline(recipe, run_dir, stages, TARGET, command="test")
    assert ran(log) == []
    assert {o.name: o.status for o in outcomes}["measure"] == "skipped (ran with other code)"
    assert {o.name: o.status for o in outcomes}["export"] == "skipped (up to date)"
    assert f"up to date with the recipe but made by other code: {module} (changed)" in caplog.text
    run_pipeline(recipe, run_dir, stages, TARGET, command="test", rerun_stale=True)
    assert ran(log) == ["measure", "export"]  # export: its upstream manifest is new
    assert aside(run_dir) == ["export", "measure"]
    run_pipeline(recipe, run_dir, stages, TARGET, command="test")
    assert ran(log) == []


def test_status_says_what_a_rerun_would_do_and_why_without_running_anything(setup, tmp_path, monkeypatch):
    recipe_path, run_dir, log = setup
    module = code_module(tmp_path, monkeypatch, "VERSION = 1\n")
    stages = stages_with_measure_code(module)

    def states(*overrides: str) -> dict[str, tuple[str, str]]:
        found = stage_states(load_recipe(recipe_path, list(overrides)), run_dir, stages, TARGET)
        return {s.name: (s.state, s.why) for s in found}

    assert set(states().values()) == {("will run", "never ran")}
    run_pipeline(load_recipe(recipe_path), run_dir, stages, TARGET, command="test")
    assert set(states().values()) == {("up to date", "")}
    changed = states("heads.num_heads=3", "heads.loss_decay=0.5")
    assert changed["heads"] == ("will run", "config changed: heads.loss_decay, heads.num_heads")
    assert changed["measure"] == ("will run", "upstream heads will run")
    assert changed["distill"] == ("up to date", "")
    (tmp_path / f"{module}.py").write_text("VERSION = 20\n")
    assert states()["measure"] == ("ran with other code", f"{module} (changed)")
    monkeypatch.setenv("FAKE_STAGE_FAIL", "calibrate")
    ran(log)
    with pytest.raises(RuntimeError):
        run_pipeline(
            load_recipe(recipe_path, ["calibrate.num_positions=7"]), run_dir, stages, TARGET, command="t"
        )
    now = states("calibrate.num_positions=7")
    assert now["calibrate"] == (
        "failed",
        f"StageFailed: calibrate failed on purpose (a rerun resumes from {run_dir / 'calibrate.partial'})",
    )
    assert now["measure"] == ("will run", "upstream calibrate will run")
    assert states()["calibrate"] == ("up to date", "")  # the failed partial was of another config
    assert ran(log) == ["calibrate"]  # the failed run only: asking ran nothing


def test_polydraft_status_prints_every_stage_from_the_recorded_recipe(setup, monkeypatch, capsys):
    recipe_path, run_dir, log = setup
    monkeypatch.setattr(polydraft.pipelines.stages, "default_stages", fake_stages)
    claim_run_dir(run_dir, recipe_path, ["finetune.loop.seed=7"], "test", force=False)
    run(recipe_path, run_dir, "finetune.loop.seed=7")
    assert main(["status", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "finetune.loop.seed=7" in out.splitlines()[0]
    assert [line.split()[:3] for line in out.splitlines()[2:]] == [[s, "up", "to"] for s in TOPOLOGY]
    assert main(["status", str(run_dir), "--recipe", str(recipe_path)]) == 0  # without the override
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows["finetune"].split()[1:] == ["will", "run", "config", "changed:", "finetune.loop.seed"]
    assert main(["status", str(run_dir.with_name("nowhere"))]) == 2
