"""Running a study: each variant's recipe through the pipeline runner, in its own run directory, reusing
the stage folders other variants (or `--reuse` run directories) already made with the same key."""

from __future__ import annotations

import logging
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

from decoding.results import RESULTS_FILE, read_rows
from pipelines.manifest import read_manifest
from pipelines.preflight import InputError, check_model_folders, check_run_dir
from pipelines.recipe import load_recipe
from pipelines.runner import reuse_outputs, run_pipeline
from pipelines.stage import StageFailed
from pipelines.stages import default_stages
from pipelines.study.findings import VariantData, all_findings
from pipelines.study.report import VariantRecord, write_report
from pipelines.study.variants import MIN_SEEDS, Variant, quick_overrides, variants
from pipelines.target import resolve_target

log = logging.getLogger(__name__)


@dataclass
class StudyOptions:
    recipe: Path
    overrides: list[str]
    study_dir: Path
    command: str
    quick: bool = False
    reuse: list[Path] = field(default_factory=list)
    """Other run directories whose complete stage folders may be copied when their keys match."""
    quiet: bool = False
    verbose: bool = False


def run_study(options: StudyOptions) -> Path:
    """Run every variant (those already complete are skipped stage by stage), then write the report;
    returns the report's path. A variant that fails is recorded and the others still run."""
    check_run_dir(options.study_dir)
    base = [*(quick_overrides(options.study_dir) if options.quick else []), *options.overrides]
    recipe = load_recipe(options.recipe, base)
    if len(recipe.measure.seeds) < MIN_SEEDS:
        raise InputError(
            f"measure.seeds {recipe.measure.seeds}: the study needs at least {MIN_SEEDS} seeds (repetitions) "
            "for its error bars"
        )
    plan = variants(recipe)
    records, data = [], {}
    clock = time.perf_counter()
    for index, variant in enumerate(plan, 1):
        log.info(
            "study: variant %d/%d `%s` (%s)%s", index, len(plan), variant.name, variant.purpose,
            f" [{time.perf_counter() - clock:.0f} s so far]",
        )  # fmt: skip
        record, result = _run_variant(options, base, variant, plan)
        records.append(record)
        data[variant.name] = result
        log.info("study: variant `%s` %s in %.1f s", variant.name, record.status, record.seconds)
    findings = all_findings(data, recipe.measure.draft_length)
    report = write_report(
        options.study_dir, findings, records, command=options.command, quick=options.quick,
        total_seconds=time.perf_counter() - clock,
    )  # fmt: skip
    return report


def _run_variant(
    options: StudyOptions, base: list[str], variant: Variant, plan: list[Variant]
) -> tuple[VariantRecord, VariantData]:
    run_dir = options.study_dir / variant.name
    overrides = [*base, *variant.overrides]
    record = VariantRecord(
        name=variant.name,
        purpose=variant.purpose,
        overrides=list(variant.overrides),
        command=shlex.join(["polydraft", "run", str(options.recipe), *overrides, "--run-dir", str(run_dir)]),
    )
    if variant.skip is not None:
        record.status = f"skipped: {variant.skip}"
        return record, VariantData(status=record.status)
    clock = time.perf_counter()
    recipe = load_recipe(options.recipe, overrides)
    target = resolve_target(recipe.target, recipe.data, show_progress=not options.quiet)
    check_model_folders(recipe, target)
    stages = default_stages()
    donors = [options.study_dir / v.name for v in plan if v.name != variant.name] + options.reuse
    record.reused = {
        stage: str(donor) for stage, donor in reuse_outputs(recipe, run_dir, stages, target, donors)
    }
    try:
        outcomes = run_pipeline(
            recipe, run_dir, stages, target, command=f"{options.command}  # variant {variant.name}",
            quiet=options.quiet, verbose=options.verbose,
        )  # fmt: skip
    except StageFailed as err:
        record.status = f"failed: {str(err).splitlines()[0]}"
        record.seconds = time.perf_counter() - clock
        log.error("study: variant `%s` failed, the study goes on without it: %s", variant.name, err)
        return record, VariantData(status=record.status)
    record.seconds = time.perf_counter() - clock
    record.stages = {o.name: o.duration_s for o in outcomes if o.status == "ran"}
    record.skipped = [o.name for o in outcomes if o.status.startswith("skipped")]
    return record, _collect(run_dir)


def _collect(run_dir: Path) -> VariantData:
    """The measure rows and finetune token counts a completed variant left in its run directory."""
    rows = read_rows(run_dir / "measure" / RESULTS_FILE) if (run_dir / "measure").is_dir() else []
    manifest = read_manifest(run_dir / "finetune") or {}
    pairs = manifest.get("metrics", {}).get("pairs", {})
    tokens = {pair: int(metrics["tokens"]) for pair, metrics in pairs.items()}
    return VariantData(status="ok", rows=rows, finetune_tokens=tokens)
