"""What a finished run wrote to disk, for the plan's disk constants (`pipelines/runtime/cluster.py`): the bytes of
the distilled records per prompt and answer token (and how fast they are read back), and of one finetune
checkpoint per trained parameter;
beside them the plan's estimate of the whole run (`pipelines.plan.disk.disk_estimate`) against the run
directory's size. Counts files, so it is exact for the run given (no repetition needed).

    python -m bench.run_disk runs/demo/demo --record bench/results/run_disk.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.held_out import record


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--record", type=Path, default=None)
    args = parser.parse_args()

    import time

    from safetensors import safe_open

    from polydraft.pipelines.plan.disk import disk_estimate
    from polydraft.pipelines.run.recipe import load_recipe

    records = sorted((args.run / "distill" / "records").glob("*.jsonl"))
    size = tokens = lines = 0
    start = time.perf_counter()
    for path in records:
        size += path.stat().st_size
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            tokens += row["prompt_tokens"] + row["response_tokens"]
            lines += 1
    parsing = time.perf_counter() - start
    checkpoint = next(iter(sorted((args.run / "finetune").glob("*.checkpoints/step-*"))), None)
    table = [
        "| quantity | value |",
        "| --- | ---: |",
        f"| distilled records | {lines:,} in {len(records)} files |",
        f"| their bytes | {size:,} |",
        f"| their prompt + answer tokens | {tokens:,} |",
        f"| bytes per token | {size / max(tokens, 1):.2f} |",
        f"| record bytes read and parsed per second (JSON) | {size / parsing:,.0f} |",
    ]
    if checkpoint is not None:
        folder = checkpoint.parent.name.removesuffix(".checkpoints")
        params = 0
        with safe_open(str(args.run / "finetune" / folder / "model.safetensors"), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                count = 1
                for dim in handle.get_slice(key).get_shape():
                    count *= dim
                params += count
        one = folder_bytes(checkpoint)
        table += [
            f"| finetune checkpoint `{checkpoint.relative_to(args.run)}` | {one:,} bytes |",
            f"| the drafter's parameters | {params:,} |",
            f"| checkpoint bytes per parameter | {one / params:.2f} |",
        ]
    recipe = load_recipe(args.run / "recipe.yaml")
    mix = sorted((args.run / "distill" / "mix").glob("*/train.jsonl"))
    if mix:  # what rank 0 does alone before the other ranks read the cache (`train.mix_cache`)
        import contextlib
        import tempfile

        from polydraft.models.loading import load_tokenizer
        from polydraft.train.mix_cache import mix_examples

        target = json.loads((args.run / "distill" / "manifest.json").read_text(encoding="utf-8"))["config"][
            "target"
        ]
        tokenizer = load_tokenizer(target["path"], None, False)
        mix_bytes = sum(p.stat().st_size for p in mix)
        with tempfile.TemporaryDirectory() as cache:
            start = time.perf_counter()
            mix_examples(mix, tokenizer, split="train", temperatures=None, loss_on="response", max_length=2048,
                         cache_dir=Path(cache), main_process_first=contextlib.nullcontext)  # fmt: skip
            seconds = time.perf_counter() - start
        table += [
            f"| tokenizing the train mix ({mix_bytes:,} bytes), once | {seconds:.2f} s |",
            f"| mix bytes tokenized per second | {mix_bytes / seconds:,.0f} |",
        ]
    estimate = sum(disk_estimate(recipe).values())
    table += [
        f"| the plan's estimate of the run (`disk_estimate`) | {estimate:,.0f} bytes |",
        f"| the run directory | {folder_bytes(args.run):,} bytes |",
    ]
    record("run_disk", f"Run `{args.run}`.", table, args.record)


if __name__ == "__main__":
    main()
