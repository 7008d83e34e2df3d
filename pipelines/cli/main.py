"""The `polydraft` command line."""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from polydraft.distill.engines import run_share
from polydraft.pipelines.run.preflight import (
    OFFLINE,
    InputError,
    check_recipe,
    check_run_dir,
    findings_table,
    raise_problems,
)
from polydraft.pipelines.run.recipe import RecipeError, dump_recipe, load_recipe
from polydraft.pipelines.run.rundir import RunDirTaken, claim_run_dir, default_run_dir
from polydraft.pipelines.runtime.contract import StageFailed
from polydraft.pipelines.runtime.launch import join_launch
from polydraft.pipelines.runtime.nodes import Machines, NodeError, NodeLeader, follow, this_node
from polydraft.pipelines.runtime.process import configure_logging

log = logging.getLogger("polydraft.pipelines.cli.main")

EXIT_BAD_INPUT = 2
"""A recipe, option, folder or file that is refused before (or, for data, while) work starts."""
EXIT_STAGE_FAILED = 1
"""A stage stopped for a reason it names (a failed subprocess, failed requests, a NaN loss, ...)."""
EXIT_CRASH = 3
"""An unexpected error (a bug or an unhandled fault): the traceback is written to a file named in the message."""
EXIT_INTERRUPTED = 130

STAGE_NAMES = (
    "distill", "pretrain", "finetune", "heads", "eagle3", "early_exit", "calibrate", "measure", "export",
)  # fmt: skip


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", type=Path, help="recipe YAML file")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value", help="override recipe values")
    parser.add_argument("--quiet", action="store_true", help="warnings only, no progress bars")
    parser.add_argument("--verbose", action="store_true", help="debug logging")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="polydraft", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run a recipe's stages (skipping those already up to date)")
    _common(run)
    run.add_argument(
        "--run-dir", type=Path,
        help="run directory (default: runs/<the recipe's path under recipes/>, e.g. runs/vicuna-7b/de)",
    )  # fmt: skip
    run.add_argument(
        "--from", dest="start", choices=STAGE_NAMES, help="start at this stage; earlier ones must be complete"
    )
    run.add_argument("--only", choices=STAGE_NAMES, help="run only this stage")
    run.add_argument(
        "--force", action="store_true",
        help="rerun the selected stages even if up to date; delete (not move aside) what they replace; "
        "run in a directory another recipe file made",
    )  # fmt: skip
    run.add_argument(
        "--rerun-stale", action="store_true",
        help="rerun the stages whose folders other code made (kept by default, with a warning)",
    )  # fmt: skip
    run.add_argument(
        "--node-rank", type=int, metavar="R",
        help="this node's rank when launch.accelerate_config has num_machines > 1 (default: the config's "
        "machine_rank); node 0 runs the pipeline, the others join its training launches",
    )  # fmt: skip
    run.add_argument(
        "--node-timeout", type=float, default=600.0, metavar="SECONDS",
        help="several nodes: how long to wait for the other nodes to be seen in the shared run directory",
    )  # fmt: skip
    run.add_argument(
        "--in-process", action="store_true",
        help="train in this process instead of `accelerate launch` (one plain process only): no subprocess "
        "start, and a debugger reaches the training code",
    )  # fmt: skip

    status = commands.add_parser(
        "status", help="what a rerun would do to each stage of a run directory, and why (runs nothing)"
    )
    status.add_argument("run_dir", type=Path, help="a run directory")
    status.add_argument(
        "--recipe", type=Path, help="the recipe to compare with (default: the one its latest run used)"
    )
    status.add_argument(
        "overrides", nargs="*", metavar="key.path=value",
        help="overrides (default: those of its latest run, when --recipe is not given)",
    )  # fmt: skip
    status.add_argument("--quiet", action="store_true")
    status.add_argument("--verbose", action="store_true")

    recipes = commands.add_parser("recipes", help="list the shipped recipes, or copy one to edit")
    recipes.add_argument(
        "--copy", nargs=2, metavar=("NAME", "DEST"),
        help="write recipe NAME (as listed) as one standalone file DEST, its `extends` chain merged",
    )  # fmt: skip
    recipes.add_argument("--quiet", action="store_true")
    recipes.add_argument("--verbose", action="store_true")

    check = commands.add_parser(
        "check",
        help="open every data source and model a recipe's enabled stages read, render one prompt, check wandb "
        "and the free disk; report every problem at once (exit 2), run nothing",
    )
    _common(check)
    check.add_argument(
        "--run-dir", type=Path, help="the run directory whose free space to check (default: as run)"
    )

    plan = commands.add_parser(
        "plan",
        help="estimate each stage's tokens, hours, GPU-hours and peak memory per GPU on a cluster; "
        "warn about idle GPUs and memory that will not fit (runs nothing)",
    )
    _common(plan)
    plan.add_argument("--gpus", required=True, help="GPUs per node, e.g. 8xA100-80GB, 8xH100-80GB")
    plan.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    plan.add_argument(
        "--distill-engines", type=int, metavar="N",
        help="vLLM engines distilling at once (default: what the recipe runs)",
    )  # fmt: skip

    show = commands.add_parser("show", help="print the fully resolved recipe (defaults included)")
    _common(show)

    boot = commands.add_parser("bootstrap", help="build (or find in the cache) a recipe's bootstrap target")
    _common(boot)

    merge = commands.add_parser("merge-shards", help="join the distill folders of a sharded distillation")
    merge.add_argument("shards", nargs="+", type=Path, help="distill stage folders of shards 0..N-1")
    merge.add_argument("--out", type=Path, required=True, help="output folder (must not exist)")
    merge.add_argument("--quiet", action="store_true")
    merge.add_argument("--verbose", action="store_true")

    study = commands.add_parser(
        "study", help="run variants of a recipe and report which of the seeds' findings they reproduce"
    )
    _common(study)
    study.add_argument(
        "--study-dir", type=Path, default=Path("runs/study"),
        help="one run directory per variant, report.md and plots (default: runs/study)",
    )  # fmt: skip
    study.add_argument(
        "--quick",
        action="store_true",
        help="tiny models and data, trained in this process (`run --in-process`): every part of the report",
    )
    study.add_argument(
        "--only", action="append", default=[], metavar="VARIANT",
        help="run only this variant (repeatable); the report reads the others where they are up to date",
    )  # fmt: skip
    study.add_argument(
        "--reuse", type=Path, action="append", default=[], metavar="RUN_DIR",
        help="also copy complete stage folders with matching keys from this run directory (repeatable)",
    )  # fmt: skip

    _publish_parser(commands)
    return parser


