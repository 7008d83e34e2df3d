"""Peak resident memory of one rank building its mix batches, against the number of mix rows.

    python -m bench.data_memory                  # 1x, 10x, 100x the demo's train mix, 3 runs each
    python -m bench.data_memory --sizes 1 10     # some sizes only (results are merged by size)

The demo's mix (recipes/demo/demo.yaml: 400 prompts per pair at 2 temperatures, open rows 1.5 times
that, 5% held out) is about 1900 train rows per pair, 3800 for its two pairs. A mix of N times that is
written to a temporary distill folder as the distill stage writes it: the offline corpus' German and
French number translations in the Vicuna format, copy k > 0 of a row with ` (k)` after its response,
40% of rows distilled (half at each temperature), the rest open. Each run is a fresh subprocess that
loads the demo target's tokenizer, builds this process's `MixBatches` as rank 0 of 2 and collates its
first step, then prints its peak RSS (`resource.getrusage(RUSAGE_SELF).ru_maxrss`) and the RSS it had
before reading the mix (imports and tokenizer). Paths:
- `lists` (before the cache): every rank reads every pair's mix and tokenizes it into Python lists;
- `cache, tokenizing rank`: `train.mix_cache.load_examples` into an empty cache folder (the main
  process, which tokenizes and writes the Arrow file);
- `cache, other rank`: the same once the file exists (every other rank: memory-maps it).
Prints mean ± std over the runs and writes bench/results/data_memory.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO_TOKENIZER = next((ROOT / "recipes" / "demo" / "target").glob("*/tokenizer.json")).parent
DEMO_ROWS_PER_PAIR = 1900
PAIRS = ["de-en", "fr-en"]
PATHS = ["lists", "cache, tokenizing rank", "cache, other rank"]
RESULTS = ROOT / "bench" / "results" / "data_memory.md"
SETTINGS = {"temperatures": [0.0, 1.0], "loss_on": "response", "max_length": 256}


def write_mix(distill_dir: Path, scale: int) -> int:
    """The demo-sized mix repeated `scale` times (copies perturbed); returns the rows written."""
    from polydraft.data.mix import MixWriter
    from polydraft.data.offline import offline_pairs
    from polydraft.data.prompts import task_prefix, vicuna_prompt

    writer = MixWriter(distill_dir)
    for pair in PAIRS:
        base = offline_pairs(pair, "train", DEMO_ROWS_PER_PAIR, seed=1, kind_weights={"number": 1.0})
        for copy in range(scale):
            for i, row in enumerate(base):
                distilled = i % 5 < 2
                prompt = vicuna_prompt([{"role": "user", "content": task_prefix(pair) + row["source"]}])
                writer.add(
                    {
                        "id": f"{pair}/{copy}/{i}",
                        "pair": pair,
                        "origin": "distill" if distilled else "open",
                        "prompt": prompt,
                        "response": " " + row["target"] + (f" ({copy})" if copy else ""),
                        "temperature": float(i % 2) if distilled else None,
                        "sample_index": 0,
                    },
                    "train",
                )
    return sum(writer.close().values())


def child(path: str, distill_dir: Path, cache_dir: Path) -> None:
    """One measured run: this rank's batches of the mix, by `path`; prints a JSON line."""
    from polydraft.models.loading import load_tokenizer
    from polydraft.train.data import MixBatches, encode_rows, pad_id_of
    from polydraft.train.mix_cache import load_examples

    tokenizer = load_tokenizer(str(DEMO_TOKENIZER))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    if path == "lists":
        from polydraft.data.mix import read_mix

        rows = [
            row for pair in PAIRS for row in read_mix(distill_dir, pair, "train", SETTINGS["temperatures"])
        ]
        examples, _ = encode_rows(tokenizer, rows, SETTINGS["max_length"])
        del rows
    else:
        examples = load_examples(
            distill_dir, tokenizer, "train", **SETTINGS, cache_dir=cache_dir, main_process_first=nullcontext
        ).examples
    batches = MixBatches(examples, 0, 8, 0, 2, 1, pad_id_of(tokenizer))
    batches.micro_batches(0)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        json.dumps(
            {"peak_mib": peak / 1024, "before_mib": before / 1024, "examples": len(examples), "s": seconds}
        )
    )


def run_child(path: str, distill_dir: Path, cache_dir: Path) -> dict[str, float]:
    command = [sys.executable, "-m", "bench.data_memory", "--child", path, str(distill_dir), str(cache_dir)]
    out = subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def measure(scale: int, repeats: int) -> dict[str, list[dict[str, float]]]:
    runs: dict[str, list[dict[str, float]]] = {path: [] for path in PATHS}
    with tempfile.TemporaryDirectory() as tmp:
        distill_dir, cache_dir = Path(tmp) / "distill", Path(tmp) / "cache"
        rows = write_mix(distill_dir, scale)
        print(
            f"{scale}x: {rows} rows, {sum(f.stat().st_size for f in distill_dir.rglob('*.jsonl')) / 2**20:.0f} MiB"
        )
        for _ in range(repeats):
            runs["lists"].append(run_child("lists", distill_dir, cache_dir))
            shutil.rmtree(cache_dir, ignore_errors=True)
            runs["cache, tokenizing rank"].append(run_child("cache", distill_dir, cache_dir))
            runs["cache, other rank"].append(run_child("cache", distill_dir, cache_dir))
        for path, got in runs.items():
            print(f"  {path:24s} peak {summary(got, 'peak_mib')} MiB, {summary(got, 's')} s")
        runs["rows"] = [{"rows": rows}]
    return runs


def summary(runs: list[dict[str, float]], key: str) -> str:
    values, digits = [run[key] for run in runs], 1 if key == "s" else 0
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {spread:.{digits}f}"


def write_results(results: dict[str, dict[str, list[dict[str, float]]]], repeats: int) -> None:
    lines = [
        "# Peak RSS of one rank building its mix batches (bench/data_memory.py)",
        "",
        f"{datetime.date.today()}, {platform.machine()}, Python {platform.python_version()}, "
        f"{repeats} runs per cell (fresh subprocess each), mean ± std; `python -m bench.data_memory`.",
        "Peak RSS in MiB of a process that loads the demo tokenizer, reads the train mix of 2 pairs and "
        "collates rank 0 of 2's first step (the RSS before reading the mix, imports and tokenizer, is in "
        "brackets); time in seconds for reading and tokenizing.",
        "",
        "| mix | rows | " + " | ".join(PATHS) + " |",
        "| --- | ---: | " + " | ".join(["---:"] * len(PATHS)) + " |",
    ]
    for scale in sorted(results, key=int):
        runs = results[scale]
        cells = [
            f"{summary(runs[p], 'peak_mib')} MiB ({summary(runs[p], 'before_mib')}), {summary(runs[p], 's')} s"
            for p in PATHS
        ]
        lines.append(f"| {scale}x | {runs['rows'][0]['rows']} | " + " | ".join(cells) + " |")
    RESULTS.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {RESULTS}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 10, 100])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=3, metavar=("PATH", "DISTILL_DIR", "CACHE_DIR"))
    args = parser.parse_args()
    if args.child:
        child(args.child[0], Path(args.child[1]), Path(args.child[2]))
        return
    raw = RESULTS.with_suffix(".json")
    results = json.loads(raw.read_text()) if raw.is_file() else {}
    for scale in args.sizes:
        results[str(scale)] = measure(scale, args.repeats)
        raw.write_text(json.dumps(results, indent=1), encoding="utf-8")
    write_results(results, args.repeats)


if __name__ == "__main__":
    main()
