"""Is a batch-1 forward of the demo target as fast on one thread as on two, and do two single-thread
processes side by side slow each other? (The demo's `measure.processes: 2` rests on both.)

    python -m bench.measure_processes [--repeats 3] [--steps 100] [--record bench/results/measure_processes.md]

Per repetition, in turn: one process on 2 threads, one process on 1 thread, then two 1-thread processes at
once. Each process loads the committed demo target, puts 80 prompt tokens in its cache and times `--steps`
one-token forward calls (the `ar` step) and as many 5-token calls cropped back (an `sd` K=4 verification).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = sorted((ROOT / "recipes" / "demo" / "target").glob("*/config.json"))[0].parent

WORKER = """
import json, sys, time, torch
from transformers import AutoModelForCausalLM, DynamicCache
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
steps = int(sys.argv[2])
ids = torch.randint(5, 2000, (1, 80))
with torch.inference_mode():
    cache = DynamicCache()
    model(ids, past_key_values=cache, use_cache=True)
    for _ in range(10):
        model(ids[:, -1:], past_key_values=cache, use_cache=True)
    cache.crop(-10)
    clock = time.perf_counter()
    for _ in range(steps):
        model(ids[:, -1:], past_key_values=cache, use_cache=True)
    one = (time.perf_counter() - clock) / steps
    cache.crop(-steps)
    clock = time.perf_counter()
    for _ in range(steps):
        model(ids[:, :5], past_key_values=cache, use_cache=True)
        cache.crop(-5)
    five = (time.perf_counter() - clock) / steps
print(json.dumps({"one": one, "five": five, "threads": torch.get_num_threads()}))
"""


def workers(count: int, threads: int, steps: int) -> list[dict]:
    """`count` worker processes of `threads` threads each, started together; their timings."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    command = [sys.executable, "-c", WORKER, str(TARGET), str(steps)]
    started = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True) for _ in range(count)]
    return [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in started]


def cell(values: list[float]) -> str:
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{1000 * statistics.mean(values):.2f} ± {1000 * spread:.2f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--record", type=Path, help="append the table to this Markdown file")
    args = parser.parse_args(argv)
    settings = {"1 process, 2 threads": (1, 2), "1 process, 1 thread": (1, 1), "2 processes at once, 1 thread each": (2, 1)}  # fmt: skip
    samples: dict[str, list[dict]] = {name: [] for name in settings}
    for _ in range(args.repeats):
        for name, (count, threads) in settings.items():
            samples[name] += workers(count, threads, args.steps)
    lines = [
        f"\n## {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())} - `python -m bench.measure_processes "
        f"--repeats {args.repeats} --steps {args.steps}` ({os.cpu_count()} cores)\n",
        f"The demo target ({TARGET.relative_to(ROOT)}), batch 1 after 80 cached tokens; {args.steps} calls per "
        f"process; mean ± std over the processes of {args.repeats} repetitions, the settings in turn.\n",
        "| setting | processes measured | 1-token forward, ms | 5-token forward, ms |",
        "| --- | --- | --- | --- |",
    ]
    for name, rows in samples.items():
        lines.append(
            f"| {name} | {len(rows)} | {cell([r['one'] for r in rows])} | {cell([r['five'] for r in rows])} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.record:
        with args.record.open("a", encoding="utf-8") as handle:
            handle.write(text)


if __name__ == "__main__":
    main()
