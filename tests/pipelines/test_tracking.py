"""wandb tracking works offline and writes the logged metrics into the local run folder."""

from __future__ import annotations

import json

from polydraft.pipelines.runtime.tracking import Tracker, start_tracking
from tests.wandb_log import wait_for_record


def offline_tracker(tmp_path, stage: str, model_artifacts: bool = False, **config):
    return start_tracking(
        stage=stage,
        group="demo",
        wandb_dir=tmp_path,
        config=config,
        project="polydraft-test",
        entity=None,
        tags=["test"],
        mode="offline",
        model_artifacts=model_artifacts,
    )


def test_offline_run_folder_holds_logged_metrics(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tracker = offline_tracker(tmp_path, "finetune", lr=3e-5)
    assert tracker.run_dir is None  # nothing logged yet: no run started
    tracker.log({"loss": 1.25, "tokens_per_s": 100.0}, step=1)
    tracker.log({"loss": 0.5}, step=2)
    tracker.summary({"final_loss": 0.5})
    tracker.finish()
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    records = wait_for_record(runs[0], "summary")
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.run_group == "demo" and run.display_name == "demo/finetune" and run.job_type == "finetune"
    history = [
        {i.key or "/".join(i.nested_key): i.value_json for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    assert [(h["_step"], h["loss"]) for h in history] == [("1", "1.25"), ("2", "0.5")]
    assert history[0]["tokens_per_s"] == "100"
    summary = {
        i.key or "/".join(i.nested_key): i.value_json
        for r in records
        if r.WhichOneof("record_type") == "summary"
        for i in r.summary.update
    }
    assert summary["final_loss"] == "0.5"


def test_disabled_tracking_only_logs_to_console(tmp_path, caplog):
    tracker = start_tracking(
        stage="measure",
        group="g",
        wandb_dir=tmp_path,
        config={},
        project="p",
        entity=None,
        tags=[],
        mode="disabled",
    )
    with caplog.at_level("INFO", logger="polydraft.pipelines.runtime.tracking"):
        tracker.log({"speedup": 1.5}, step=3)
    tracker.finish()
    assert "[measure] step 3 speedup=1.5" in caplog.text
    assert not (tmp_path / "wandb").exists()
    assert isinstance(tracker, Tracker)


def test_an_exported_folder_becomes_a_model_artifact_with_its_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "export" / "de-en"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "README.md").write_text("# card")
    off = offline_tracker(tmp_path / "off", "export")  # tracking.model_artifacts false: nothing logged
    off.log_artifact("demo-drafter-de-en", folder, {"pair": "de-en"})
    off.finish()
    assert not (tmp_path / "off").exists()
    tracker = offline_tracker(tmp_path, "export", model_artifacts=True)
    tracker.log_artifact("demo-drafter-de-en", folder, {"pair": "de-en", "smoke_passed": True})
    tracker.finish()
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    records = wait_for_record(runs[0], "artifact")
    artifacts = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact"]
    assert [(a.name, a.type) for a in artifacts] == [("demo-drafter-de-en", "model")]
    assert sorted(entry.path for entry in artifacts[0].manifest.contents) == ["README.md", "config.json"]
    assert json.loads(artifacts[0].metadata) == {"pair": "de-en", "smoke_passed": True}
