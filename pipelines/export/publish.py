"""`polydraft publish RUN_DIR`: push the export stage's folders to the Hugging Face Hub.

Each exported folder (`<run_dir>/export/<name>/`, indexed by `export.json`) becomes one model repo,
written in ONE commit (`HfApi.create_commit`) whose message carries the measured headline. The card is
rendered again (`pipelines.export.cards.render_card`) with the repo id it is pushed to, so its usage snippets
load from the right place; every other file is uploaded as exported.

Nothing is pushed when any selected folder failed its smoke check or has no measurements, unless
`force`; `dry_run` returns the plan (repos, files, cards) and touches no network. The token comes from
the environment (`HF_TOKEN`) or the user's `hf auth login`, read by huggingface_hub itself: polydraft
never takes it as an argument, and never writes or logs it (error messages are scrubbed of it).
What was pushed is recorded in `<run_dir>/publish.json` (repo ids, revisions, commit URLs).
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polydraft.pipelines.export.cards import render_card
from polydraft.pipelines.export.records import (
    CARD_FILE,
    INDEX_FILE,
    RESULTS_FILE,
    ExportIndex,
    ExportRecord,
    ExportResults,
)
from polydraft.pipelines.runtime.manifest import MANIFEST, read_manifest, write_json_atomic
from polydraft.pipelines.schema.inputs import ExportInputs

LOG_FILE = "publish.json"


class PublishError(RuntimeError):
    """Publishing cannot go on; the message says why and what to do."""


@dataclass
class RepoPlan:
    """One repo to push: where from, which files, the card and the commit message."""

    name: str
    repo_id: str
    folder: Path
    files: list[str]
    card: str
    commit_message: str
    commit_description: str
    warnings: list[str] = field(default_factory=list)
    commit_url: str | None = None


def read_export(run_dir: Path) -> tuple[ExportIndex, ExportInputs]:
    """The export stage's index and inputs; a clear error when the stage did not complete."""
    export_dir = Path(run_dir) / "export"
    manifest = read_manifest(export_dir)
    if manifest is None or not (export_dir / INDEX_FILE).is_file():
        partial = (Path(run_dir) / "export.partial").exists()
        raise PublishError(
            f"{run_dir}: no completed export stage ({export_dir / MANIFEST} is missing"
            + ("; an interrupted one left export.partial/" if partial else "")
            + "); run `polydraft run RECIPE` (or `--only export`) first"
        )
    index = ExportIndex.model_validate_json((export_dir / INDEX_FILE).read_text(encoding="utf-8"))
    return index, ExportInputs.model_validate(manifest["config"])


