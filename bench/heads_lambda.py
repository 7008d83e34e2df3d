"""The rescoring weight lambda of `bpd+rescore` and `medusa+rescore` (seed 000's local rescoring), swept.

Trains nothing: reads a finished run of a recipe with the heads stage (e.g. the demo with
`heads.enabled=true`, or `recipes/demo/full.yaml`): the target, `heads/heads/` and each pair's finetuned
drafter `finetune/<pair>/`, which rescores its own pair's eval set (in domain). In ONE process, at
temperature 0, `ar`, `bpd`, `medusa` and both `+rescore` decoders at every lambda decode each eval set's
held-out prompts, the methods rotating prompt by prompt, in `--repetitions` disjoint prompt subsets. The
prompts start at `--offset` in the shuffled eval set (default 24: after the 3 x 8 prompts the demo's measure
stage decodes, so that lambda is not chosen on the prompts the demo then reports). Prints block efficiency
(and speedup over `ar`) mean ± std over the repetitions per lambda, the gain of each `+rescore` decoder over
the same decoder without rescoring on the same prompts (paired: the std is that of the per-repetition
differences), and the lambda with the highest block efficiency averaged over both decoders and every eval
set. Every output is checked against `ar`'s.

    python -m bench.heads_lambda --run-dir runs/heads [--recipe recipes/demo/demo.yaml] \
        [--lambdas 0 0.25 0.5 0.75 1] [--prompts 8] [--repetitions 3] [--offset 24] \
        [--record bench/results/heads_lambda.md] [key.path=value ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.held_out import load_held_out, mean_std, record  # noqa: E402
from polydraft.decoding.blockwise import HeadsDraft, Rescoring, blockwise_chain, blockwise_tree  # noqa: E402
from polydraft.decoding.engine import autoregressive  # noqa: E402
from polydraft.decoding.lattice import CandidateTree  # noqa: E402
from polydraft.decoding.lm import CachedLM  # noqa: E402
from polydraft.decoding.measurement.metrics import summarize  # noqa: E402
from polydraft.decoding.sampling import Sampling  # noqa: E402


def methods_for(args, recipe, target_lm, heads, drafter, eos_ids):
    """(name, lambda or None, decode(prompt)) for ar, bpd, medusa and both +rescore decoders per lambda."""
    cfg, greedy, new = recipe.measure, Sampling(0.0), args.max_new_tokens
    shape = CandidateTree.from_paths(cfg.medusa_tree)

    def generator() -> torch.Generator:
        return torch.Generator().manual_seed(0)

    methods = [
        ("ar", None, lambda p: autoregressive(target_lm, p, new, greedy, generator(), eos_ids)),
        ("bpd", None, lambda p: blockwise_chain(target_lm, heads, p, new, greedy, generator(), eos_ids)),
        (
            "medusa",
            None,
            lambda p: blockwise_tree(target_lm, heads, p, new, greedy, generator(), eos_ids, shape=shape),
        ),
    ]
    for weight in args.lambdas:
        r = Rescoring(drafter, weight, cfg.rescore_top_k, cfg.rescore_beam_width)
        methods += [
            (
                "bpd+rescore",
                weight,
                lambda p, r=r: blockwise_chain(target_lm, heads, p, new, greedy, generator(), eos_ids, r),
            ),
            (
                "medusa+rescore",
                weight,
                lambda p, r=r: blockwise_tree(
                    target_lm, heads, p, new, greedy, generator(), eos_ids, rescoring=r
                ),
            ),
        ]
    return methods


def measure(args: argparse.Namespace) -> list[str]:
    """Decode and return the result table's lines."""
    from transformers import AutoModelForCausalLM

    from polydraft.models.heads import attach_heads

    count = args.offset + args.prompts * args.repetitions
    held = load_held_out(args.recipe, args.overrides, count)
    recipe, target, eos_ids, eval_sets = held.recipe, held.target, held.eos_ids, held.eval_sets
    target_lm = CachedLM(target)
    heads = HeadsDraft(attach_heads(target, args.run_dir / "heads" / "heads"), target_lm)
    cfg = recipe.measure
    lines = [
        f"heads: {heads.num_heads} {heads.heads.kind} heads; rescoring over the top {cfg.rescore_top_k} "
        f"per position, beam width {cfg.rescore_beam_width}; medusa tree of {len(cfg.medusa_tree)} nodes",
        "",
        "| eval set | method | lambda | block efficiency | gain over the heads alone (paired) | speedup over ar |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    by_lambda: dict[float, list[float]] = {}
    for eval_set in eval_sets:
        if len(eval_set.prompts) < count:
            raise SystemExit(f"{eval_set.name}: {len(eval_set.prompts)} prompts, {count} needed")
        drafter_model = AutoModelForCausalLM.from_pretrained(args.run_dir / "finetune" / eval_set.pair)
        drafter = CachedLM(drafter_model.eval())
        methods = methods_for(args, recipe, target_lm, heads, drafter, eos_ids)
        results: dict[tuple[str, float | None], list[tuple[float, float]]] = {}
        for rep in range(args.repetitions):
            start = args.offset + rep * args.prompts
            prompts = eval_set.prompts[start : start + args.prompts]
            generations: dict[int, list] = {i: [] for i in range(len(methods))}
            for index, prompt in enumerate([prompts[0], *prompts]):  # the first decode is a warm-up
                shift = index % len(methods)
                for i in [*range(shift, len(methods)), *range(shift)]:
                    out = methods[i][2](prompt)
                    if index:
                        generations[i].append(out)
            reference = [g.tokens for g in generations[0]]
            ar_rate = summarize(generations[0], None)["token_rate"]
            for i, (name, weight, _) in enumerate(methods[1:], start=1):
                if [g.tokens for g in generations[i]] != reference:
                    raise SystemExit(f"{name} lambda={weight} on {eval_set.name}: output differs from ar's")
                metrics = summarize(generations[i], None)
                results.setdefault((name, weight), []).append(
                    (metrics["block_efficiency"], metrics["token_rate"] / ar_rate)
                )
        for (name, weight), values in results.items():
            be, speed = [v[0] for v in values], [v[1] for v in values]
            label, gain = "-", "-"
            if weight is not None:  # the same prompts' heads-alone decoder, repetition by repetition
                alone = [v[0] for v in results[(name.removesuffix("+rescore"), None)]]
                gain = mean_std([b - a for a, b in zip(alone, be)], 3, sign=True)
                label = f"{weight:g}"
            lines.append(
                f"| {eval_set.name} | {name} | {label} | {mean_std(be, 3)} | {gain} | {mean_std(speed, 3)} |"
            )
            if weight is not None:
                by_lambda.setdefault(weight, []).append(statistics.mean(be))
    best = max(sorted(by_lambda), key=lambda w: statistics.mean(by_lambda[w]))
    lines += [
        "",
        "Block efficiency of both +rescore decoders averaged over the eval sets, per lambda: "
        + ", ".join(f"{w:g}: {statistics.mean(v):.3f}" for w, v in sorted(by_lambda.items()))
        + f". Best: lambda = {best:g}. Every output equals ar's.",
    ]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("overrides", nargs="*", metavar="key.path=value", help="recipe overrides")
    parser.add_argument("--recipe", default="recipes/demo/demo.yaml")
    parser.add_argument("--run-dir", type=Path, required=True, help="a finished run with heads and finetune")
    parser.add_argument("--lambdas", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    parser.add_argument("--prompts", type=int, default=8, help="prompts per eval set and repetition")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--offset", type=int, default=24, help="first prompt of the shuffled eval set")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--record", type=Path, help="append the command and table to this markdown file")
    args = parser.parse_args()
    started = time.perf_counter()
    torch.manual_seed(0)
    lines = measure(args)
    setting = (
        f"T=0, {args.prompts} held-out prompts x {args.repetitions} disjoint repetitions per eval set "
        f"(prompts {args.offset} to {args.offset + args.prompts * args.repetitions - 1} of each shuffled set), "
        f"up to {args.max_new_tokens} new tokens, each set rescored by its own pair's drafter; cells mean "
        f"± std over repetitions ({time.perf_counter() - started:.0f} s in all)."
    )
    record("heads_lambda", setting, lines, args.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
