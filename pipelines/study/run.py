"""Running a study: each variant's recipe through the pipeline runner, in its own run directory, reusing
the stage folders other variants (or `--reuse` run directories) already made with the same key."""

from __future__ import annotations

import logging
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

from polydraft.decoding.measurement.results import RESULTS_FILE, read_rows
from polydraft.pipelines.run.preflight import InputError, check_model_folders, check_run_dir
from polydraft.pipelines.run.recipe import load_recipe
from polydraft.pipelines.run.runner import reuse_outputs, run_pipeline, stale_stages
from polydraft.pipelines.runtime.contract import StageFailed
from polydraft.pipelines.runtime.manifest import MANIFEST, file_hash, read_manifest
from polydraft.pipelines.runtime.target import resolve_target
from polydraft.pipelines.stages import default_stages
from polydraft.pipelines.study.findings import all_findings, sanity_checks
from polydraft.pipelines.study.model import VariantData
from polydraft.pipelines.study.report import VariantRecord, write_report
from polydraft.pipelines.study.variants import MIN_SEEDS, Variant, quick_overrides, variants

log = logging.getLogger(__name__)


@dataclass
class StudyOptions:
    recipe: Path
    overrides: list[str]
    study_dir: Path
    command: str
    quick: bool = False
    only: list[str] = field(default_factory=list)
    """Run only these variants (`full`: every variant, `make study-full`); the others' results are read
    from their run directories when those are complete and up to date (else their findings are `not
    run`). Empty: the variants of `make study` (and, with `quick`, the `full` ones too)."""
    reuse: list[Path] = field(default_factory=list)
    """Other run directories whose complete stage folders may be copied when their keys match."""
    quiet: bool = False
    verbose: bool = False


def run_study(options: StudyOptions) -> Path:
    """Run the variants (stages already complete are skipped), then write the report; returns its path.
    A variant that fails is recorded and the others still run."""
    check_run_dir(options.study_dir)
    base = [*(quick_overrides(options.study_dir) if options.quick else []), *options.overrides]
    recipe = load_recipe(options.recipe, base)
    if len(recipe.measure.seeds) < MIN_SEEDS:
        raise InputError(
            f"measure.seeds {recipe.measure.seeds}: the study needs at least {MIN_SEEDS} seeds (repetitions) "
            "for its error bars"
        )
    if not recipe.measure.disjoint_prompts:
        raise InputError(
            "measure.disjoint_prompts is false: the study pairs the arms of each check by repetition and "
            "prompt position (pipelines.study.arms), which name one prompt only when every repetition "
            "decodes its own prompts"
        )
    plan = variants(recipe, options.study_dir)
    unknown = sorted(set(options.only) - {v.name for v in plan} - {FULL})
    if unknown:
        raise InputError(
            f"--only {', '.join(unknown)}: no such variant (variants: {', '.join(v.name for v in plan)}; "
            f"`{FULL}`: every variant, `make study-full`)"
        )
    selected = [v for v in plan if chosen(v, options.only, options.quick)]
    records, data = [], {}
    clock = time.perf_counter()
    for variant in plan:
        if variant in selected:
            number = selected.index(variant) + 1
            log.info(
                "study: variant %d/%d `%s`: %s [%.0f s so far]", number, len(selected), variant.name,
                variant.purpose, time.perf_counter() - clock,
            )  # fmt: skip
        why = "not in --only" if options.only else f"in `make study-full` only (`--only {FULL}`)"
        record, result = _variant(options, base, variant, plan, variant in selected, why)
        records.append(record)
        data[variant.name] = result
        if variant in selected:
            log.info("study: variant `%s` %s in %.1f s", variant.name, record.status, record.seconds)
    _account(options.study_dir, records)
    return write_report(
        options.study_dir,
        all_findings(
            data, recipe.measure.draft_length, list(recipe.data.pairs), recipe.early_exit.num_shared_layers,
            recipe.pretrain.drafter.num_layers,
        ),
        sanity_checks(data), records,
        command=options.command, quick=options.quick, total_seconds=time.perf_counter() - clock,
    )  # fmt: skip


