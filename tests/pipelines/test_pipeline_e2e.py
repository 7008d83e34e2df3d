"""The real pipeline end to end on a tiny recipe: every stage, through the CLI, then a rerun that skips."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from polydraft.pipelines.cli.main import main
from tests.wandb_log import wait_for_record

RECIPE = """
# polydraft run tiny.yaml (a test recipe)
target:
  bootstrap: {{vocab_size: 400, hidden_size: 32, num_layers: 3, num_heads: 2, intermediate_size: 64,
              steps: 20, batch_size: 8, seq_len: 160, cache_dir: {cache}}}
data:
  pairs: [de-en, fr-en]
  offline: {{entries_per_sample: [1, 2], samples_per_pair: 60}}
  distill:
    - {{kind: offline, format: translation, pair: de-en, limit: 6}}
    - {{kind: offline, format: translation, pair: fr-en, limit: 6}}
  pretrain:
    - {{kind: offline, format: text, limit: 40}}
  eval:
    - {{kind: offline, format: translation, pair: de-en, split: test}}
    - {{kind: offline, format: translation, pair: fr-en, split: test}}
distill: {{temperatures: [0.0, 1.0], max_new_tokens: 10, eval_fraction: 0.2}}
pretrain:
  drafter: {{arch: custom, hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64}}
  loop: {{max_steps: 2, per_device_batch_size: 2, max_length: 128, eval_every: 0}}
finetune:
  loop: {{max_steps: 2, per_device_batch_size: 2, max_length: 160, eval_every: 0, eval_batches: 1}}
early_exit:
  num_shared_layers: 1
  loop: {{max_steps: 2, per_device_batch_size: 2, grad_accum_steps: 1, max_length: 160, eval_every: 0,
         eval_batches: 1}}
eagle3:
  enabled: true
  multilingual: true
  aux_layers: [0, 1, 2]
  draft_vocab_size: 300
  loop: {{max_steps: 2, per_device_batch_size: 2, max_length: 160, eval_every: 0, eval_batches: 1}}
calibrate: {{num_positions: 12, draft_length: 3, max_steps: 3, loop: {{max_length: 160, per_device_batch_size: 6}}}}
measure: {{temperatures: [0.0], seeds: [0], num_prompts: 2, max_new_tokens: 6, controls: [fixed, cali_ts],
          max_draft_length: 3, include_pretrained: false}}
