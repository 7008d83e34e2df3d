"""`polydraft plan --gpus cpu` against what demo runs recorded, stage by stage.

    python -m bench.plan_vs_run [RUN_JSON ...] [--fresh N] [--record bench/results/plan_vs_run.md]

Plans `recipes/demo/demo.yaml` on this machine's CPU (`pipelines/runtime/cluster.py`: CPU_RATES, measured by
`bench/cpu_rates.py`, not fitted to any run) and compares each stage's planned seconds with the seconds
each run spent in it: the `run.json` of fresh-clone demo runs written by `bench/demo_runs.py` (default:
every `bench/results/demo_runs/run-*/run.json` of a commit that has the demo recipe as it is now), and
with `--fresh N` N more fresh-clone runs of HEAD made here first (`bench.demo_runs.clone_and_run`, about
27 minutes each on 2 cores, kept under `bench/results/plan_vs_run/`). The error is planned / recorded - 1
against the median of the runs; the goal is ±35% on every stage.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from collections import defaultdict
from pathlib import Path

from bench.demo_runs import ROOT, clone_and_run
from bench.held_out import record
from polydraft.pipelines.plan.estimate import estimate
from polydraft.pipelines.run.recipe import load_recipe
from polydraft.pipelines.runtime.cluster import parse_gpus

RECIPE = "recipes/demo/demo.yaml"
GOAL = 0.35


def planned_seconds() -> dict[str, float]:
    """Seconds per stage (its rows summed: every finetuned drafter, every head) of the CPU plan."""
    plan = estimate(load_recipe(ROOT / RECIPE, []), parse_gpus("cpu"))
    out: dict[str, float] = defaultdict(float)
    for stage in plan.stages:
        out[stage.name.split(" ")[0]] += stage.hours * 3600
    return dict(out)


def recipe_commit() -> str:
    """The last commit that changed the demo recipe: runs of older commits ran another recipe."""
    return subprocess.run(
        ["git", "log", "-1", "--format=%H", "--", RECIPE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def runs_of_this_recipe(paths: list[Path]) -> list[dict]:
    """The runs whose commit contains the demo recipe's last change."""
    since, kept = recipe_commit(), []
    for path in paths:
        record = json.loads(path.read_text())
        ancestor = subprocess.run(["git", "merge-base", "--is-ancestor", since, record["commit"]], cwd=ROOT)
        if ancestor.returncode == 0:
            kept.append(record | {"path": str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)})
    return kept


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "runs", nargs="*", type=Path, help="run.json files (default: bench/results/demo_runs)"
    )
    parser.add_argument("--fresh", type=int, default=0, help="fresh-clone demo runs to make first")
    parser.add_argument("--record", type=Path, help="append the table to this Markdown file")
    args = parser.parse_args(argv)
    paths = args.runs or sorted((ROOT / "bench/results/demo_runs").glob("run-*/run.json"))
    runs = runs_of_this_recipe(paths)
    for index in range(args.fresh):
        out = ROOT / "bench/results/plan_vs_run"
        runs.append(clone_and_run(index + 1, RECIPE, out) | {"path": f"fresh run {index + 1}"})
    if not runs:
        raise SystemExit(f"no run of the demo recipe as of {recipe_commit()[:7]}: give --fresh 1")
    planned = planned_seconds()
    setting = (
        f"`polydraft plan --gpus cpu {RECIPE}` against {len(runs)} run(s): "
        + ", ".join(f"{r['path']} ({r['commit'][:7]})" for r in runs)
        + f". Error: planned / median recorded - 1 (goal ±{GOAL:.0%})."
    )
    lines = [
        "| stage | planned s | recorded s, median (min-max) | error | within goal |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    misses = 0
    for stage, seconds in planned.items():
        recorded = [r["stages"][stage] for r in runs if r["stages"].get(stage)]
        if not recorded:
            continue
        median = statistics.median(recorded)
        error = seconds / median - 1
        misses += abs(error) > GOAL
        lines.append(
            f"| {stage} | {seconds:.0f} | {median:.0f} ({min(recorded):.0f}-{max(recorded):.0f}) | "
            f"{error:+.0%} | {'yes' if abs(error) <= GOAL else 'no'} |"
        )
    total = sum(planned.values())
    recorded_total = statistics.median(sum(r["stages"].values()) for r in runs)
    lines.append(
        f"| **all stages** | {total:.0f} | {recorded_total:.0f} | {total / recorded_total - 1:+.0%} | |"
    )
    lines += ["", f"{misses} stage(s) outside ±{GOAL:.0%}."]
    record("plan_vs_run", setting, lines, args.record)


if __name__ == "__main__":
    main()
