"""The training stages of finished demo runs on a timeline: one stage at a time against `runner.parallel_stages`.

    python -m bench.parallel_stages RUN_DIR [RUN_DIR ...] [--record bench/results/parallel_stages.md]

Each RUN_DIR is a run directory `polydraft run recipes/demo/demo.yaml` completed (made on this machine with
nothing else running, best from the same distill folder). For each, from its stage manifests: when every
stage between distill and measure started and ended, in seconds from the first one's start, its duration,
the sum of their durations and their wall clock (first start to last end), with the run's
`runner.parallel_stages` (its `recipe.yaml`; 1 when the recipe has no such block) and the commit that ran
each stage.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

import yaml

TRAINING = ("pretrain", "finetune", "heads", "eagle3", "early_exit", "calibrate")


def timeline(run_dir: Path) -> tuple[int, list[tuple[str, float, float, str]]]:
    """(runner.parallel_stages, [(stage, start s, end s, commit)]) of the training stages that ran."""
    recipe = yaml.safe_load((run_dir / "recipe.yaml").read_text(encoding="utf-8"))
    parallel = int((recipe.get("runner") or {}).get("parallel_stages", 1))
    found = []
    for name in TRAINING:
        path = run_dir / name / "manifest.json"
        if path.is_file():
            manifest = json.loads(path.read_text(encoding="utf-8"))
            started = datetime.datetime.fromisoformat(manifest["started_at"])
            finished = datetime.datetime.fromisoformat(manifest["finished_at"])
            found.append((name, started, finished, (manifest.get("git") or {}).get("commit", "")[:7]))
    if not found:
        raise SystemExit(f"{run_dir}: no training stage has a manifest")
    zero = min(start for _, start, _, _ in found)
    rows = [(n, (s - zero).total_seconds(), (f - zero).total_seconds(), c) for n, s, f, c in found]
    return parallel, sorted(rows, key=lambda row: row[1])


def section(run_dir: Path) -> list[str]:
    parallel, rows = timeline(run_dir)
    commits = ", ".join(dict.fromkeys(c for *_, c in rows if c))
    total = sum(end - start for _, start, end, _ in rows)
    span = max(end for _, _, end, _ in rows)
    lines = [
        f"### `{run_dir.name}`: runner.parallel_stages {parallel} (commit {commits})",
        "",
        "| stage | start s | end s | seconds |",
        "| --- | ---: | ---: | ---: |",
    ]
    lines += [f"| {name} | {start:.0f} | {end:.0f} | {end - start:.0f} |" for name, start, end, _ in rows]
    lines += [
        f"| **summed** | | | **{total:.0f}** |",
        f"| **wall clock** | 0 | {span:.0f} | **{span:.0f}** |",
        "",
    ]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--record", type=Path, help="append the tables to this markdown file")
    args = parser.parse_args()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
    lines = [
        f"## {stamp} - `python -m bench.parallel_stages {' '.join(d.name for d in args.run_dirs)}` "
        f"({platform.machine()}, {os.cpu_count()} cores)",
        "",
        "The training stages of each run (seconds from the first one's start, from their manifests).",
        "",
    ]
    for run_dir in args.run_dirs:
        lines += section(run_dir)
    text = "\n".join(lines)
    print(text)
    if args.record:
        header = (
            ""
            if args.record.exists()
            else "# Training stages side by side\n\nWritten by `python -m bench.parallel_stages`.\n\n"
        )
        with args.record.open("a", encoding="utf-8") as handle:
            handle.write(header + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
