"""Where an EAGLE-3 training step's time goes on the demo target: the frozen target's forward pass that
computes the features (`train.eagle3.target_pass`), the unrolled head's forward with the loss
(`train.eagle3.ttt_losses`, which includes that pass) and the whole step (with backward and the AdamW update);
then the whole step with the features kept (`train.eagle3.FeatureCache`, as the demo trains), the loss in
chunks of 256 rows (recomputed in backward) against unchunked (`loop.loss_chunk_tokens: null`); then the
cache's fill of rows that share a head (`FeatureCache.fill`) against each row computed whole.

The demo's setting: the committed demo target (24 layers, hidden 128), feature layers 2, 12 and 21, a
1024-token draft vocabulary, 3 unrolled steps, the loss in chunks of 256 rows, batches of `--rows` random
rows of `--length` tokens with the first `--prompt` (40) masked as the prompt; with `--against`, the
features-kept step of that commit's trainer too. The three measurements are interleaved,
`--repeats` rounds of `--steps` each after a warm-up, and reported as mean ± std over the rounds.

    python -m bench.eagle3_step [--rows 2] [--length 110] [--prompt 40] [--against COMMIT] [--record FILE]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

from bench.held_out import module_at, record
from polydraft.models.eagle3 import head_for_target
from polydraft.train.chunked_loss import model_head
from polydraft.train.data import collate
from polydraft.train.eagle3 import FILL_ROWS, FeatureCache, Unroll, target_pass, ttt_losses
from polydraft.train.losses import IGNORE_INDEX

TARGET = Path(__file__).resolve().parent.parent / "recipes/demo/target/659066c489eb7c49"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--length", type=int, default=110)
    parser.add_argument("--prompt", type=int, default=40, help="the first tokens of each row, masked")
    parser.add_argument("--against", help="also the features-kept step of this commit's train/eagle3.py")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--record", type=Path)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(TARGET).eval().requires_grad_(False)
    head = head_for_target(target, torch.arange(1024), [2, 12, 21])
    unroll = Unroll(head, 3)
    optimizer = torch.optim.AdamW(unroll.parameters(), lr=1e-3)
    teacher = model_head(target.get_output_embeddings(), target.config)
    ids = torch.randint(5, target.config.vocab_size, (args.rows, args.length))
    labels = ids.clone()
    labels[:, : args.prompt] = IGNORE_INDEX
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}

    def features() -> None:
        target_pass(target, batch, head.aux_layers)

    def forward() -> None:
        ttt_losses(unroll, unroll, teacher, target, batch, 256)

    def step() -> None:
        sums, _ = ttt_losses(unroll, unroll, teacher, target, batch, 256)
        sums.sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    cache = FeatureCache(2**30)
    cache.target_pass(target, batch, head.aux_layers)

    def cached_step(chunk_tokens: int | None, trainer: ModuleType | None = None) -> None:
        unrolled = unroll if trainer is None else trainer.Unroll(head, 3)
        losses = ttt_losses if trainer is None else trainer.ttt_losses
        sums, _ = losses(unrolled, unrolled, teacher, target, batch, chunk_tokens, cache)
        sums.sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    parts = {
        "target forward (features)": features,
        "head forward + loss (with the target)": forward,
        "whole step": step,
        "whole step, features kept, loss in chunks of 256": lambda: cached_step(256),
        "whole step, features kept, loss unchunked": lambda: cached_step(None),
    }
    if args.against:
        folder = Path(tempfile.mkdtemp())
        then = module_at(args.against, "train/eagle3.py", "polydraft.train.eagle3_then", folder)
        parts[f"the same, {args.against}'s train/eagle3.py"] = lambda: cached_step(None, then)
    for run in parts.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in parts}
    for _ in range(args.repeats):
        for name, run in parts.items():
            clock = time.perf_counter()
            for _ in range(args.steps):
                run()
            times[name].append(1000 * (time.perf_counter() - clock) / args.steps)
    sizes = [2, 4, 8, 16, 32]
    per_row: dict[int, list[float]] = {n: [] for n in sizes}
    rows = torch.randint(5, target.config.vocab_size, (max(sizes), args.length))
    for _ in range(args.repeats):
        for n in sizes:
            part = {"input_ids": rows[:n], "attention_mask": torch.ones_like(rows[:n])}
            calls = max(1, 2 * args.steps // n)
            clock = time.perf_counter()
            for _ in range(calls):
                target_pass(target, part, head.aux_layers)
            per_row[n].append(1000 * (time.perf_counter() - clock) / (calls * n))
    # the feature cache's fill: 64 rows sharing a 36-token head (the demo's system prompt), tails of 60-100
    fill_rows = [
        head + torch.randint(5, target.config.vocab_size, (int(n),)).tolist()
        for head in [torch.randint(5, target.config.vocab_size, (36,)).tolist()]
        for n in torch.randint(60, 100, (64,))
    ]
    fills: dict[str, list[float]] = {"the shared head once": [], "each row whole": []}
    for _ in range(args.repeats):
        for name in fills:
            kept = FeatureCache(2**34)
            shared = name == "the shared head once"
            clock = time.perf_counter()
            if shared:
                kept.fill(
                    target, [{"input_ids": r} for r in fill_rows], head.aux_layers, 0, torch.device("cpu")
                )
            else:
                for start in range(0, len(fill_rows), FILL_ROWS):
                    chunk = fill_rows[start : start + FILL_ROWS]
                    part = collate([{"input_ids": r, "labels": r} for r in chunk], 0)
                    kept.target_pass(target, part, head.aux_layers)
            fills[name].append(1000 * (time.perf_counter() - clock) / len(fill_rows))
    whole = statistics.mean(times["whole step"])
    lines = ["| part | ms per step | share of the step |", "| --- | ---: | ---: |"]
    for name, values in times.items():
        mean, std = statistics.mean(values), statistics.stdev(values)
        lines.append(f"| {name} | {mean:.1f} ± {std:.1f} | {mean / whole:.0%} |")
    lines += ["", "| rows a target forward | ms per row |", "| ---: | ---: |"]
    for n, values in per_row.items():
        lines.append(f"| {n} | {statistics.mean(values):.1f} ± {statistics.stdev(values):.1f} |")
    lines += ["", f"| the feature cache's fill, {FILL_ROWS} rows a call, of 64 rows sharing 36 tokens | ms per row |",
              "| --- | ---: |"]  # fmt: skip
    for name, values in fills.items():
        lines.append(f"| {name} | {statistics.mean(values):.1f} ± {statistics.stdev(values):.1f} |")
    setting = (
        f"Demo target, {args.rows} rows of {args.length} tokens a step (the first {args.prompt} masked), "
        f"{torch.get_num_threads()} threads; "
        f"{args.repeats} interleaved rounds of {args.steps} steps each, mean ± std over the rounds."
    )
    record("eagle3_step", setting, lines, args.record)


if __name__ == "__main__":
    main()