def _study(args: argparse.Namespace) -> int:
    from polydraft.pipelines.study.run import StudyOptions, run_study

    report = run_study(
        StudyOptions(
            recipe=args.recipe, overrides=args.overrides, study_dir=args.study_dir,
            command=shlex.join(["polydraft", *sys.argv[1:]]), quick=args.quick, only=args.only,
            reuse=args.reuse,
            quiet=args.quiet, verbose=args.verbose,
        )
    )  # fmt: skip
    print(f"\nstudy report: {report}")
    print(report.read_text(encoding="utf-8").split("## The rule")[0].split("## Summary")[1].strip())
    return 0


# ----------------------------------------------------------------------------- publish (pipelines/export/publish.py)


def _publish_parser(commands: argparse._SubParsersAction) -> None:
    publish = commands.add_parser(
        "publish",
        help="push the export stage's folders to the Hugging Face Hub (token: HF_TOKEN or `hf auth login`)",
    )
    publish.add_argument("run_dir", type=Path, help="run directory holding a completed export stage")
    where = publish.add_mutually_exclusive_group()
    where.add_argument("--repo-id", help="ORG/NAME, when one folder is published")
    where.add_argument(
        "--repo-prefix", help="ORG/ (or ORG/prefix-): one repo per folder (default: export.repo_prefix)"
    )
    publish.add_argument(
        "--only", action="append", metavar="NAME", help="publish only this folder (repeatable)"
    )
    publish.add_argument("--private", action="store_true", help="create the repos private")
    publish.add_argument("--revision", metavar="BRANCH", help="push to this branch (created if missing)")
    publish.add_argument(
        "--dry-run", action="store_true", help="print the repos, files and cards; push nothing"
    )
    publish.add_argument(
        "--force",
        action="store_true",
        help="publish even a folder whose smoke check failed or that has no measurements",
    )
    publish.add_argument("--quiet", action="store_true")
    publish.add_argument("--verbose", action="store_true")


def _publish(args: argparse.Namespace) -> int:
    from polydraft.pipelines.export.publish import PublishError, describe, publish

    try:
        plans = publish(
            args.run_dir,
            repo_id=args.repo_id,
            repo_prefix=args.repo_prefix,
            private=args.private,
            revision=args.revision,
            dry_run=args.dry_run,
            force=args.force,
            only=args.only,
        )
    except PublishError as err:
        print(f"polydraft: {err}", file=sys.stderr)
        return 1
    if args.dry_run:
        print(describe(plans, args.private, args.revision))
        print(f"dry run: nothing was pushed ({len(plans)} repo(s) planned)")
    else:
        for plan in plans:
            print(f"{plan.repo_id}: {plan.commit_url}")
    return 0


