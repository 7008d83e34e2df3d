"""The pipeline runner: stage order, manifests, skip-if-unchanged, atomic stage folders, resume.

A stage's *key* is the hash of its inputs object (`pipelines.schema.inputs`: exactly the recipe values it
reads) plus the hashes of the upstream manifests it consumes. A stage whose folder holds a manifest with
the same key is up to date and skipped; changing a value a stage reads changes its key, so it reruns, its
new manifest changes the keys of everything downstream, and nothing upstream moves.

While it runs, a stage writes into `<run_dir>/<stage>.partial/`. Only after the stage function returned
and its manifest was written there is that folder renamed to `<run_dir>/<stage>/`, so a folder without
`.partial` is always complete. A crash or kill leaves the `.partial` folder, which a rerun with the same
key resumes from (checkpoints, distilled records). Nothing a run made is deleted without `--force`: a
`.partial` folder left by another config, and a complete folder that a rerun with another config (or other
code) replaces, are moved to `<run_dir>/aside/` with a message that says where.

Each manifest also records the fingerprint of the code that made the folder (`pipelines.run.fingerprint`: the
stage's module and every polydraft module it imports). A folder up to date with the recipe but made by
other code is kept, with a warning naming the stage and the modules that differ, unless `rerun_stale`
(`--rerun-stale`): the closure of every stage holds shared modules (the schema, the runner), so rerunning on
any edit would redo days of distillation for a changed docstring; the user decides.
"""

from __future__ import annotations

import datetime
import logging
import shutil
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polydraft.pipelines.run.fingerprint import CodeFingerprint, code_changes, code_fingerprint
from polydraft.pipelines.run.recipe import dump_recipe
from polydraft.pipelines.run.rundir import move_aside
from polydraft.pipelines.run.side_by_side import parallel_stages, run_side_by_side
from polydraft.pipelines.runtime.contract import PROJECT_ROOT, Stage, StageContext, StageFailed, StageResult
from polydraft.pipelines.runtime.manifest import (
    MANIFEST,
    ManifestError,
    canonical_hash,
    file_hash,
    git_state,
    host_info,
    package_versions,
    stage_manifest,
    write_json_atomic,
)
from polydraft.pipelines.runtime.nodes import NodeLeader, usable_cores
from polydraft.pipelines.runtime.tracking import start_tracking
from polydraft.pipelines.schema import Recipe, ResolvedTarget

log = logging.getLogger(__name__)

KEY_FILE = ".key"
CORES_FILE = ".cores"
"""In a side-by-side stage's work folder while it runs: its share of the cores (`train.runtime.CoreShare`)."""


@dataclass
class StageOutcome:
    name: str
    status: str  # "ran", "skipped (up to date)", "not selected", "disabled"
    metrics: dict[str, Any]
    duration_s: float = 0.0


def _enabled(recipe: Recipe, name: str) -> bool:
    return bool(getattr(getattr(recipe, name), "enabled", True))


def _select(stages: list[Stage], only: str | None, start: str | None) -> set[str]:
    names = [s.name for s in stages]
    for flag, value in (("--only", only), ("--from", start)):
        if value is not None and value not in names:
            raise StageFailed(f"{flag} {value}: no such enabled stage (enabled: {', '.join(names)})")
    if only is not None:
        return {only}
    if start is not None:
        return set(names[names.index(start) :])
    return set(names)


def _swap_into_place(work_dir: Path, final_dir: Path, delete_old: bool, why: str) -> None:
    """Replace `final_dir` by `work_dir` with renames only, so no reader sees a half-written folder. The
    folder replaced is moved aside (`why` says what made it stale), or deleted when `delete_old` (--force)."""
    trash = final_dir.with_name(f".{final_dir.name}.old")
    if trash.exists():
        shutil.rmtree(trash)
    if final_dir.exists():
        if delete_old:
            final_dir.rename(trash)
        else:
            move_aside(final_dir, final_dir.parent, why)
    work_dir.rename(final_dir)
    if trash.exists():
        shutil.rmtree(trash)


