"""One process on both cores, or two processes of one thread each side by side? What the demo's
`measure.processes: 2` and `distill.hf.processes: 2` rest on.

    python -m bench.cpu_processes [--repeats 3] [--steps 100] [--batch 64] [--record bench/results/cpu_processes.md]

Decoding (the measure stage): is a batch-1 forward of the demo target as fast on one thread as on two, and
do two single-thread processes side by side slow each other? Per repetition, in turn: one process on 2
threads, one process on 1 thread, then two 1-thread processes at once. Each process loads the committed demo
target, puts 80 prompt tokens in its cache and times `--steps` one-token forward calls (the `ar` step) and as
many 5-token calls cropped back (an `sd` K=4 verification).

Batched generation (the distill stage's hf backend): `--batch` rows of 70 prompt tokens, 32 new tokens
each, in one process on 2 threads, against half the rows in each of two 1-thread processes at once; the
time until the last process is done.
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
from polydraft.models.decoder_layers import cache_kwargs
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
steps = int(sys.argv[2])
ids = torch.randint(5, 2000, (1, 80))
with torch.inference_mode():
    cache = DynamicCache()
    model(ids, **cache_kwargs(model, cache), use_cache=True)
    for _ in range(10):
        model(ids[:, -1:], **cache_kwargs(model, cache), use_cache=True)
    cache.crop(-10)
    clock = time.perf_counter()
    for _ in range(steps):
        model(ids[:, -1:], **cache_kwargs(model, cache), use_cache=True)
    one = (time.perf_counter() - clock) / steps
    cache.crop(-steps)
    clock = time.perf_counter()
    for _ in range(steps):
        model(ids[:, :5], **cache_kwargs(model, cache), use_cache=True)
        cache.crop(-5)
    five = (time.perf_counter() - clock) / steps
print(json.dumps({"one": one, "five": five, "threads": torch.get_num_threads()}))
"""

GENERATE = """
import json, sys, time, torch
from transformers import AutoModelForCausalLM
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
ids = torch.randint(5, 2000, (int(sys.argv[2]), 70))
options = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False)
with torch.inference_mode():
    model.generate(ids[:2], attention_mask=torch.ones_like(ids[:2]), **options)
    clock = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), **options)
print(json.dumps({"seconds": time.perf_counter() - clock}))
"""


def workers(count: int, threads: int, script: str, argument: int) -> list[dict]:
    """`count` processes of `threads` threads each running `script`, started together; their timings."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    command = [sys.executable, "-c", script, str(TARGET), str(argument)]
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
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--record", type=Path, help="append the table to this Markdown file")
    args = parser.parse_args(argv)
    settings = {"1 process, 2 threads": (1, 2), "1 process, 1 thread": (1, 1), "2 processes at once, 1 thread each": (2, 1)}  # fmt: skip
    samples: dict[str, list[dict]] = {name: [] for name in settings}
    generation: dict[str, list[float]] = {
        "1 process, 2 threads": [],
        "2 processes at once, 1 thread each": [],
    }
    for _ in range(args.repeats):
        for name, (count, threads) in settings.items():
            samples[name] += workers(count, threads, WORKER, args.steps)
        generation["1 process, 2 threads"].append(workers(1, 2, GENERATE, args.batch)[0]["seconds"])
        both = workers(2, 1, GENERATE, args.batch // 2)
        generation["2 processes at once, 1 thread each"].append(max(r["seconds"] for r in both))
    lines = [
        f"\n## {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())} - `python -m bench.cpu_processes "
        f"--repeats {args.repeats} --steps {args.steps} --batch {args.batch}` ({os.cpu_count()} cores)\n",
        f"The demo target ({TARGET.relative_to(ROOT)}), batch 1 after 80 cached tokens; {args.steps} calls per "
        f"process; mean ± std over the processes of {args.repeats} repetitions, the settings in turn.\n",
        "| setting | processes measured | 1-token forward, ms | 5-token forward, ms |",
        "| --- | --- | --- | --- |",
    ]
    for name, rows in samples.items():
        lines.append(
            f"| {name} | {len(rows)} | {cell([r['one'] for r in rows])} | {cell([r['five'] for r in rows])} |"
        )
    lines += [
        "",
        f"Batched generation: {args.batch} rows of 70 prompt tokens, 32 new tokens each (two processes: "
        f"{args.batch // 2} rows each); seconds until the last process is done, mean ± std over "
        f"{args.repeats} repetitions.",
        "",
        "| setting | seconds |",
        "| --- | --- |",
    ]
    for name, seconds in generation.items():
        lines.append(f"| {name} | {cell([s / 1000 for s in seconds])} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.record:
        with args.record.open("a", encoding="utf-8") as handle:
            handle.write(text)


if __name__ == "__main__":
    main()