def _run(args: argparse.Namespace) -> int:
    from polydraft.pipelines.run.runner import run_pipeline, summary_table
    from polydraft.pipelines.run.summary import results_summary
    from polydraft.pipelines.runtime.target import resolve_target
    from polydraft.pipelines.stages import default_stages

    recipe = load_recipe(args.recipe, args.overrides)
    run_dir = args.run_dir or default_run_dir(args.recipe)
    check_run_dir(run_dir)
    try:
        machines = this_node(recipe, args.node_rank)
    except NodeError as err:
        raise InputError(str(err)) from err
    if machines.rank > 0:
        return _follow(run_dir, machines, args)
    target = resolve_target(recipe.target, recipe.data, show_progress=not args.quiet)
    findings = check_recipe(recipe, target, run_dir)
    for finding in findings:
        if finding.status == OFFLINE:
            log.warning("%s (%s): %s", finding.key, finding.what, OFFLINE)
    raise_problems(findings)
    command = shlex.join(["polydraft", *sys.argv[1:]])
    claim_run_dir(run_dir, args.recipe, args.overrides, command, force=args.force)
    leader = NodeLeader(run_dir, machines) if machines.nodes > 1 else None
    if leader is not None:
        try:
            leader.start(args.node_timeout)
        except NodeError as err:
            raise InputError(str(err)) from err
    try:
        outcomes = run_pipeline(
            recipe,
            run_dir,
            default_stages(),
            target,
            command=command,
            only=args.only,
            start=args.start,
            force=args.force,
            rerun_stale=args.rerun_stale,
            quiet=args.quiet,
            verbose=args.verbose,
            leader=leader,
            in_process=args.in_process,
        )
    except BaseException as err:
        if leader is not None:
            leader.stop(f"{type(err).__name__}: {err}")
        raise
    if leader is not None:
        leader.stop()
    print(f"\nrun directory: {run_dir}\n")
    print(summary_table(outcomes))
    results = results_summary(run_dir)
    if results:
        print(f"\n{results}")
    return 0


def _follow(run_dir: Path, machines: Machines, args: argparse.Namespace) -> int:
    """Another node than node 0: join node 0 through the shared run directory, then each training launch,
    distillation (this node's engines) and measure stage (this node's measure processes) it announces."""

    def join(event: dict[str, Any], gone: Callable[[], str | None]) -> None:
        if event["kind"] == "engines":
            run_share(event, machines.rank, gone)
        elif event["kind"] == "measure":
            from polydraft.pipelines.stages.measure import run_share as run_measure_share

            run_measure_share(event, machines.rank, gone)
        else:
            join_launch(event, run_dir, machines, args.quiet)

    try:
        launches = follow(run_dir, machines.rank, args.node_timeout, join)
    except NodeError as err:
        raise StageFailed(str(err)) from err
    print(f"\nnode {machines.rank} of {machines.nodes}: joined {launches} launch(es) of node 0 in {run_dir}")
    return 0


def _check(args: argparse.Namespace) -> int:
    from polydraft.pipelines.runtime.target import resolve_target

    recipe = load_recipe(args.recipe, args.overrides)
    target = resolve_target(recipe.target, recipe.data, show_progress=not args.quiet)
    findings = check_recipe(recipe, target, args.run_dir or default_run_dir(args.recipe))
    print(findings_table(findings))
    problems = sum(f.status == "problem" for f in findings)
    offline = sum(f.status == OFFLINE for f in findings)
    print(f"\n{len(findings)} inputs: {problems} problem(s), {offline} {OFFLINE}")
    return EXIT_BAD_INPUT if problems else 0


def _plan(args: argparse.Namespace) -> int:
    from polydraft.pipelines.plan.estimate import estimate
    from polydraft.pipelines.plan.printing import plan_table
    from polydraft.pipelines.runtime.cluster import PlanError, parse_gpus

    recipe = load_recipe(args.recipe, args.overrides)
    try:
        plan = estimate(recipe, parse_gpus(args.gpus, args.nodes), args.distill_engines)
    except PlanError as err:
        raise InputError(str(err)) from err
    print(plan_table(plan))
    return 0


