"""The hf backend's loop (`distill.hf_backend.generate_rows`) against transformers `generate` on the demo's
distillation prompts: what `distill.batch_size: 64` in recipes/demo/demo.yaml rests on.

    python -m bench.distill_hf [--prompts 192] [--repeats 2] [--record bench/results/distill_hf.md]

One process, one thread (as each of the demo's two distill processes). The prompts: the demo recipe's
distill sources (the offline corpus' numbers, in its Vicuna prompt format), `--prompts` of them drawn evenly
over the three pairs, sorted by length as the backend sorts them. Per repetition, in turn: `generate` at 32
rows a call (the backend before), `generate_rows` at 32 and at 64 rows, each over every prompt at T=0 and at
T=1 (max_new_tokens as the recipe's). Seconds per setting, mean ± std over the repetitions, and the row-steps
computed per answer token (a row's steps after its answer ended are waste).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TARGET = sorted((ROOT / "recipes" / "demo" / "target").glob("*/config.json"))[0].parent


def demo_prompts(count: int, tokenizer) -> list[list[int]]:
    """`count` of the demo's distillation prompts, evenly over its pairs, as token ids."""
    from polydraft.data.prompts import build_prompt, encode_prompt, translation_messages
    from polydraft.data.sources import read_source
    from polydraft.pipelines.run.recipe import load_recipe
    from polydraft.pipelines.schema.common import reader_args

    recipe = load_recipe(ROOT / "recipes" / "demo" / "demo.yaml")
    sources = recipe.data.distill
    prompts = []
    for source in sources:
        args = reader_args(source, recipe.data.seed, recipe.data.offline)
        rows = read_source(**{**args, "limit": count // len(sources)}).rows
        for row in rows:
            messages = translation_messages(source.pair, row["source"])
            prompts.append(encode_prompt(tokenizer, build_prompt(messages, recipe.distill.prompt_format)))
    return sorted(prompts, key=len)


def run_generate(model, batch: list[list[int]], pad: int, eos: int, temperature: float, new: int) -> int:
    """transformers `generate` on one batch; returns the row-steps it computed."""
    from transformers import GenerationConfig

    ids, mask = padded(batch, pad)
    sampling = temperature > 0
    config = GenerationConfig(
        do_sample=sampling, temperature=temperature if sampling else None, top_k=0 if sampling else None,
        max_new_tokens=new, pad_token_id=pad, eos_token_id=[eos],
    )  # fmt: skip
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    return (out.shape[1] - ids.shape[1]) * len(batch)


def padded(batch: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in batch)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
    return ids, torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--record", type=Path)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from polydraft.distill.hf_backend import generate_rows
    from polydraft.models.loading import load_tokenizer
    from polydraft.pipelines.run.recipe import load_recipe

    torch.set_num_threads(1)
    new = load_recipe(ROOT / "recipes" / "demo" / "demo.yaml").distill.max_new_tokens
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(str(TARGET), None, False)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = tokenizer.eos_token_id
    prompts = demo_prompts(args.prompts, tokenizer)
    settings = [("generate", 32), ("generate_rows", 32), ("generate_rows", 64)]
    seconds: dict[tuple[str, int, float], list[float]] = {}
    tokens: dict[tuple[str, int, float], int] = {}
    steps: dict[tuple[str, int, float], int] = {}
    for _ in range(args.repeats):
        for temperature in (0.0, 1.0):
            for name, size in settings:
                torch.manual_seed(0)
                generator = torch.Generator().manual_seed(0)
                clock, computed, answered = time.perf_counter(), 0, 0
                for start in range(0, len(prompts), size):
                    batch = prompts[start : start + size]
                    if name == "generate":
                        computed += run_generate(model, batch, pad, eos, temperature, new)
                        continue
                    ids, mask = padded(batch, pad)
                    answers = generate_rows(
                        model, ids, mask, temperature=temperature, top_p=1.0, max_new_tokens=new, eos={eos},
                        generator=generator,
                    )  # fmt: skip
                    answered += sum(len(a) for a in answers)
                key = (name, size, temperature)
                seconds.setdefault(key, []).append(time.perf_counter() - clock)
                tokens[key], steps[key] = answered, computed
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
    lines = [
        f"## {stamp} - `python -m bench.distill_hf --prompts {args.prompts} --repeats {args.repeats}` "
        f"({platform.machine()}, {os.cpu_count()} cores, 1 thread)",
        "",
        f"The demo target, {len(prompts)} of the demo's distillation prompts, up to {new} new tokens; "
        f"seconds, mean ± std over {args.repeats} repetitions, the settings in turn.",
        "",
        "| loop | rows a batch | T | seconds | answer tokens |",
        "| --- | ---: | ---: | --- | ---: |",
    ]
    for (name, size, temperature), values in seconds.items():
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        key = (name, size, temperature)
        answered = tokens[key] or f"({steps[key]} row-steps computed)"
        lines.append(
            f"| {name} | {size} | {temperature:g} | {statistics.fmean(values):.2f} ± {spread:.2f} | {answered} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.record:
        header = (
            ""
            if args.record.exists()
            else "# The hf backend's loop\n\nWritten by `python -m bench.distill_hf`.\n\n"
        )
        with args.record.open("a", encoding="utf-8") as handle:
            handle.write(header + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
