"""The demo's headline table from several fresh clones: each run's measure outputs kept, the table their median.

    python -m bench.demo_runs [--runs 3] [--start 1] [--out bench/results/demo_runs] [--tables-only] [key=value ...]

Each run clones the committed HEAD of this repository into a temporary folder and runs the demo recipe
there (`polydraft run recipes/demo/demo.yaml`, every stage from scratch; the bootstrap target is the
committed one) with this checkout's virtual environment, the clone's code first on the import path.
Run it with nothing else on the machine: the speedups are wall-clock ratios.

Writes `<out>/run-<i>/{summary.md,results.jsonl,run.json,mixed/}` (verbatim from each run) and `<out>.md`: per
drafter and decoder at T=0, the block efficiency and the speedup over `ar` on each eval set, as the median
over the runs of each run's mean over its repetitions, with the min-max over runs, and the latency model's
predicted speedup with the median error (measured / predicted - 1); with `measure.mixed`, the
mixed-traffic rows the same way and which of routed and multilingual won, per run and over all runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from polydraft.decoding.measurement.mixed import RULE, decisions, read_groups
from polydraft.pipelines.run.recipe import load_recipe

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pipelines", "data", "distill", "train", "models", "decoding")


def stage_table(records: list[dict]) -> str:
    """Seconds of each stage that ran, per run, their sum, and (stages side by side) the wall clock from the
    first stage's start to the last one's end."""
    names = [n for n in records[0]["stages"] if any(r["stages"].get(n) for r in records)]
    lines = [
        "| stage | " + " | ".join(f"run {i} s" for i in range(1, len(records) + 1)) + " |",
        "| --- | " + " | ".join("---:" for _ in records) + " |",
    ]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(f"{r['stages'].get(name, 0):.0f}" for r in records) + " |")
    totals = " | ".join(f"**{sum(r['stages'].values()):.0f}**" for r in records)
    lines.append(f"| **all stages, summed** | {totals} |")
    if all("span_s" in r for r in records):
        spans = " | ".join(f"**{r['span_s']:.0f}**" for r in records)
        lines.append(f"| **all stages, wall clock** (first start to last end) | {spans} |")
    return "\n".join(lines)


def stage_span(run_dir: Path, names: list[str]) -> float:
    """Seconds from the first of these stages' start to the last one's end (their manifests' times)."""
    manifests = [json.loads((run_dir / name / "manifest.json").read_text()) for name in names]
    started = min(datetime.datetime.fromisoformat(m["started_at"]) for m in manifests)
    finished = max(datetime.datetime.fromisoformat(m["finished_at"]) for m in manifests)
    return (finished - started).total_seconds()


def clone_and_run(index: int, recipe: str, out: Path, overrides: list[str]) -> dict:
    """One fresh clone of HEAD, the whole demo in it; returns what the run recorded."""
    work = Path(tempfile.mkdtemp(prefix=f"polydraft-demo-run{index}-"))
    clone = work / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True, text=True
    ).stdout.strip()
    shim = work / "shim" / "polydraft"
    shim.mkdir(parents=True)
    for package in PACKAGES:
        (shim / package).symlink_to(clone / package)
    run_dir = work / "run"
    command = [
        sys.executable,
        "-m",
        "polydraft.pipelines.cli.main",
        "run",
        recipe,
        "--run-dir",
        str(run_dir),
        "--quiet",
        *overrides,
    ]
    started = time.perf_counter()
    subprocess.run(command, cwd=clone, env={**os.environ, "PYTHONPATH": f"{shim.parent}:{clone}"}, check=True)
    wall = time.perf_counter() - started
    target = out / f"run-{index}"
    target.mkdir(parents=True, exist_ok=True)
    for name in ("summary.md", "results.jsonl", "latency.json"):
        shutil.copyfile(run_dir / "measure" / name, target / name)
    shutil.rmtree(target / "mixed", ignore_errors=True)
    if (run_dir / "measure" / "mixed").is_dir():
        shutil.copytree(run_dir / "measure" / "mixed", target / "mixed")
    stages = json.loads((run_dir / "run.json").read_text())["stages"]
    record = {
        "commit": commit,
        "overrides": overrides,
        "wall_s": round(wall, 1),
        "stages": {s["name"]: s["duration_s"] for s in stages},
        "span_s": round(stage_span(run_dir, [s["name"] for s in stages if s["status"] == "ran"]), 1),
    }
    (target / "run.json").write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return record


