"""How well the committed demo target translates each pair it was trained on: greedy answers to held-out
prompts against the offline corpus' references, line by line.

For each pair of `target.bootstrap.pairs`: the first `--count` held-out prompts of spelled-out numbers (the
demo's task) and of the mixed test split (catalog messages, names, dates, numbers), decoded greedily with
the measure stage's `ar`; reported per pair: the share of answer lines equal to the reference line, the
share of answers equal to the reference whole, and the mean answer length in tokens. Deterministic (greedy
decoding of a fixed model): one pass. Run alone on the machine (it is slow, not timed).

    python -m bench.demo_target --record bench/results/demo_target.md
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.held_out import record
from polydraft.data.offline import offline_pairs
from polydraft.data.prompts import build_prompt, encode_prompt, translation_messages
from polydraft.decoding.engine import autoregressive
from polydraft.decoding.lm import CachedLM
from polydraft.decoding.sampling import Sampling

KINDS = {
    "numbers": {"catalog": 0.0, "name": 0.0, "date": 0.0, "number": 1.0},  # a kind left out would weigh 1
    "mixed": {"catalog": 1.0, "name": 1.0, "date": 1.0, "number": 1.0},
}


def score(
    lm: CachedLM, tokenizer, pair: str, rows: list[dict], max_new: int, eos: set[int]
) -> tuple[float, float, float]:
    """(line exact-match share, whole-answer exact-match share, mean answer tokens)."""
    lines = lines_right = whole = tokens = 0
    for row in rows:
        prompt = build_prompt(translation_messages(pair, row["source"]), "vicuna", tokenizer)
        ids = torch.tensor(encode_prompt(tokenizer, prompt))
        out = autoregressive(lm, ids, max_new, Sampling(), torch.Generator(), eos).tokens
        tokens += len(out)
        answer = tokenizer.decode(out, skip_special_tokens=True).strip()
        got, want = answer.split("\n"), row["target"].split("\n")
        lines += len(want)
        lines_right += sum(g.strip() == w.strip() for g, w in zip(got, want))
        whole += answer == row["target"].strip()
    return lines_right / lines, whole / len(rows), tokens / len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="recipes/demo/demo.yaml")
    parser.add_argument("--count", type=int, default=50)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--record", type=Path, default=None)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from polydraft.decoding.measurement.groups import eos_ids_of
    from polydraft.models.loading import load_tokenizer
    from polydraft.pipelines.run.recipe import load_recipe
    from polydraft.pipelines.runtime.target import bootstrap_pairs, resolve_target

    recipe = load_recipe(Path(args.recipe), [])
    spec = resolve_target(recipe.target, recipe.data, show_progress=False, build=False)
    target = AutoModelForCausalLM.from_pretrained(spec.path).eval()
    tokenizer = load_tokenizer(spec.path, None, False)
    lm, eos = CachedLM(target, profile=False), eos_ids_of(target, tokenizer)
    offline, seed = recipe.data.offline, recipe.data.seed
    low, high = offline.entries_per_sample
    lines = [
        "| pair | prompts | lines exact (numbers) | answers exact (numbers) | answer tokens (numbers) "
        "| lines exact (mixed) | answers exact (mixed) | answer tokens (mixed) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for pair in bootstrap_pairs(recipe.target, recipe.data):
        cells = []
        for weights in KINDS.values():
            rows = offline_pairs(pair, "test", args.count, (low, high), offline.test_fraction, seed, weights)
            line, whole, length = score(lm, tokenizer, pair, rows, args.max_new_tokens, eos)
            cells += [f"{line:.1%}", f"{whole:.1%}", f"{length:.1f}"]
        lines.append(f"| {pair} | {args.count} | " + " | ".join(cells) + " |")
    setting = (
        f"Target `{Path(spec.path).name}` ({args.recipe}); per pair the first {args.count} held-out samples of "
        f"{low}-{high} entries (the offline corpus' test split, data seed {seed}), spelled-out numbers only "
        f"and every kind mixed, greedy, at most {args.max_new_tokens} new tokens."
    )
    record("demo_target", setting, lines, args.record)


if __name__ == "__main__":
    main()