def _checked_manifest(final_dir: Path, replace: bool) -> dict[str, Any] | None:
    """The manifest of a completed stage folder. A folder whose manifest is corrupt or lost holds outputs
    nobody can check against the recipe: refuse to skip it and refuse to silently redo it over them,
    unless the stage is being replaced (`--force`)."""
    if replace or not final_dir.exists():
        try:
            return stage_manifest(final_dir)
        except ManifestError:
            return None
    try:
        manifest = stage_manifest(final_dir)
    except ManifestError as err:
        raise StageFailed(
            f"{err}: {final_dir} cannot be checked against the recipe. Restore the manifest, or rerun "
            f"this stage with `--only {final_dir.name} --force` (or delete the folder) to redo it"
        ) from err
    if manifest is None:
        raise StageFailed(
            f"{final_dir} is complete but its {MANIFEST} is missing, so it cannot be checked against the "
            f"recipe. Restore the manifest, or rerun this stage with `--only {final_dir.name} --force` "
            "(or delete the folder) to redo it"
        )
    return manifest


def _prepare_work_dir(work_dir: Path, key: str, force: bool) -> None:
    """Keep a partial folder left by an interrupted run of the same key (to resume); move any other one
    aside (delete it with --force)."""
    key_file = work_dir / KEY_FILE
    if work_dir.exists() and (not key_file.is_file() or key_file.read_text().strip() != key):
        if force:
            log.info("deleting %s (--force): it was left by a run with another config", work_dir)
            shutil.rmtree(work_dir)
        else:
            move_aside(work_dir, work_dir.parent, "was left by a run with another config")
    work_dir.mkdir(parents=True, exist_ok=True)
    key_file.write_text(key + "\n")


def stage_code(stage: Stage) -> CodeFingerprint:
    """The code a stage runs: its module and the polydraft modules it imports."""
    return code_fingerprint(stage.run.__module__)


def code_drift(manifest: dict[str, Any], code: CodeFingerprint) -> list[str]:
    """The modules that differ between the code that made a stage folder and this code (empty: the same)."""
    recorded = (manifest.get("code") or {}).get("modules")
    if recorded is None:
        return ["(the folder records no code: made before polydraft recorded it)"]
    return code_changes(recorded, code.modules)


def stage_key(config: dict[str, Any], upstream_hashes: dict[str, str]) -> str:
    """A stage's key: the hash of its inputs (as JSON) and of the manifests of the upstream stages it
    consumes (file hashes, by stage name). Equal keys mean equal outputs, up to the randomness of a rerun."""
    return canonical_hash({"config": canonical_hash(config), "upstream": upstream_hashes})


@dataclass
class _Job:
    """A stage about to run: what its manifest will record, and its context."""

    stage: Stage
    inputs: Any
    config: dict[str, Any]
    key: str
    upstream_hashes: dict[str, str]
    code: CodeFingerprint
    rerun_for_code: bool
    ctx: StageContext
    started: datetime.datetime = field(default_factory=lambda: datetime.datetime.now(datetime.timezone.utc))
    clock: float = field(default_factory=time.perf_counter)