def per_run_means(results: Path) -> dict[tuple[str, str], dict[str, float]]:
    """(method, dataset) -> mean over the run's repetitions of block efficiency, speedup and predicted
    speedup, at T=0, for every decoder but `ar`."""
    groups: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for line in results.read_text().splitlines():
        row = json.loads(line)
        if (
            row["temperature"] != 0.0
            or row["decoder"] == "ar"
            or row.get("engine", "polydraft") != "polydraft"
        ):
            continue
        for metric in ("block_efficiency", "speedup", "predicted_speedup"):
            if row.get(metric) is not None:
                groups[(row["method"], row["dataset"])][metric].append(row[metric])
    return {key: {m: statistics.fmean(v) for m, v in metrics.items()} for key, metrics in groups.items()}


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def table(runs: list[dict[tuple[str, str], dict[str, float]]]) -> str:
    datasets = sorted({dataset for run in runs for _, dataset in run})
    methods = sorted({method for run in runs for method, _ in run})
    header = ["method"] + [f"{d} {what}" for d in datasets for what in ("BE", "speedup", "predicted (error)")]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for method in methods:
        cells = [method]
        for dataset in datasets:
            rows = [run[(method, dataset)] for run in runs if (method, dataset) in run]
            be = [r["block_efficiency"] for r in rows if "block_efficiency" in r]
            speedup = [r["speedup"] for r in rows if "speedup" in r]
            predicted = [r["predicted_speedup"] for r in rows if "predicted_speedup" in r]
            errors = [r["speedup"] / r["predicted_speedup"] - 1 for r in rows if "predicted_speedup" in r]
            cells += [
                cell(be) if be else "",
                cell(speedup) if speedup else "",
                f"{statistics.median(predicted):.2f} ({statistics.median(errors):+.0%})" if predicted else "",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def latency_section(folders: list[Path], draft_length: int, eesd_draft_length: int) -> list[str]:
    """The forward latencies behind the predictions (each run's `latency.json`): median over the runs
    (min-max), in ms and in target steps."""
    runs = [json.loads((folder / "latency.json").read_text()) for folder in folders]

    def ms(values: list[float]) -> str:
        return (
            f"{statistics.median(values) * 1000:.2f} ({min(values) * 1000:.2f}-{max(values) * 1000:.2f}) ms"
        )

    step = [run["target"]["chain"]["1"] for run in runs]
    lines = ["### Forward latencies (each run's `latency.json`, median over the runs (min-max))", ""]
    lines.append(f"- target step (`ar`, after an `ar` step): {ms(step)}")
    for name in sorted(runs[0]["rounds"]):
        k = eesd_draft_length if name == "early_exit" else draft_length
        verify = [run["rounds"][name]["verify"][str(k + 1)] for run in runs if name in run["rounds"]]
        drafts = [run["rounds"][name]["draft"][:k] for run in runs if name in run["rounds"]]
        relative = statistics.median(v / s for v, s in zip(verify, step, strict=False))
        steps = ", ".join(ms([d[i] for d in drafts]) for i in range(k))
        share = statistics.median(sum(d) / k / s for d, s in zip(drafts, step, strict=False))
        lines.append(
            f"- `{name}` rounds at K={k}: verifying {k + 1} positions {ms(verify)} ({relative:.2f} target steps); "
            f"draft steps {steps} ({share:.3f} target steps each on average)"
        )
    return [*lines, ""]


def mixed_section(folders: list[Path]) -> list[str]:
    """The mixed-traffic rows (`measure.mixed`) at T=0: per method and traffic, the median over the runs of
    each run's mean over its repetitions (min-max); the decision per run and over every run's repetitions."""
    runs = [[g for g in read_groups(folder) if g.temperature == 0] for folder in folders]
    if not any(runs):
        return []
    means: list[dict[tuple[str, str], dict[str, float]]] = []
    for groups in runs:
        values: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for row in (r for g in groups for r in g.rows if r.method != "ar"):
            for metric in ("block_efficiency", "speedup"):
                if getattr(row, metric) is not None:
                    values[row.method, row.traffic][metric].append(getattr(row, metric))
        means.append({k: {m: statistics.fmean(v) for m, v in d.items()} for k, d in values.items()})
    traffics = list(dict.fromkeys(r.traffic for r in runs[0][0].rows))
    methods = list(dict.fromkeys(r.method for r in runs[0][0].rows if r.method != "ar"))
    header = ["method"] + [f"{t} {what}" for t in traffics for what in ("BE", "speedup")]
    lines = [
        "### Mixed-language traffic (`measure.mixed`)",
        "",
        "Every pair's held-out prompts of a repetition interleaved; `sd` at the recipe's K with each drafter "
        "alone, `routed` (the language router picks the drafter per request, its time included) and `oracle` "
        "(each request with its own pair's drafter). Cells as above, T=0.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + " --- |" * len(header),
    ]
    for method in methods:
        cells = [method]
        for traffic in traffics:
            found = [run[(method, traffic)] for run in means if (method, traffic) in run]
            for metric in ("block_efficiency", "speedup"):
                values = [f[metric] for f in found if metric in f]
                cells.append(cell(values) if values else "")
        lines.append("| " + " | ".join(cells) + " |")
    accuracy = [g.router_accuracy for groups in runs for g in groups]
    router_ms = [r.router_ms for groups in runs for g in groups for r in g.requests]
    lines += [
        "",
        f"Router: {min(accuracy):.1%}-{max(accuracy):.1%} of the requests to their own pair's drafter per "
        f"repetition, {statistics.median(router_ms):.3f} ms per request (median of {len(router_ms)}).",
        "",
        f"Decision rule: {RULE}.",
        "",
    ]
    for index, groups in enumerate(runs, 1):
        lines += [f"- run {index}: {d.text()}" for d in decisions(groups)]
    lines += [
        f"- every run's repetitions together: {d.text()}" for d in decisions([g for r in runs for g in r])
    ]
    return [*lines, ""]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--recipe", default="recipes/demo/demo.yaml")
    parser.add_argument(
        "overrides",
        nargs="*",
        help="recipe overrides of every run, e.g. export.vllm_check=off for the export `make demo` runs "
        "(its environment has no vLLM, so the export skips vLLM's checks)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/demo_runs"))
    parser.add_argument(
        "--tables-only",
        action="store_true",
        help="run nothing: rewrite <out>.md from the runs already in <out>",
    )
    parser.add_argument(
        "--start",
        type=int,
        default=1,
        help="run runs <start>..<runs> only, reading the earlier ones from <out> (a session too short for all)",
    )
    args = parser.parse_args()
    out = ROOT / args.out
    first = args.runs + 1 if args.tables_only else args.start
    records = [json.loads((out / f"run-{i}" / "run.json").read_text()) for i in range(1, first)]
    records += [clone_and_run(i, args.recipe, out, args.overrides) for i in range(first, args.runs + 1)]
    runs = [per_run_means(out / f"run-{i}" / "results.jsonl") for i in range(1, args.runs + 1)]
    folders = [out / f"run-{i}" for i in range(1, args.runs + 1)]
    recipe = load_recipe(ROOT / args.recipe)
    stage_seconds = ", ".join(f"{r.get('span_s', sum(r['stages'].values())):.0f}" for r in records)
    overrides = sorted({o for r in records for o in r.get("overrides", [])})
    given = f" {' '.join(overrides)}" if overrides else ""
    commits = ", ".join(dict.fromkeys(r["commit"][:7] for r in records))
    walls = ", ".join(f"{r['wall_s']:.0f}" for r in records)
    text = "\n".join(
        [
            f"## {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}Z - `python -m bench.demo_runs "
            f"--runs {args.runs}` ({platform.machine()}, {os.cpu_count()} cores)",
            "",
            f"{args.runs} fresh clone{'s' if args.runs > 1 else ''} of {commits}, each running `polydraft run {args.recipe}{given}` "
            f"from scratch: {stage_seconds} s of stages (wall clock from the first stage's start to the last one's end) "
            f"({walls} s wall clock). Each cell: the median over the "
            "runs of each run's mean over its repetitions (min-max over the runs), T=0; `predicted`: the latency "
            "model's prediction from the forward latencies the run measured, and the median error of the "
            "measured speedup against it (measured / predicted - 1). Each run's `summary.md` and `results.jsonl` "
            f"are in `{args.out}/run-<i>/`.",
            "",
            stage_table(records),
            "",
            table(runs),
            "",
            *latency_section(folders, recipe.measure.draft_length, recipe.measure.eesd_k),
            *mixed_section(folders),
        ]
    )
    (out.parent / f"{out.name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
