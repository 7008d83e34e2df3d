"""`polydraft publish`: planning, refusals, one commit per repo, clear network errors, no token in files."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from polydraft.pipelines.export.publish import PublishError, publish
from tests.decoding_helpers import single_thread_fixture
from tests.export_setup import build_templates, export_recipe, run_export

single_thread = single_thread_fixture()

SECRET = "hf_polydraftTestSecret0123456789"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_tokenizer, tiny_target_dir):
    """An exported run (de-en and fr-en measured, pretrain not), made with HF_TOKEN set and wandb offline."""
    root = tmp_path_factory.mktemp("publish")
    templates = build_templates(root / "templates", tiny_tokenizer, tiny_target_dir)
    recipe = export_recipe(
        tiny_target_dir,
        {"repo_prefix": "recipe-org/", "smoke_prompts": 1, "smoke_max_new_tokens": 4},
        early_exit={"enabled": False},
        calibrate={"enabled": False},
        tracking={"mode": "offline"},
    )
    saved = os.environ.get("HF_TOKEN")
    os.environ["HF_TOKEN"] = SECRET
    try:
        run_export(recipe, root / "run", templates, tiny_target_dir)
    finally:
        if saved is None:
            del os.environ["HF_TOKEN"]
        else:
            os.environ["HF_TOKEN"] = saved
    return root / "run"


class FakeApi:
    """Records what an HfApi would have been asked to do."""

    def __init__(self, fail_on: str | None = None):
        self.token = SECRET
        self.endpoint = "https://hub.example"
        self.calls: list[tuple] = []
        self.fail_on = fail_on

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))
        if repo_id == self.fail_on:
            raise PermissionError(f"403 Forbidden for token {SECRET}")

    def create_branch(self, repo_id, **kwargs):
        self.calls.append(("create_branch", repo_id, kwargs))

    def create_commit(self, repo_id, operations, **kwargs):
        self.calls.append(("create_commit", repo_id, list(operations), kwargs))

        class Info:
            commit_url = f"https://hub.example/{repo_id}/commit/abc"

        return Info()


class NoNetwork:
    def __init__(self, *args, **kwargs):
        raise AssertionError("a dry run must not create an HfApi")


def test_dry_run_lists_repos_files_and_cards_and_pushes_nothing(run_dir, capsys, monkeypatch):
    import huggingface_hub

    from polydraft.pipelines.cli.main import main

    monkeypatch.setattr(huggingface_hub, "HfApi", NoNetwork)
    code = main(
        ["publish", str(run_dir), "--dry-run", "--repo-prefix", "org/", "--only", "de-en", "--only", "fr-en"]
    )
    out = capsys.readouterr().out
    assert code == 0
    for name in ("de-en", "fr-en"):
        assert f"org/run-drafter-{name} (public, branch main) <- {run_dir / 'export' / name}" in out
        for path in (run_dir / "export" / name).iterdir():
            assert f"  {path.name}  {path.stat().st_size:,} bytes" in out
        assert f'"model": "org/run-drafter-{name}"' in out  # the card, rendered for its repo
    assert "dry run: nothing was pushed (2 repo(s) planned)" in out
    assert not (run_dir / "publish.json").exists()


def test_refuses_unmeasured_or_failed_exports_unless_forced(run_dir, tmp_path):
    with pytest.raises(PublishError, match=r"pretrain: it has no measurements") as refused:
        publish(run_dir, repo_prefix="org/", dry_run=True)
    assert "nothing was pushed" in str(refused.value) and "--force" in str(refused.value)
    forced = publish(run_dir, repo_prefix="org/", dry_run=True, force=True)
    assert [p.name for p in forced] == ["de-en", "fr-en", "pretrain"]
    assert forced[2].warnings[0].startswith("published although it has no measurements")

    broken = tmp_path / "run"
    shutil.copytree(run_dir, broken)
    results = broken / "export" / "de-en" / "results.json"
    info = json.loads(results.read_text(encoding="utf-8"))
    info["smoke"]["passed"] = False
    info["smoke"]["checks"][0] = {"name": "files", "status": "fail", "detail": "missing model.safetensors"}
    results.write_text(json.dumps(info), encoding="utf-8")
    with pytest.raises(
        PublishError, match=r"de-en: its smoke check failed \(files: missing model.safetensors\)"
    ):
        publish(broken, repo_prefix="org/", only=["de-en"], api=FakeApi())


def test_one_commit_per_repo_with_the_card_for_that_repo(run_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    api = FakeApi()
    plans = publish(run, only=["de-en", "fr-en"], private=True, revision="v1", api=api)
    assert [p.repo_id for p in plans] == [
        "recipe-org/run-drafter-de-en",
        "recipe-org/run-drafter-fr-en",
    ]  # export.repo_prefix
    commits = [c for c in api.calls if c[0] == "create_commit"]
    assert [c[1] for c in commits] == [p.repo_id for p in plans]
    assert (
        "create_repo",
        plans[0].repo_id,
        {"repo_type": "model", "private": True, "exist_ok": True},
    ) in api.calls
    assert (
        "create_branch",
        plans[0].repo_id,
        {"branch": "v1", "repo_type": "model", "exist_ok": True},
    ) in api.calls
    _, repo_id, operations, kwargs = commits[0]
    folder = run / "export" / "de-en"
    assert sorted(op.path_in_repo for op in operations) == sorted(p.name for p in folder.iterdir())
    card = next(op for op in operations if op.path_in_repo == "README.md").path_or_fileobj
    assert f'"model": "{repo_id}"'.encode() in card
    info = json.loads((folder / "results.json").read_text(encoding="utf-8"))
    best = info["measurement"]["headline"]
    assert kwargs["revision"] == "v1"
    assert kwargs["commit_message"] == (
        f"polydraft: de-en drafter for a local target ({best['method']}: "
        f"{best['block_efficiency']['mean']:.2f} tokens/call, {best['speedup']['mean']:.2f}x at T=0 on de-en)"
    )
    log = json.loads((run / "publish.json").read_text(encoding="utf-8"))
    assert [e["commit_url"] for e in log] == [f"https://hub.example/{p.repo_id}/commit/abc" for p in plans]


def test_a_failed_push_says_what_was_pushed_and_never_shows_the_token(run_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    api = FakeApi(fail_on="org/run-drafter-fr-en")
    with pytest.raises(PublishError) as failed:
        publish(run, repo_prefix="org/", only=["de-en", "fr-en"], api=api)
    message = str(failed.value)
    assert "org/run-drafter-fr-en: publishing to https://hub.example failed: PermissionError" in message
    assert "Pushed before the failure: ['org/run-drafter-de-en']" in message
    assert SECRET not in message and "***" in message
    assert [e["repo_id"] for e in json.loads((run / "publish.json").read_text())] == ["org/run-drafter-de-en"]


def test_an_unreachable_hub_gives_a_clear_error(run_dir, tmp_path, monkeypatch):
    from huggingface_hub import HfApi, constants

    monkeypatch.setenv("HF_TOKEN", SECRET)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    with pytest.raises(
        PublishError, match=r"publishing to http://127.0.0.1:9 failed: .*Pushed before the failure: nothing"
    ) as failed:
        publish(run, repo_prefix="org/", only=["de-en"], api=HfApi(endpoint="http://127.0.0.1:9"))
    assert SECRET not in str(failed.value)
    assert not (run / "publish.json").exists()


def test_no_token_is_a_clear_error(run_dir, monkeypatch):
    import huggingface_hub
    from huggingface_hub import HfApi

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    with pytest.raises(PublishError, match="no Hugging Face token: set HF_TOKEN"):
        publish(
            run_dir, repo_prefix="org/", only=["de-en"], api=HfApi(endpoint="http://127.0.0.1:9", token=False)
        )


def test_repo_id_rules(run_dir):
    with pytest.raises(PublishError, match="--repo-id names one repo but 2 folders are selected"):
        publish(run_dir, repo_id="org/one", only=["de-en", "fr-en"], dry_run=True)
    with pytest.raises(PublishError, match="not a valid Hub repo id"):
        publish(run_dir, repo_id="org/bad name", only=["de-en"], dry_run=True)
    with pytest.raises(PublishError, match="--only es-en: not exported"):
        publish(run_dir, repo_prefix="org/", only=["es-en"], dry_run=True)
    assert publish(run_dir, repo_id="org/one", only=["de-en"], dry_run=True)[0].repo_id == "org/one"


def test_publish_needs_a_completed_export(tmp_path):
    (tmp_path / "export.partial").mkdir()
    with pytest.raises(
        PublishError, match="no completed export stage .*an interrupted one left export.partial"
    ):
        publish(tmp_path, repo_prefix="org/", dry_run=True)


def test_the_token_is_in_no_file_the_run_wrote(run_dir):
    """The export ran with HF_TOKEN set and wandb offline; publish tests copied and pushed with it set."""
    files = [p for p in Path(run_dir).rglob("*") if p.is_file()]
    assert any("wandb" in p.parts for p in files)  # the offline wandb run is part of the scan
    for path in files:
        assert SECRET.encode() not in path.read_bytes(), path