def repo_ids(items: list[ExportRecord], repo_id: str | None, repo_prefix: str | None) -> dict[str, str]:
    """Item name -> repo id: `repo_id` for a single item, else `<repo_prefix><repo_name>`."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if repo_id is not None and repo_prefix is not None:
        raise PublishError("give either --repo-id or --repo-prefix, not both")
    if repo_id is not None:
        if len(items) != 1:
            names = ", ".join(i.name for i in items)
            raise PublishError(
                f"--repo-id names one repo but {len(items)} folders are selected ({names}); "
                "use --repo-prefix ORG/, or select one with --only NAME"
            )
        ids = {items[0].name: repo_id}
    elif repo_prefix is not None:
        ids = {i.name: f"{repo_prefix}{i.repo_name}" for i in items}
    else:
        raise PublishError("give --repo-id ORG/NAME or --repo-prefix ORG/ (or set export.repo_prefix)")
    for name, value in ids.items():
        try:
            if value.count("/") != 1:
                raise HFValidationError("expected exactly one `/` (ORG/NAME)")
            validate_repo_id(value)
        except HFValidationError as err:
            raise PublishError(f"{name}: {value!r} is not a valid Hub repo id: {err}") from err
    return ids


def commit_message(info: ExportResults) -> tuple[str, str]:
    """A message that says what the repo holds and what it measured, and a longer description."""
    target = info.target.label or "a local target"
    what = {"early_exit": f"early-exit head for {target}", "heads": f"proposal heads for {target}"}.get(
        info.kind, f"{info.pair or 'generic'} drafter for {target}"
    )
    best = info.measurement.headline
    if best is not None:
        measured = (
            f"{best.method}: {best.block_efficiency.mean:.2f} tokens/call, "
            f"{best.speedup.mean:.2f}x at T={best.temperature:g} on {best.dataset}"
        )
    else:
        measured = "not measured"
    smoke = "passed" if info.smoke.passed else "FAILED"
    git = info.polydraft
    description = (
        f"Exported by polydraft (commit {git.commit or 'unknown'}). Smoke check {smoke}: "
        + ", ".join(f"{c.name} {c.status}" for c in info.smoke.checks)
        + "."
    )
    return f"polydraft: {what} ({measured})", description


def plan(
    run_dir: Path,
    repo_id: str | None = None,
    repo_prefix: str | None = None,
    force: bool = False,
    only: list[str] | None = None,
) -> list[RepoPlan]:
    """What would be pushed; raises PublishError for a failed smoke check or no measurements
    (unless `force`), so that nothing is pushed at all."""
    index, inputs = read_export(run_dir)
    items = index.items
    if only:
        unknown = sorted(set(only) - {i.name for i in items})
        if unknown:
            names = ", ".join(i.name for i in items)
            raise PublishError(f"--only {', '.join(unknown)}: not exported (exported: {names})")
        items = [i for i in items if i.name in only]
    if not items:
        raise PublishError(f"{run_dir}: the export stage exported nothing")
    default_prefix = inputs.export.repo_prefix
    if repo_id is None and repo_prefix is None:
        repo_prefix = default_prefix
    ids = repo_ids(items, repo_id, repo_prefix)
    plans, refusals = [], []
    for item in items:
        folder = Path(run_dir) / "export" / item.folder
        info = ExportResults.model_validate_json((folder / RESULTS_FILE).read_text(encoding="utf-8"))
        problems = []
        if not info.smoke.passed:
            failed = [f"{c.name}: {c.detail}" for c in info.smoke.checks if c.status == "fail"]
            problems.append(f"its smoke check failed ({'; '.join(failed)})")
        if not info.measurement.measured:
            problems.append("it has no measurements (the measure stage did not measure it)")
        if problems and not force:
            refusals.append(f"{item.name}: {' and '.join(problems)}")
        message, description = commit_message(info)
        files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
        plans.append(
            RepoPlan(
                name=item.name,
                repo_id=ids[item.name],
                folder=folder,
                files=files,
                card=render_card(info, ids[item.name]),
                commit_message=message,
                commit_description=description,
                warnings=[f"published although {p}" for p in problems]
                + ([] if info.target.id else ["the target is a local model: the card names no base_model"]),
            )
        )
    if refusals:
        raise PublishError(
            "refusing to publish; nothing was pushed:\n  "
            + "\n  ".join(refusals)
            + "\nfix the export (or measure it) and rerun, or pass --force to publish anyway"
        )
    return plans


def describe(plans: list[RepoPlan], private: bool, revision: str | None, cards: bool = True) -> str:
    """A readable listing of a plan (what --dry-run prints)."""
    lines = []
    for p in plans:
        visibility = "private" if private else "public"
        lines.append(f"{p.repo_id} ({visibility}, branch {revision or 'main'}) <- {p.folder}")
        lines.append(f"  commit: {p.commit_message}")
        for name in p.files:
            size = (p.folder / name).stat().st_size
            note = " (card rendered for this repo)" if name == CARD_FILE else ""
            lines.append(f"  {name}  {size:,} bytes{note}")
        lines += [f"  warning: {w}" for w in p.warnings]
        if cards:
            lines += ["", f"----- {p.repo_id}/{CARD_FILE} -----", p.card, "-----", ""]
    return "\n".join(lines)


def _secrets(api: Any) -> list[str]:
    from huggingface_hub import get_token

    return [t for t in {getattr(api, "token", None), get_token()} if isinstance(t, str) and t]


def _scrub(text: str, secrets: list[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


def push(api: Any, p: RepoPlan, private: bool, revision: str | None) -> str:
    """Create the repo (and branch) and upload the folder in one commit; returns the commit URL."""
    from huggingface_hub import CommitOperationAdd

    api.create_repo(p.repo_id, repo_type="model", private=private, exist_ok=True)
    if revision is not None:
        api.create_branch(p.repo_id, branch=revision, repo_type="model", exist_ok=True)
    operations = [
        CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(p.folder / name))
        for name in p.files
        if name != CARD_FILE
    ]
    operations.append(CommitOperationAdd(path_in_repo=CARD_FILE, path_or_fileobj=p.card.encode("utf-8")))
    info = api.create_commit(
        p.repo_id,
        operations,
        commit_message=p.commit_message,
        commit_description=p.commit_description,
        repo_type="model",
        revision=revision,
    )
    return str(info.commit_url)


def publish(
    run_dir: str | Path,
    repo_id: str | None = None,
    repo_prefix: str | None = None,
    private: bool = False,
    revision: str | None = None,
    dry_run: bool = False,
    force: bool = False,
    only: list[str] | None = None,
    api: Any = None,
) -> list[RepoPlan]:
    """Push the export of `run_dir` (one commit per repo); `dry_run` only plans. `api`: an `HfApi`
    (default: a new one, which finds the token in HF_TOKEN or the user's login)."""
    run_dir = Path(run_dir)
    plans = plan(run_dir, repo_id, repo_prefix, force, only)
    if dry_run:
        return plans
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi(library_name="polydraft")
    secrets = _secrets(api)
    if not secrets:
        raise PublishError(
            "no Hugging Face token: set HF_TOKEN in the environment or run `hf auth login` "
            "(polydraft never takes a token on its command line)"
        )
    log_path = run_dir / LOG_FILE
    history = json.loads(log_path.read_text(encoding="utf-8")) if log_path.is_file() else []
    for p in plans:
        try:
            p.commit_url = push(api, p, private, revision)
        except Exception as err:  # network, auth, permissions: report what was done and what was not
            done = [q.repo_id for q in plans if q.commit_url]
            raise PublishError(
                _scrub(
                    f"{p.repo_id}: publishing to {getattr(api, 'endpoint', 'the Hub')} failed: "
                    f"{type(err).__name__}: {err}. Pushed before the failure: {done or 'nothing'}; "
                    "rerun the same command once the problem is fixed (pushing again is safe).",
                    secrets,
                )
            ) from None
        history.append(
            {
                "repo_id": p.repo_id,
                "name": p.name,
                "revision": revision or "main",
                "private": private,
                "commit_url": p.commit_url,
                "files": p.files,
                "published_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            }
        )
        write_json_atomic(log_path, history)
    return plans
