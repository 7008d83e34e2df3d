"""Drafter depth x draft length on the demo's task: block efficiency, wall-clock and predicted speedup.

For each depth, the pipeline itself trains the drafters (`polydraft run` of the recipe with
`pretrain.drafter.num_layers=<depth>` and any extra overrides, up to finetune; the distill stage is run
once and shared). Then, in ONE process, `ar` and `sd` with every (depth, K) decode each pair's held-out
eval prompts with the pair's own drafter at temperature 0, the methods rotating prompt by prompt, in
`--repetitions` disjoint prompt subsets. The predicted speedup is the one the measured forward latencies
allow (`decoding.measurement.latency`, timed inside rounds): BE x t_T(1) / (t_T(K + 1) + t_D,1 + ... + t_D,K).

    python -m bench.drafter_depth --out-dir /tmp/depth [--depths 1 2 3] [--ks 1 2 3 4 6 8] \
        [--prompts 8] [--repetitions 3] [--skip-train] [--record bench/results/drafter_depth.md] \
        [key.path=value ...]

Training takes a few minutes per depth on 2 CPU cores; `--skip-train` measures drafters trained before.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.held_out import load_held_out, mean_std, record  # noqa: E402
from polydraft.decoding.control import FixedK  # noqa: E402
from polydraft.decoding.engine import autoregressive  # noqa: E402
from polydraft.decoding.lm import CachedLM  # noqa: E402
from polydraft.decoding.measurement.costs import chain_cost, predicted_speedup  # noqa: E402
from polydraft.decoding.measurement.latency import run_latencies  # noqa: E402
from polydraft.decoding.measurement.metrics import summarize  # noqa: E402
from polydraft.decoding.sampling import Sampling  # noqa: E402
from polydraft.decoding.sd import speculative  # noqa: E402

TRAIN_ONLY = [
    "early_exit.enabled=false",
    "calibrate.enabled=false",
    "measure.enabled=false",
    "export.enabled=false",
]


def train(recipe: str, out_dir: Path, depths: list[int], overrides: list[str]) -> None:
    """Distill once, then pretrain + finetune one drafter per pair for each depth."""
    first = out_dir / f"depth{depths[0]}"
    for depth in depths:
        run_dir = out_dir / f"depth{depth}"
        if run_dir != first and not (run_dir / "distill").exists() and (first / "distill").exists():
            shutil.copytree(first / "distill", run_dir / "distill")
        command = [
            sys.executable,
            "-m",
            "polydraft.pipelines.cli.main",
            "run",
            recipe,
            "--run-dir",
            str(run_dir),
            "--quiet",
            f"pretrain.drafter.num_layers={depth}",
            *TRAIN_ONLY,
            *overrides,
        ]
        started = time.perf_counter()
        subprocess.run(command, cwd=ROOT, check=True)
        print(f"depth {depth}: trained in {time.perf_counter() - started:.0f} s", flush=True)


def measure(args: argparse.Namespace) -> list[str]:
    """Decode and return the result table's lines."""
    from transformers import AutoModelForCausalLM

    count = args.prompts * args.repetitions
    held = load_held_out(args.recipe, args.overrides, count)
    target, eos_ids, eval_sets = held.target, held.eos_ids, held.eval_sets
    target_lm = CachedLM(target)
    drafters = {
        (depth, s.pair): CachedLM(
            AutoModelForCausalLM.from_pretrained(args.out_dir / f"depth{depth}" / "finetune" / s.pair).eval()
        )
        for depth in args.depths
        for s in eval_sets
    }
    prompt = eval_sets[0].prompts[0]
    length = prompt.numel() + args.max_new_tokens // 2
    context = prompt.repeat(-(-length // prompt.numel()))[:length].view(1, -1)
    named = {f"{depth}/{pair}": lm for (depth, pair), lm in drafters.items()}
    latencies = run_latencies(target_lm, named, {}, {}, context, max(args.ks), [], args.latency_repeats)
    step = latencies.target.chain[1]
    rounds = {key: latencies.rounds[f"{key[0]}/{key[1]}"] for key in drafters}
    first = rounds[(args.depths[0], eval_sets[0].pair)]
    lines = [
        f"target step {step * 1e3:.2f} ms; verify K+1 tokens in a round: "
        + ", ".join(f"{n}: {s / step:.2f}" for n, s in sorted(first.verify.items()) if n > 1)
        + " target steps; drafter steps of a round (the first, the mean of all): "
        + ", ".join(
            f"depth {d} {r.draft[0] * 1e3:.2f}, {statistics.mean(r.draft) * 1e3:.2f} ms"
            for d in args.depths
            for r in [rounds[(d, eval_sets[0].pair)]]
        ),
        "",
        "| pair | depth | K | block efficiency | speedup | predicted speedup | measured / predicted - 1 |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    greedy = Sampling(0.0, 1.0)
    for eval_set in eval_sets:
        results: dict[tuple[int, int], list[tuple[float, float, float]]] = {}
        for rep in range(args.repetitions):
            prompts = eval_set.prompts[rep * args.prompts : (rep + 1) * args.prompts]
            methods = [("ar", 0, 0)] + [("sd", d, k) for d in args.depths for k in args.ks]
            generations: dict[tuple[str, int, int], list] = {m: [] for m in methods}
            for index, p in enumerate([prompts[0], *prompts]):  # the first decode of each is a warm-up
                shift = index % len(methods)
                for method in methods[shift:] + methods[:shift]:
                    generator = torch.Generator().manual_seed(index)
                    if method[0] == "ar":
                        out = autoregressive(target_lm, p, args.max_new_tokens, greedy, generator, eos_ids)
                    else:
                        drafter = drafters[(method[1], eval_set.pair)]
                        out = speculative(
                            target_lm,
                            drafter,
                            p,
                            args.max_new_tokens,
                            greedy,
                            FixedK(method[2]),
                            generator,
                            eos_ids,
                        )
                    if index:
                        generations[method].append(out)
            ar_rate = summarize(generations[("ar", 0, 0)], None)["token_rate"]
            for _, depth, k in methods[1:]:
                outs = generations[("sd", depth, k)]
                metrics = summarize(outs, None)
                cost = chain_cost(rounds[(depth, eval_set.pair)])
                results.setdefault((depth, k), []).append(
                    (
                        metrics["block_efficiency"],
                        metrics["token_rate"] / ar_rate,
                        predicted_speedup(outs, step, cost),
                    )
                )
        for (depth, k), values in sorted(results.items()):
            be, speed, predicted = ([v[i] for v in values] for i in range(3))
            lines.append(
                f"| {eval_set.pair} | {depth} | {k} | {mean_std(be)} | {mean_std(speed)} | "
                f"{statistics.mean(predicted):.2f} | {statistics.mean(speed) / statistics.mean(predicted) - 1:+.0%} |"
            )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="key.path=value", help="recipe overrides (training and measuring)"
    )
    parser.add_argument("--recipe", default="recipes/demo/demo.yaml")
    parser.add_argument("--out-dir", type=Path, required=True, help="run directories, one per depth")
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    parser.add_argument("--prompts", type=int, default=8, help="prompts per pair and repetition")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--latency-repeats", type=int, default=20)
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--record", type=Path, help="append the command and table to this markdown file")
    args = parser.parse_args()
    started = time.perf_counter()
    if not args.skip_train:
        train(args.recipe, args.out_dir, args.depths, args.overrides)
    lines = measure(args)
    setting = (
        f"T=0, {args.prompts} held-out prompts x {args.repetitions} disjoint repetitions per pair, up to "
        f"{args.max_new_tokens} new tokens, in-domain drafters; cells mean ± std over repetitions "
        f"({time.perf_counter() - started:.0f} s in all)."
    )
    record("drafter_depth", setting, lines, args.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
