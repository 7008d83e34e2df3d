"""Time the offline demo end to end on this machine: a fresh run directory, every stage, the wall clock.

    python -m bench.demo_time [--recipe recipes/demo/demo.yaml] [--out bench/results/demo_time.md]

The bootstrap target comes from the recipe's cache (committed for the demo); everything else runs from
scratch. Prints the per-stage times from the run's manifests and the total, and appends them to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", default="recipes/demo/demo.yaml")
    parser.add_argument("--out", default="bench/results/demo_time.md")
    parser.add_argument("--budget-s", type=float, default=600.0, help="the target: 10 minutes on 2 cores")
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="polydraft-demo-"))
    command = [
        sys.executable,
        "-m",
        "polydraft.pipelines.cli.main",
        "run",
        args.recipe,
        "--run-dir",
        str(run_dir),
        "--quiet",
    ]
    started = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    total = time.perf_counter() - started
    stages = (
        json.loads((run_dir / "run.json").read_text())["stages"] if (run_dir / "run.json").exists() else []
    )
    lines = [
        f"## {datetime.date.today()} — {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "",
        f"`{' '.join(command[2:4])} {args.recipe}` exit {result.returncode}, total **{total:.0f} s** "
        f"(budget {args.budget_s:.0f} s: {'within' if total <= args.budget_s else 'OVER'})",
        "",
        "| stage | status | seconds |",
        "| --- | --- | --- |",
        *[f"| {s['name']} | {s['status']} | {s['duration_s']:.1f} |" for s in stages],
        "",
    ]
    print("\n".join(lines))
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")
    shutil.rmtree(run_dir, ignore_errors=True)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