FULL = "full"
"""`--only full`: every variant, those of `make study` and the headline tables (`Variant.full`)."""


def chosen(variant: Variant, only: list[str], quick: bool) -> bool:
    """Whether this invocation runs `variant`: the ones `--only` names (`full`: all of them); without
    `--only`, those of `make study` (`--quick` runs the `make study-full` ones too)."""
    if only:
        return FULL in only or variant.name in only
    return quick or not variant.full


def _variant(
    options: StudyOptions,
    base: list[str],
    variant: Variant,
    plan: list[Variant],
    selected: bool,
    why: str = "not in --only",
) -> tuple[VariantRecord, VariantData]:
    """Run one variant (or, when not selected (`why`), read what an earlier run left up to date)."""
    run_dir = options.study_dir / variant.name
    overrides = [*base, *variant.overrides]
    record = VariantRecord(
        name=variant.name, purpose=variant.purpose, overrides=list(variant.overrides),
        command=shlex.join(["polydraft", "run", str(options.recipe), *overrides, "--run-dir", str(run_dir)]),
    )  # fmt: skip
    if variant.skip is not None:
        record.status = f"skipped: {variant.skip}"
        return record, VariantData(status=record.status)
    clock = time.perf_counter()
    recipe = load_recipe(options.recipe, overrides)
    target = resolve_target(recipe.target, recipe.data, show_progress=not options.quiet)
    stages = default_stages()
    if not selected:
        stale = stale_stages(recipe, run_dir, stages, target)
        if not run_dir.is_dir():
            record.status = f"not run: {why}, and never run in this study directory"
        elif stale:
            record.status = f"not run: {why}, and {', '.join(stale)} not up to date in {run_dir}"
        if stale:
            return record, VariantData(status=record.status)
        return record, _collect(run_dir)
    check_model_folders(recipe, target)
    donors = [options.study_dir / v.name for v in plan if v.name != variant.name] + options.reuse
    reuse_outputs(recipe, run_dir, stages, target, donors)
    try:
        outcomes = run_pipeline(
            recipe, run_dir, stages, target, command=f"{options.command}  # variant {variant.name}",
            quiet=options.quiet, verbose=options.verbose, in_process=options.quick,
        )  # fmt: skip
    except StageFailed as err:
        record.status = f"failed: {str(err).splitlines()[0]}"
        record.seconds = time.perf_counter() - clock
        log.error("study: variant `%s` failed, the study goes on without it: %s", variant.name, err)
        return record, VariantData(status=record.status)
    record.seconds = time.perf_counter() - clock
    record.ran = [o.name for o in outcomes if o.status == "ran"]
    return record, _collect(run_dir)


def _collect(run_dir: Path) -> VariantData:
    """The measure rows and finetune token counts a completed variant left in its run directory."""
    rows = read_rows(run_dir / "measure" / RESULTS_FILE) if (run_dir / "measure").is_dir() else []
    manifest = read_manifest(run_dir / "finetune") or {}
    pairs = manifest.get("metrics", {}).get("pairs", {})
    tokens = {pair: int(metrics["tokens"]) for pair, metrics in pairs.items()}
    return VariantData(status="ok", rows=rows, finetune_tokens=tokens)


def _account(study_dir: Path, records: list[VariantRecord]) -> None:
    """Which variant made each stage folder and in how long (its manifest's duration), and which variants
    hold a copy of it: a copy has the very manifest, byte for byte, of the folder it was copied from."""
    made_by: dict[str, str] = {}
    for record in records:
        for stage in (s.name for s in default_stages()):
            path = study_dir / record.name / stage / MANIFEST
            manifest = read_manifest(path.parent)
            if manifest is None:
                continue
            digest = file_hash(path)
            if digest in made_by:
                record.shared[stage] = made_by[digest]
            else:
                made_by[digest] = record.name
                record.made[stage] = float(manifest.get("duration_s", 0.0))
