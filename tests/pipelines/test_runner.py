"""The runner: manifests, skipping, rerunning exactly what changed, atomic stage folders, kills."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from polydraft.pipelines.run.recipe import load_recipe
from polydraft.pipelines.run.runner import stale_stages
from polydraft.pipelines.runtime.contract import StageFailed
from tests.fake_stages import TARGET, TOPOLOGY, fake_stages, reuse, run

ROOT = Path(__file__).resolve().parents[2]
RECIPE = """
target:
  path: org/target
data:
  pairs: [de-en]
heads:
  enabled: true
eagle3:
  enabled: true
tracking:
  mode: disabled
"""


@pytest.fixture
def setup(tmp_path, monkeypatch):
    recipe_path = tmp_path / "recipe.yaml"
    recipe_path.write_text(RECIPE)
    log = tmp_path / "ran.log"
    monkeypatch.setenv("FAKE_STAGE_LOG", str(log))
    return recipe_path, tmp_path / "run", log


def ran(log: Path) -> list[str]:
    lines = log.read_text().split() if log.exists() else []
    log.unlink(missing_ok=True)
    return lines


def test_first_run_produces_exactly_the_expected_files(setup):
    recipe_path, run_dir, log = setup
    run(recipe_path, run_dir)
    assert ran(log) == list(TOPOLOGY)
    files = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file())
    expected = ["recipe.yaml", "run.json"] + [
        f"{stage}/{name}"
        for stage in sorted(TOPOLOGY)
        for name in ("manifest.json", "out.json", "part-1.txt", "part-2.txt")
    ]
    assert files == sorted(expected)
    manifest = json.loads((run_dir / "finetune" / "manifest.json").read_text())
    assert manifest["status"] == "completed"
    assert set(manifest["upstream"]) == {"distill", "pretrain"}
    # the finetune stage's inputs: exactly what it reads
    assert set(manifest["config"]) == {"finetune", "pairs", "data_seed", "target", "launch", "done"}
    assert manifest["config"]["done"] == []  # set only for the training process of a resumed stage
    assert manifest["config"]["finetune"]["optim"]["lr"] == 3e-5  # resolved when the recipe loaded
    for key in (
        "config_hash",
        "key",
        "git",
        "packages",
        "command",
        "started_at",
        "finished_at",
        "metrics",
        "host",
    ):
        assert key in manifest
    assert manifest["metrics"] == {"resumed": False, "value": 1.5}
    assert manifest["packages"]["torch"]
    assert "dirty" in manifest["git"]


def test_rerun_skips_every_stage(setup):
    recipe_path, run_dir, log = setup
    run(recipe_path, run_dir)
    ran(log)
    before = {p: p.stat().st_mtime_ns for p in run_dir.glob("*/manifest.json")}
    outcomes = run(recipe_path, run_dir)
    assert ran(log) == []
    assert {o.status for o in outcomes} == {"skipped (up to date)"}
    assert before == {p: p.stat().st_mtime_ns for p in run_dir.glob("*/manifest.json")}


def test_config_change_reruns_that_stage_and_downstream_only(setup):
    recipe_path, run_dir, log = setup
    run(recipe_path, run_dir)
    ran(log)
    run(recipe_path, run_dir, "finetune.loop.seed=7")
    assert ran(log) == ["finetune", "calibrate", "measure", "export"]
    run(recipe_path, run_dir, "finetune.loop.seed=7", "early_exit.num_shared_layers=2")
    assert ran(log) == ["early_exit", "calibrate", "measure", "export"]
    run(recipe_path, run_dir, "finetune.loop.seed=7", "early_exit.num_shared_layers=2", "data.seed=3")
    assert ran(log) == list(TOPOLOGY)  # distill, pretrain and measure read it; the rest are downstream


DOWNSTREAM = {
    "distill": ["distill", "finetune", "heads", "eagle3", "early_exit", "calibrate", "measure", "export"],
    "pretrain": ["pretrain", "finetune", "calibrate", "measure", "export"],
    "finetune": ["finetune", "calibrate", "measure", "export"],
    "early_exit": ["early_exit", "calibrate", "measure", "export"],
    "heads": ["heads", "measure", "export"],
    "eagle3": ["eagle3", "measure", "export"],
    "calibrate": ["calibrate", "measure", "export"],
    "measure": ["measure", "export"],
    "export": ["export"],
}


RERUNS = [
    # a value each stage reads reruns it and everything downstream
    ("distill.max_new_tokens=7", DOWNSTREAM["distill"]),
    ("pretrain.token_budget=5", DOWNSTREAM["pretrain"]),
    ("data.pretrain=[{kind: offline, format: text}]", DOWNSTREAM["pretrain"]),
    ("finetune.kd_weight=0.5", DOWNSTREAM["finetune"]),
    ("early_exit.kl_weight=0.5", DOWNSTREAM["early_exit"]),
    ("heads.num_heads=3", DOWNSTREAM["heads"]),
    ("eagle3.ttt_steps=2", DOWNSTREAM["eagle3"]),
    ("calibrate.num_positions=7", DOWNSTREAM["calibrate"]),
    ("measure.num_prompts=7", DOWNSTREAM["measure"]),
    ("data.eval=[{kind: offline, format: translation, pair: de-en, split: test}]", DOWNSTREAM["measure"]),
    ("distill.prompt_format=chat_template", DOWNSTREAM["distill"]),  # measure's prompts too
    ("export.license=mit", DOWNSTREAM["export"]),
    (
        "launch.num_processes=2",
        ["pretrain", "finetune", "heads", "eagle3", "early_exit", "calibrate", "measure", "export"],
    ),
    # values a stage does not read leave it alone (calibrate runs as one process whatever launch says)
    ("tracking.project=elsewhere", []),
    ("tracking.model_artifacts=true", []),
    ("runner.parallel_stages=2", []),  # when stages run, not what they compute
    ("data.open=[{kind: offline, format: translation, pair: de-en}]", []),  # open_fraction is 0
    ("data.offline.samples_per_pair=10", []),  # no source reads the offline corpus
]


@pytest.mark.parametrize("override, expected", RERUNS)
def test_a_stage_reruns_exactly_when_a_value_it_reads_changes(setup, override, expected):
    recipe_path, run_dir, log = setup
    run(recipe_path, run_dir)
    ran(log)
    run(recipe_path, run_dir, override)
    assert ran(log) == expected


def test_calibrate_ignores_the_launch_config_it_overrides(setup):
    recipe_path, run_dir, log = setup
    off = (
        "early_exit.enabled=false",
        "heads.enabled=false",
        "eagle3.enabled=false",
        "finetune.enabled=false",
        "pretrain.enabled=false",
    )
    run(recipe_path, run_dir, *off)
    ran(log)
    run(recipe_path, run_dir, *off, "launch.accelerate_config=recipes/accelerate/ddp.yaml")
    assert ran(log) == []


def test_disabled_stage_is_skipped_and_downstream_no_longer_depends_on_it(setup):
    recipe_path, run_dir, log = setup
    outcomes = run(recipe_path, run_dir, "pretrain.enabled=false")
    assert ran(log) == [s for s in TOPOLOGY if s != "pretrain"]
    assert [o.status for o in outcomes if o.name == "pretrain"] == ["disabled"]
    assert set(json.loads((run_dir / "finetune" / "manifest.json").read_text())["upstream"]) == {"distill"}


def test_only_and_from_and_force(setup):
    recipe_path, run_dir, log = setup
    with pytest.raises(StageFailed, match="finetune needs distill, pretrain"):
        run(recipe_path, run_dir, only="finetune")
    run(recipe_path, run_dir)
    ran(log)
    run(recipe_path, run_dir, only="measure")
    assert ran(log) == []  # up to date
    run(recipe_path, run_dir, only="measure", force=True)
    assert ran(log) == ["measure"]
    run(recipe_path, run_dir, start="calibrate", force=True)
    assert ran(log) == ["calibrate", "measure", "export"]
    # a forced measure has a new manifest, so export is now out of date
    run(recipe_path, run_dir, only="measure", force=True)
    ran(log)
    run(recipe_path, run_dir)
    assert ran(log) == ["export"]


def test_failed_stage_leaves_no_complete_folder_and_rerun_resumes(setup, monkeypatch):
    recipe_path, run_dir, log = setup
    monkeypatch.setenv("FAKE_STAGE_FAIL", "finetune")
    with pytest.raises(StageFailed, match="finetune failed on purpose") as failed:
        run(recipe_path, run_dir)
    stage_log = run_dir / "finetune.partial" / "finetune.log"
    assert f"details: {stage_log}" in str(failed.value)
    assert "Traceback (most recent call last)" in stage_log.read_text()
    assert not (run_dir / "finetune").exists()
    assert not (run_dir / "finetune.partial" / "manifest.json").exists()
    failure = json.loads((run_dir / "finetune.partial" / "failure.json").read_text())
    assert failure["status"] == "failed" and "on purpose" in failure["error"]
    monkeypatch.delenv("FAKE_STAGE_FAIL")
    ran(log)
    run(recipe_path, run_dir)
    assert ran(log) == [
        "finetune",
        "heads",
        "eagle3",
        "early_exit",
        "calibrate",
        "measure",
        "export",
    ]  # the pipeline stopped there
    assert not (run_dir / "finetune.partial").exists()
    assert not (run_dir / "finetune" / "failure.json").exists()


def test_killed_stage_leaves_no_manifest_and_rerun_resumes_from_partial(setup):
    recipe_path, run_dir, log = setup
    script = (
        "import sys; from pathlib import Path; from tests.fake_stages import run; "
        "run(Path(sys.argv[1]), Path(sys.argv[2]))"
    )
    env = {**os.environ, "FAKE_STAGE_HANG": "early_exit", "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        [sys.executable, "-c", script, str(recipe_path), str(run_dir)], env=env, cwd=ROOT
    )
    marker = run_dir / "early_exit.partial" / "hanging"
    deadline = time.time() + 60
    while not marker.exists() and time.time() < deadline and process.poll() is None:
        time.sleep(0.1)
    assert marker.exists(), "the stage never reached its hanging point"
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (run_dir / "early_exit").exists()
    partial = run_dir / "early_exit.partial"
    assert (partial / "part-1.txt").exists() and not (partial / "manifest.json").exists()
    assert (run_dir / "distill" / "manifest.json").exists()  # completed before the kill, kept
    ran(log)
    outcomes = run(recipe_path, run_dir)
    assert ran(log) == ["early_exit", "calibrate", "measure", "export"]
    assert [o.metrics["resumed"] for o in outcomes if o.name == "early_exit"] == [True]


def test_partial_left_by_another_config_is_discarded(setup, monkeypatch):
    recipe_path, run_dir, log = setup
    monkeypatch.setenv("FAKE_STAGE_FAIL", "distill")
    with pytest.raises(RuntimeError):
        run(recipe_path, run_dir)
    (run_dir / "distill.partial" / "hanging").write_text("")
    monkeypatch.delenv("FAKE_STAGE_FAIL")
    outcomes = run(recipe_path, run_dir, "distill.seed=5")
    assert [o.metrics["resumed"] for o in outcomes if o.name == "distill"] == [False]


def test_corrupt_or_lost_manifest_is_reported_not_silently_rerun(setup):
    recipe_path, run_dir, log = setup
    run(recipe_path, run_dir)
    ran(log)
    manifest = run_dir / "distill" / "manifest.json"
    good = manifest.read_text()
    manifest.write_text(good[: len(good) // 2])  # torn
    with pytest.raises(StageFailed, match=f"{manifest}: corrupt manifest .*--only distill --force"):
        run(recipe_path, run_dir)
    manifest.unlink()
    with pytest.raises(StageFailed, match="distill is complete but its manifest.json is missing"):
        run(recipe_path, run_dir)
    assert ran(log) == [] and (run_dir / "distill").is_dir()  # nothing redone over the outputs
    run(recipe_path, run_dir, only="distill", force=True)
    assert ran(log) == ["distill"] and json.loads(manifest.read_text())["key"]


def test_a_failed_run_leaves_the_previous_recipe_yaml(setup, monkeypatch):
    recipe_path, run_dir, log = setup
    run(recipe_path, run_dir)
    before = (run_dir / "recipe.yaml").read_text()
    recipe_path.write_text(RECIPE + "distill:\n  max_new_tokens: 7\n")
    monkeypatch.setenv("FAKE_STAGE_FAIL", "distill")
    with pytest.raises(RuntimeError, match="distill failed on purpose"):
        run(recipe_path, run_dir)
    assert (run_dir / "recipe.yaml").read_text() == before
    monkeypatch.delenv("FAKE_STAGE_FAIL")
    run(recipe_path, run_dir)
    assert "max_new_tokens: 7" in (run_dir / "recipe.yaml").read_text()


def test_a_failed_forced_rerun_leaves_the_previous_folder_whole(setup, monkeypatch):
    recipe_path, run_dir, log = setup
    run(recipe_path, run_dir)
    before = {p.relative_to(run_dir): p.read_bytes() for p in (run_dir / "export").rglob("*") if p.is_file()}
    monkeypatch.setenv("FAKE_STAGE_FAIL", "export")
    with pytest.raises(RuntimeError, match="export failed on purpose"):
        run(recipe_path, run_dir, only="export", force=True)
    after = {p.relative_to(run_dir): p.read_bytes() for p in (run_dir / "export").rglob("*") if p.is_file()}
    assert after == before


# ----------------------------------------------------------------------------- reuse (polydraft study)


@pytest.mark.parametrize("override, expected", RERUNS)
def test_reuse_copies_exactly_the_stages_a_rerun_would_skip(setup, override, expected):
    recipe_path, run_dir, log = setup
    donor = run_dir.with_name("donor")
    run(recipe_path, donor)
    ran(log)
    assert reuse(recipe_path, run_dir, [donor], override) == [s for s in TOPOLOGY if s not in expected]
    run(recipe_path, run_dir, override)
    assert ran(log) == expected
    for stage in set(TOPOLOGY) - set(expected):  # the copies are whole, byte for byte
        files = sorted(p.relative_to(donor / stage) for p in (donor / stage).rglob("*"))
        assert files == sorted(p.relative_to(run_dir / stage) for p in (run_dir / stage).rglob("*"))
        assert all(
            (donor / stage / f).read_bytes() == (run_dir / stage / f).read_bytes()
            for f in files
            if (donor / stage / f).is_file()
        )


def test_reuse_takes_each_stage_from_the_donor_that_has_its_key(setup):
    recipe_path, run_dir, log = setup
    first, second = run_dir.with_name("first"), run_dir.with_name("second")
    run(recipe_path, first)
    assert reuse(recipe_path, second, [first], "finetune.kd_weight=0.5", "measure.num_prompts=7") == [
        "distill", "pretrain", "heads", "eagle3", "early_exit"
    ]  # fmt: skip
    run(recipe_path, second, "finetune.kd_weight=0.5", "measure.num_prompts=7")
    ran(log)
    # finetune as in `second`, measure as in neither: everything but measure and export is copied
    copied = reuse(recipe_path, run_dir, [first, second], "finetune.kd_weight=0.5")
    assert copied == ["distill", "pretrain", "finetune", "heads", "eagle3", "early_exit", "calibrate"]
    run(recipe_path, run_dir, "finetune.kd_weight=0.5")
    assert ran(log) == ["measure", "export"]


def test_reuse_needs_the_very_upstream_folders_a_donor_stage_was_made_from(setup):
    recipe_path, run_dir, log = setup
    first, second = run_dir.with_name("first"), run_dir.with_name("second")
    run(recipe_path, first)
    run(recipe_path, second, "finetune.kd_weight=0.5")  # its own distill: same key, another manifest
    # distill comes from `first`, so `second`'s finetune (keyed on its own distill manifest) does not match
    assert reuse(recipe_path, run_dir, [first, second], "finetune.kd_weight=0.5")[:5] == [
        "distill", "pretrain", "heads", "eagle3", "early_exit"
    ]  # fmt: skip
    assert not (run_dir / "finetune").exists()


def test_reuse_keeps_an_up_to_date_folder_and_replaces_an_out_of_date_one(setup):
    recipe_path, run_dir, log = setup
    donor = run_dir.with_name("donor")
    run(recipe_path, donor, "measure.num_prompts=7")
    reuse(recipe_path, run_dir, [donor])
    run(recipe_path, run_dir)
    assert ran(log) == [*TOPOLOGY, "measure", "export"]  # the donor's run, then what its copy lacked
    before = (run_dir / "distill" / "manifest.json").read_bytes()
    assert reuse(recipe_path, run_dir, [donor], "measure.num_prompts=7") == ["measure", "export"]
    assert (run_dir / "distill" / "manifest.json").read_bytes() == before  # kept, not copied over
    run(recipe_path, run_dir, "measure.num_prompts=7")
    assert ran(log) == []
    assert not list(run_dir.glob(".*"))  # no staging or trash folder left


def test_reuse_leaves_a_folder_with_a_corrupt_manifest_for_the_runner_to_refuse(setup):
    recipe_path, run_dir, log = setup
    donor = run_dir.with_name("donor")
    run(recipe_path, donor)
    run(recipe_path, run_dir)
    (run_dir / "finetune" / "manifest.json").write_text("{not json")
    assert reuse(recipe_path, run_dir, [donor], "finetune.kd_weight=0.5") == []
    assert (run_dir / "finetune" / "manifest.json").read_text() == "{not json"
    with pytest.raises(StageFailed, match="corrupt manifest"):
        run(recipe_path, run_dir, "finetune.kd_weight=0.5")


def test_stale_stages_are_those_a_run_would_run(setup):
    recipe_path, run_dir, log = setup

    def stale(*overrides: str) -> list[str]:
        return stale_stages(load_recipe(recipe_path, list(overrides)), run_dir, fake_stages(), TARGET)

    assert stale() == TOPOLOGY
    run(recipe_path, run_dir)
    assert stale() == []
    assert stale("heads.num_heads=3") == DOWNSTREAM["heads"]
    (run_dir / "calibrate" / "manifest.json").unlink()
    assert stale() == DOWNSTREAM["calibrate"]
    assert ran(log) == TOPOLOGY  # nothing ran while asking