def _status(args: argparse.Namespace) -> int:
    from polydraft.pipelines.cli.status import stage_states, status_table
    from polydraft.pipelines.run.rundir import ORIGIN_FILE, read_origin
    from polydraft.pipelines.runtime.target import resolve_target
    from polydraft.pipelines.stages import default_stages

    if not args.run_dir.is_dir():
        raise InputError(f"{args.run_dir}: no such run directory")
    recipe_file, overrides = args.recipe, args.overrides
    if recipe_file is None:
        origin = read_origin(args.run_dir)
        if origin is None:
            raise InputError(
                f"{args.run_dir} has no readable {ORIGIN_FILE} naming its recipe: give it with --recipe"
            )
        recipe_file, overrides = Path(origin["recipe"]), overrides or origin["overrides"]
    recipe = load_recipe(recipe_file, overrides)
    target = resolve_target(recipe.target, recipe.data, show_progress=False, build=False)
    print(f"{args.run_dir}: {shlex.join(['polydraft', 'run', str(recipe_file), *overrides])}\n")
    print(status_table(stage_states(recipe, args.run_dir, default_stages(), target)))
    return 0


def _recipes(args: argparse.Namespace) -> int:
    from polydraft.pipelines.run.recipe import copy_recipe, shipped_recipes
    from polydraft.pipelines.runtime.contract import PROJECT_ROOT

    root = PROJECT_ROOT / "recipes"
    if not root.is_dir():
        raise InputError(f"{root}: no recipes here (they ship with a clone of the repository)")
    found = {r.name: r for r in shipped_recipes(root)}
    if args.copy:
        name, destination = args.copy
        name = name.removeprefix("recipes/").removesuffix(".yaml")
        if name not in found:
            raise InputError(f"--copy {args.copy[0]}: no such recipe (see `polydraft recipes`)")
        copy_recipe(found[name].path, Path(destination))
        print(
            f"{destination}: standalone copy of {found[name].path}; run it with `polydraft run {destination}`"
        )
        return 0
    for recipe in found.values():
        print(f"{recipe.name}\n    {recipe.description}\n    $ {recipe.launch}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # overrides may come after options (`run r.yaml --force a.b=1`); argparse leaves those in `extra`
    unknown = [e for e in extra if e.startswith("-") or "=" not in e or not hasattr(args, "overrides")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    # library bars only where a terminal redraws them
    configure_logging(args.quiet, args.verbose, bars=sys.stderr.isatty() and not args.quiet)
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "check":
            return _check(args)
        if args.command == "plan":
            return _plan(args)
        if args.command == "show":
            print(dump_recipe(load_recipe(args.recipe, args.overrides)), end="")
            return 0
        if args.command == "bootstrap":
            from polydraft.pipelines.runtime.target import resolve_target

            recipe = load_recipe(args.recipe, args.overrides)
            print(resolve_target(recipe.target, recipe.data, show_progress=not args.quiet).path)
            return 0
        if args.command == "publish":
            return _publish(args)
        if args.command == "status":
            return _status(args)
        if args.command == "recipes":
            return _recipes(args)
        if args.command == "study":
            return _study(args)
        if args.command == "merge-shards":
            from polydraft.distill.merge import MergeError, merge_shards

            try:
                summary = merge_shards(args.shards, args.out)
            except MergeError as err:
                print(f"polydraft: {err}", file=sys.stderr)
                return EXIT_BAD_INPUT
            print(json.dumps(summary, indent=2))
            return 0
    except (RecipeError, InputError, RunDirTaken) as err:
        print(f"polydraft: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except StageFailed as err:
        print(f"polydraft: {err}", file=sys.stderr)
        return EXIT_STAGE_FAILED
    except KeyboardInterrupt:
        print("polydraft: interrupted; rerun the same command to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as err:
        path = _write_traceback(args)
        print(
            f"polydraft: unexpected error: {type(err).__name__}: {err}\n"
            f"  traceback: {path} (a bug, or a fault polydraft does not handle yet: please report it)",
            file=sys.stderr,
        )
        return EXIT_CRASH
    return EXIT_BAD_INPUT


def _write_traceback(args: argparse.Namespace) -> Path:
    """The current exception's traceback in the run directory (a temporary file outside a run)."""
    run_dir = (
        getattr(args, "run_dir", None)
        or getattr(args, "study_dir", None)
        or (default_run_dir(args.recipe) if args.command == "run" else None)
    )
    if run_dir is not None and Path(run_dir).is_dir():
        path = Path(run_dir) / "crash.log"
        try:
            path.write_text(traceback.format_exc(), encoding="utf-8")
            return path
        except OSError:
            pass
    with tempfile.NamedTemporaryFile("w", prefix="polydraft-crash-", suffix=".log", delete=False) as handle:
        handle.write(traceback.format_exc())
    return Path(handle.name)


if __name__ == "__main__":
    sys.exit(main())