export: {{smoke_prompts: 1, smoke_max_new_tokens: 6, vllm_check: "off"}}
tracking: {{mode: disabled}}
"""

STAGES = ["distill", "pretrain", "finetune", "early_exit", "eagle3", "calibrate", "measure", "export"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    recipe = root / "tiny.yaml"
    recipe.write_text(RECIPE.format(cache=root / "cache"))
    run_dir = root / "run"
    assert main(["run", str(recipe), "--run-dir", str(run_dir), "--quiet"]) == 0
    return recipe, run_dir


def test_every_stage_produces_its_outputs(tiny_run, capsys):
    _, run_dir = tiny_run
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(
        ["origin.json", "recipe.yaml", "run.json", *STAGES]
    )
    for stage in STAGES:
        manifest = json.loads((run_dir / stage / "manifest.json").read_text())
        assert manifest["status"] == "completed" and manifest["stage"] == stage
    expected = [
        "distill/mix/de-en/train.jsonl",
        "distill/mix/fr-en/eval.jsonl",
        "pretrain/model/model.safetensors",
        "finetune/de-en/model.safetensors",
        "finetune/fr-en/tokenizer.json",
        "early_exit/head/early_exit.safetensors",
        "early_exit/head/early_exit.json",
        "eagle3/de-en/model.safetensors",
        "eagle3/multilingual/eagle3.json",
        "calibrate/early_exit/report.json",
        "measure/results.jsonl",
        "measure/summary.md",
        "export/export.json",
        "export/de-en/README.md",
        "export/de-en/results.json",
        "export/early_exit/README.md",
        "export/eagle3-fr-en/README.md",
        "export/eagle3-multilingual/config.json",
        "export/routing.json",
    ]
    assert [p for p in expected if not (run_dir / p).is_file()] == []
    rows = [json.loads(line) for line in (run_dir / "measure" / "results.jsonl").read_text().splitlines()]
    assert {r["decoder"] for r in rows} == {"ar", "sd", "rsd_c", "rsd_s", "eesd", "eagle3", "assisted"}
    assert {r["dataset"] for r in rows} == {"de-en", "fr-en"}
    assert all(r["matches_ar"] for r in rows if r["decoder"] != "ar")  # lossless at temperature 0
    items = {i["name"]: i for i in json.loads((run_dir / "export" / "export.json").read_text())["items"]}
    assert items["de-en"]["smoke_passed"] and items["fr-en"]["smoke_passed"]
    assert items["eagle3-de-en"]["kind"] == "eagle3" and items["eagle3-de-en"]["smoke_passed"]
    routing = json.loads((run_dir / "export" / "routing.json").read_text())
    assert routing["heads"] == {"de": "eagle3-de-en", "fr": "eagle3-fr-en"}
    assert routing["heads_fallback"] == "eagle3-multilingual"
    config = json.loads((run_dir / "export" / "eagle3-de-en" / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4  # the measured K
    card = (run_dir / "export" / "eagle3-de-en" / "README.md").read_text()
    assert "EAGLE-3 draft head" in card and "of its held-out answer tokens" in card


def test_show_manifests_and_training_specs_print_the_same_complete_values(tiny_run, capsys):
    recipe, run_dir = tiny_run
    assert main(["show", str(recipe)]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown == yaml.safe_load((run_dir / "recipe.yaml").read_text())
    for stage, block in (("pretrain", "pretrain"), ("finetune", "finetune"), ("early_exit", "early_exit")):
        config = json.loads((run_dir / stage / "manifest.json").read_text())["config"]
        spec = json.loads((run_dir / stage / "spec.json").read_text())
        assert spec["inputs"] == config  # what the training processes ran with
        assert spec["collective_timeout_s"] == 1800.0  # a small mix: the least timeout
        assert config[block] == shown[block]  # every value resolved, none left for the stage to decide
    finetune = shown["finetune"]
    assert finetune["optim"]["lr"] == 3e-5 and finetune["loop"]["epochs"] == 3.0
    assert finetune["temperatures"] == [0.0, 1.0]


def test_rerun_skips_every_stage_and_prints_the_results_table(tiny_run, capsys):
    recipe, run_dir = tiny_run
    before = {s: (run_dir / s / "manifest.json").stat().st_mtime_ns for s in STAGES}
    assert main(["run", str(recipe), "--run-dir", str(run_dir), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.count("skipped (up to date)") == len(STAGES)
    assert before == {s: (run_dir / s / "manifest.json").stat().st_mtime_ns for s in STAGES}
    assert "Wall-clock speedup over ar" in out and "| sd[de-en] K=4 |" in out


def test_in_process_stages_log_progress_lines_with_their_totals(tiny_run, caplog):
    recipe, run_dir = tiny_run

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "polydraft.train.progress"]

    with caplog.at_level("INFO"):
        assert main(["run", str(recipe), "--run-dir", str(run_dir), "--from", "measure", "--force"]) == 0
    assert any(line.startswith("[measure] measured 2/2 groups (100%), ") for line in lines())
    assert lines()[-1].startswith("[export] staged and checked 7/7 folders (100%), ")  # 4 + 3 EAGLE-3 heads
    assert not any("\r" in line for line in lines())
    caplog.clear()
    with caplog.at_level("INFO"):
        assert (
            main(["run", str(recipe), "--run-dir", str(run_dir), "--only", "export", "--force", "--quiet"])
            == 0
        )
    assert lines() == []


def test_a_training_stage_shows_one_readable_line_per_log_every_steps(tiny_run, tmp_path, capfd):
    """Through the CLI, as a user runs it: the training subprocess's lines reach the console whole, one per
    `log_every` steps with the total, epoch, loss, lr, throughput and time left; no bars, no wandb-key dumps;
    `--quiet` silences them."""
    recipe, _ = tiny_run
    command = ["run", str(recipe), "pretrain.loop.log_every=1", "--only", "pretrain"]
    assert main([*command, "--run-dir", str(tmp_path / "shown")]) == 0
    err = capfd.readouterr().err
    lines = [
        line.split(": ", 1)[1] for line in err.splitlines() if "polydraft.train.progress: [pretrain]" in line
    ]
    pattern = (
        r"\[pretrain\] step {}/2 \({}%\), epoch 1, loss \d+\.\d+, lr \d\.\d\de-\d\d, [\d.]+k? tokens/s, "
    )
    assert len(lines) == 2, err
    assert re.match(pattern.format(1, 50) + r"\d+s left$", lines[0]), lines[0]
    assert re.match(pattern.format(2, 100) + "done$", lines[1]), lines[1]
    assert "\r" not in err and "train/loss=" not in err and "it/s]" not in err
    assert main([*command, "--run-dir", str(tmp_path / "quiet"), "--quiet"]) == 0
    assert "[pretrain] step" not in capfd.readouterr().err


def test_export_logs_each_folder_as_a_wandb_model_artifact_when_asked(tiny_run):
    recipe, run_dir = tiny_run
    overrides = ["tracking.mode=offline", "tracking.model_artifacts=true"]
    assert (
        main(
            [
                "run",
                str(recipe),
                *overrides,
                "--run-dir",
                str(run_dir),
                "--only",
                "export",
                "--force",
                "--quiet",
            ]
        )
        == 0
    )
    items = json.loads((run_dir / "export" / "export.json").read_text())["items"]
    (log,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    records = wait_for_record(log, "exit")  # the run's last record: every artifact is logged before it
    logged = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact"]
    artifacts = {a.name: a for a in logged if a.type == "model"}
    assert sorted(artifacts) == sorted(i["repo_name"] for i in items)
    # each measured folder's results table goes along as a wandb Table (a `run_table` artifact to wandb)
    assert sum(a.type == "run_table" for a in logged) == sum(i["measured"] for i in items) == 6
    for item in items:
        files = {entry.path for entry in artifacts[item["repo_name"]].manifest.contents}
        on_disk = {
            str(p.relative_to(run_dir / "export" / item["folder"]))
            for p in (run_dir / "export" / item["folder"]).rglob("*")
            if p.is_file()
        }
        assert files == on_disk and "README.md" in files and "results.json" in files
        assert json.loads(artifacts[item["repo_name"]].metadata)["pair"] == item["pair"]


def test_cli_reports_recipe_errors_with_exit_code_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("target: {path: x}\ndata: {pairs: [de-en]}\nfinetune: {optim: {lr: fast}}\n")
    assert main(["run", str(bad), "--run-dir", str(tmp_path / "run")]) == 2
    assert f"{bad}: finetune.optim.lr: expected float, got 'fast'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_cli_rejects_unknown_arguments(tmp_path, capsys, monkeypatch, tiny_target_dir):
    """An unknown option stops the command before anything runs; the same command without it would run
    (the stages replaced by a recorder), so the test fails on a CLI that ignores what it does not know."""
    import polydraft.pipelines.run.runner

    started = []
    monkeypatch.setattr(
        polydraft.pipelines.run.runner, "run_pipeline", lambda *a, **k: started.append(a) or []
    )
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"target: {{path: {tiny_target_dir}}}\n"
        "data:\n  pairs: [de-en]\n  distill:\n    - {kind: offline, pair: de-en, limit: 4}\n"
    )
    command = ["run", str(recipe), "--run-dir", str(tmp_path / "run")]
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--frobnicate"])
    assert exit_info.value.code == 2  # argparse's usage error
    assert "unrecognized arguments: --frobnicate" in capsys.readouterr().err
    assert not started and not (tmp_path / "run").exists()  # no stage ran, no run directory
    assert main(command) == 0 and len(started) == 1 and (tmp_path / "run").is_dir()