def run_pipeline(
    recipe: Recipe,
    run_dir: Path,
    stages: list[Stage],
    target: ResolvedTarget,
    *,
    command: str,
    only: str | None = None,
    start: str | None = None,
    force: bool = False,
    rerun_stale: bool = False,
    quiet: bool = False,
    verbose: bool = False,
    leader: NodeLeader | None = None,
    in_process: bool = False,
) -> list[StageOutcome]:
    """Run the recipe's enabled stages, skipping those whose manifest matches (and, unless `rerun_stale`,
    those made by other code, with a warning). A stage starts once its upstream stages are done, in pipeline
    order; with `runner.parallel_stages` N > 1 up to N run at once, each in a thread of its own with its
    share of the CPU cores, and when one fails the others still running finish (and are kept) before the
    failure is raised. `in_process`: one-process training launches run in this process
    (`StageContext.in_process`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    enabled = [s for s in stages if _enabled(recipe, s.name)]
    selected = _select(enabled, only, start)
    enabled_names = {s.name for s in enabled}
    keys: dict[str, str] = {}
    fresh: dict[str, bool] = {}  # stage name -> its folder is complete and up to date
    outcomes = [StageOutcome(s.name, "disabled", {}) for s in stages if s.name not in enabled_names]
    environment = {"git": git_state(PROJECT_ROOT), "packages": package_versions(), "host": host_info()}
    parallel = parallel_stages(recipe, leader, in_process)
    cores = max(1, usable_cores() // parallel) if parallel > 1 else None

    def plan(stage: Stage) -> _Job | None:
        """The job that runs `stage`, or None when it is skipped (its outcome recorded)."""
        final_dir = run_dir / stage.name
        upstream = [u for u in stage.upstream if u in enabled_names]
        missing = [u for u in upstream if not fresh.get(u)]
        manifest = _checked_manifest(final_dir, replace=force and stage.name in selected)
        inputs = stage.inputs(recipe, target)
        config = inputs.model_dump(mode="json")
        upstream_hashes = {u: file_hash(run_dir / u / MANIFEST) for u in upstream if fresh.get(u)}
        key = stage_key(config, upstream_hashes)
        keys[stage.name] = key
        code = stage_code(stage)
        up_to_date = not missing and manifest is not None and manifest.get("key") == key
        drift = code_drift(manifest, code) if up_to_date and manifest is not None else []
        rerun_for_code = bool(drift) and rerun_stale and stage.name in selected
        if stage.name not in selected or (up_to_date and not force and not rerun_for_code):
            fresh[stage.name] = up_to_date
            status = "skipped (up to date)" if up_to_date else "not selected (out of date)"
            if drift:
                status = "skipped (ran with other code)"
                log.warning(
                    "%-10s up to date with the recipe but made by other code: %s. Kept; `--rerun-stale` "
                    "reruns it (and what depends on it)", stage.name, ", ".join(drift),
                )  # fmt: skip
            elif up_to_date or stage.name not in selected:
                log.info("%-10s %s", stage.name, status)
            outcomes.append(StageOutcome(stage.name, status, (manifest or {}).get("metrics", {})))
            return None
        if missing:
            raise StageFailed(
                f"{stage.name} needs {', '.join(missing)}, which "
                f"{'is' if len(missing) == 1 else 'are'} not complete and up to date; "
                "run without --only/--from (or include them) first"
            )
        work_dir = run_dir / f"{stage.name}.partial"
        _prepare_work_dir(work_dir, key, force)
        tracking = recipe.tracking
        tracker = start_tracking(
            stage=stage.name,
            group=tracking.run_name or run_dir.name,
            wandb_dir=run_dir,
            config=config,
            project=tracking.project,
            entity=tracking.entity,
            tags=tracking.tags,
            mode=tracking.mode,
            model_artifacts=tracking.model_artifacts,
        )
        ctx = StageContext(
            name=stage.name,
            run_dir=run_dir,
            work_dir=work_dir,
            upstream={u: run_dir / u for u in upstream},
            tracker=tracker,
            tracking=tracking,
            quiet=quiet,
            verbose=verbose,
            leader=leader,
            in_process=in_process,
            cpu_cores=cores if stage.side_by_side else None,  # a stage alone has every core
            cores_file=work_dir / CORES_FILE if cores is not None and stage.side_by_side else None,
        )
        if ctx.cores_file is not None:
            ctx.cores_file.write_text(str(cores), encoding="utf-8")
        log.info("%-10s running (work dir %s)", stage.name, work_dir)
        return _Job(stage, inputs, config, key, upstream_hashes, code, rerun_for_code, ctx)

    def complete(job: _Job, result: StageResult) -> None:
        """The manifest of a job that returned, and its folder moved into place."""
        name, work_dir = job.stage.name, job.ctx.work_dir
        duration = time.perf_counter() - job.clock
        write_json_atomic(
            work_dir / MANIFEST,
            {
                "stage": name,
                "status": "completed",
                "key": job.key,
                "config_hash": canonical_hash(job.config),
                "config": job.config,
                "upstream": job.upstream_hashes,
                "command": command,
                "started_at": job.started.isoformat(),
                "finished_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "duration_s": round(duration, 3),
                "metrics": result.metrics,
                "code": job.code.record(),
                **environment,
            },
        )
        (work_dir / KEY_FILE).unlink()
        if job.ctx.cores_file is not None:
            job.ctx.cores_file.unlink(missing_ok=True)
        failure = work_dir / "failure.json"
        if failure.exists():
            failure.unlink()
        why = "was made by other code" if job.rerun_for_code else "was made with another config"
        _swap_into_place(work_dir, run_dir / name, delete_old=force, why=why)
        fresh[name] = True
        log.info("%-10s done in %.1f s", name, duration)
        outcomes.append(StageOutcome(name, "ran", result.metrics, duration))

    def share(jobs: list[_Job]) -> None:
        """Each running stage's share of the cores in its cores file, rewritten when it changed."""
        cores = max(1, usable_cores() // len(jobs))
        for job in jobs:
            if job.ctx.cores_file is not None and job.ctx.cpu_cores != cores:
                job.ctx.cpu_cores = cores
                tmp = job.ctx.cores_file.with_name(CORES_FILE + ".tmp")
                tmp.write_text(str(cores), encoding="utf-8")
                tmp.replace(job.ctx.cores_file)  # a training process reads the old share or the new one
                log.info("%-10s %d cores from now on", job.stage.name, cores)

    if parallel == 1:
        for stage in enabled:
            job = plan(stage)
            if job is not None:
                complete(job, _execute(job))
    else:
        run_side_by_side(enabled, enabled_names, parallel, plan, _execute, complete, share)

    order = {s.name: i for i, s in enumerate(stages)}
    outcomes.sort(key=lambda o: order[o.name])
    # written once every selected stage succeeded: a failed run leaves the previous run's recipe
    (run_dir / "recipe.yaml").write_text(dump_recipe(recipe), encoding="utf-8")
    write_json_atomic(
        run_dir / "run.json",
        {
            "command": command,
            "finished_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "stages": [o.__dict__ for o in outcomes],
            "keys": keys,
        },
    )
    return outcomes


def _execute(job: _Job) -> StageResult:
    """Run the job's stage; on failure, its traceback in the stage's log and `failure.json`, then raise."""
    stage, ctx = job.stage, job.ctx
    try:
        result = stage.run(job.inputs, ctx)
    except BaseException as err:
        ctx.tracker.finish(failed=True)
        stage_log = ctx.work_dir / f"{stage.name}.log"
        with open(stage_log, "a", encoding="utf-8") as handle:
            handle.write(f"\n--- {stage.name} failed ---\n{traceback.format_exc()}")
        write_json_atomic(
            ctx.work_dir / "failure.json",
            {
                "stage": stage.name,
                "status": "failed",
                "error": f"{type(err).__name__}: {err}",
                "traceback": traceback.format_exc(),
                "started_at": job.started.isoformat(),
                "failed_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            },
        )
        if isinstance(err, StageFailed) and str(stage_log) not in str(err):
            raise StageFailed(f"{err}\n  details: {stage_log}") from err
        raise
    ctx.tracker.finish()
    return result


def _complete_key(stage_dir: Path) -> str | None:
    """The key of a complete stage folder; None when it has no readable manifest."""
    try:
        manifest = stage_manifest(stage_dir)
    except ManifestError:
        return None
    return None if manifest is None else manifest["key"]


def reuse_outputs(
    recipe: Recipe, run_dir: Path, stages: list[Stage], target: ResolvedTarget, donors: list[Path]
) -> list[tuple[str, Path]]:
    """Copy into `run_dir` every complete stage folder of a donor run directory whose key is the key this
    recipe gives that stage in `run_dir`; returns (stage, donor folder) for each copy.

    Keys are computed in pipeline order exactly as `run_pipeline` computes them, each from the upstream
    manifests already in `run_dir` (its own up-to-date folders, or copies made just before), so a copied
    folder is one `run_pipeline` then skips, and a stage whose upstream is neither up to date nor copied
    is left for `run_pipeline` to run. A folder of `run_dir` that is up to date is kept; one with another
    key is replaced (the run would redo it); one whose manifest is corrupt is left for the runner to
    refuse. A copy is written next to its destination and renamed into place, so no reader sees half of one.

    Keys chain through the upstream manifests' bytes, so a donor's stage matches only when its upstream
    folders are the very ones copied here (not reruns of the same config, whose manifests differ in their
    times): the earlier donor that has a stage is taken, and variants that copy from one another share
    one lineage.
    """
    enabled = [s for s in stages if _enabled(recipe, s.name)]
    names = {s.name for s in enabled}
    fresh: set[str] = set()
    copied: list[tuple[str, Path]] = []
    run_dir.mkdir(parents=True, exist_ok=True)
    for stage in enabled:
        upstream = [u for u in stage.upstream if u in names]
        if any(u not in fresh for u in upstream):
            continue
        config = stage.inputs(recipe, target).model_dump(mode="json")
        key = stage_key(config, {u: file_hash(run_dir / u / MANIFEST) for u in upstream})
        final_dir = run_dir / stage.name
        own = _complete_key(final_dir)
        if own == key:
            fresh.add(stage.name)
            continue
        if final_dir.exists() and own is None:
            continue  # a complete folder nobody can check: the runner says so
        donor = next((d / stage.name for d in donors if _complete_key(d / stage.name) == key), None)
        if donor is None or donor.resolve() == final_dir.resolve():
            continue
        staging = run_dir / f".{stage.name}.reuse"
        if staging.exists():
            shutil.rmtree(staging)
        shutil.copytree(donor, staging, symlinks=True)
        _swap_into_place(
            staging, final_dir, delete_old=False, why=f"was made with another config than {donor}'s"
        )
        partial = run_dir / f"{stage.name}.partial"
        if partial.exists():  # an interrupted run of some config: the copy is complete
            move_aside(partial, run_dir, f"was left by an interrupted run; {donor} is complete")
        fresh.add(stage.name)
        copied.append((stage.name, donor))
        log.info("%-10s reused from %s", stage.name, donor)
    return copied


def stale_stages(recipe: Recipe, run_dir: Path, stages: list[Stage], target: ResolvedTarget) -> list[str]:
    """The enabled stages `run_pipeline` would run in `run_dir` (missing or out of date), found with the
    same keys, without running or copying anything."""
    enabled = [s for s in stages if _enabled(recipe, s.name)]
    names = {s.name for s in enabled}
    fresh: set[str] = set()
    for stage in enabled:
        upstream = [u for u in stage.upstream if u in names]
        if all(u in fresh for u in upstream):
            config = stage.inputs(recipe, target).model_dump(mode="json")
            key = stage_key(config, {u: file_hash(run_dir / u / MANIFEST) for u in upstream})
            if _complete_key(run_dir / stage.name) == key:
                fresh.add(stage.name)
    return [s.name for s in enabled if s.name not in fresh]


def flat_metrics(metrics: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested metrics as `a/b/c` keys, for display; empty and None values left out."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if isinstance(value, dict):
            out |= flat_metrics(value, f"{prefix}{key}/")
        elif value is not None and not isinstance(value, list):
            out[f"{prefix}{key}"] = value
    return out


def summary_table(outcomes: list[StageOutcome]) -> str:
    """A plain-text table of what each stage did and its headline metrics."""
    rows = []
    for outcome in outcomes:
        shown = ", ".join(
            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in list(flat_metrics(outcome.metrics).items())[:6]
        )
        rows.append(
            (outcome.name, outcome.status, f"{outcome.duration_s:.1f}s" if outcome.duration_s else "", shown)
        )
    widths = [max(len(r[i]) for r in [("stage", "status", "time", "metrics"), *rows]) for i in range(4)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(("stage", "status", "time", "metrics"), widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)
