"""The latency probe before, between and after decoding, against the decoding's own target calls, in one process.

Loads a finished demo run's target and drafters as its measure stage does (`pipelines.stages.measure.load`,
which runs the probe once), then `--phases` times: decodes `ar` and `sd[<drafter>]` on every repetition's
prompts of one eval set at T=0 (the two interleaved prompt by prompt), logging each target forward call by
its number of new tokens (the models' own clocks), and runs the probe again (`measure_latencies`, as the
stage does). Prints, for the probes and for the decoding, the target's step (one token, not a prompt's
first call), its verification of K + 1 positions and their ratio: the ratio is what the predicted speedup
of `sd` reads from them, so a probe that drifts with the process, or that times verifications unlike the
decoding's, shows as a ratio that differs from the decoding's.

    python -m bench.probe_drift --run-dir runs/demo/demo [--drafter de-en] [--eval-set de-en] [--phases 2]
        [--record bench/results/engine_overhead.md]

Run it with nothing else on the machine (one thread: OMP_NUM_THREADS=1, as the demo's measure processes).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.engine_overhead import greedy_methods, load_run  # noqa: E402
from polydraft.decoding.lm import CachedLM  # noqa: E402
from polydraft.decoding.measurement.eval_inputs import repetition_prompts  # noqa: E402
from polydraft.decoding.measurement.groups import method_label  # noqa: E402
from polydraft.decoding.measurement.latency import RunLatencies  # noqa: E402
from polydraft.pipelines.stages.measure_methods import measure_latencies  # noqa: E402


def logged(target: CachedLM, calls: dict[int, list[float]]) -> None:
    """Log every later forward call of `target` but a prompt's first into `calls` (new tokens -> seconds)."""
    forward = target.forward

    def forward_logged(input_ids, *args, **kwargs):
        first = target.length == 0
        before = target.seconds
        result = forward(input_ids, *args, **kwargs)
        if not first:
            calls.setdefault(input_ids.shape[1], []).append(target.seconds - before)
        return result

    target.forward = forward_logged


def probe_row(tag: str, latencies: RunLatencies, drafter: str, k: int) -> str:
    step, verify = latencies.target.chain[1], latencies.rounds[drafter].verify[k + 1]
    return f"| probe {tag} | {1e3 * step:.2f} | | {1e3 * verify:.2f} | | {verify / step:.3f} |"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "demo" / "demo")
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "demo" / "demo.yaml"))
    parser.add_argument("--drafter", default="de-en")
    parser.add_argument("--eval-set", default="de-en")
    parser.add_argument("--phases", type=int, default=2)
    parser.add_argument("--record", type=Path)
    args = parser.parse_args()

    inputs, loaded = load_run(args.recipe, args.run_dir)
    cfg = inputs.measure
    k = cfg.draft_length
    eval_set = next(s for s in loaded.eval_sets if s.name == args.eval_set)
    drafters = [d for d in loaded.drafters if d.source.name == args.drafter]
    labels = ("ar", f"sd[{args.drafter}] K={k}")
    rows = [probe_row("at load", loaded.latencies, args.drafter, k)]
    calls: dict[int, list[float]] = {}
    logged(loaded.target_lm, calls)
    for phase in range(1, args.phases + 1):
        calls.clear()
        for seed in cfg.seeds:
            prompts = repetition_prompts(
                eval_set.prompts, cfg.seeds, seed, cfg.num_prompts, cfg.disjoint_prompts
            )
            methods = greedy_methods(inputs, loaded, eval_set, seed)
            methods = [m for m in methods if method_label(m.fields) in labels]
            for index, prompt in enumerate(prompts):
                for method in methods if index % 2 == 0 else methods[::-1]:
                    method.decode(prompt, index)
        step, verify = calls[1], calls[k + 1]
        rows.append(
            f"| decoding {phase} | {1e3 * statistics.median(step):.2f} | {1e3 * statistics.mean(step):.2f} "
            f"| {1e3 * statistics.median(verify):.2f} | {1e3 * statistics.mean(verify):.2f} "
            f"| {statistics.median(verify) / statistics.median(step):.3f} |"
        )
        latencies = measure_latencies(cfg, loaded.target_lm, drafters, eval_set.prompts[0])
        rows.append(probe_row(f"after decoding {phase}", latencies, args.drafter, k))

    lines = [
        f"## {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%MZ} - the probe before, between and "
        "after decoding",
        "",
        f"`OMP_NUM_THREADS={torch.get_num_threads()} python -m bench.probe_drift --drafter {args.drafter} "
        f"--eval-set {args.eval_set} --phases {args.phases}` (`ar` and `sd[{args.drafter}]` K={k} on "
        f"{args.eval_set}, T=0, {len(cfg.seeds)} repetitions of {cfg.num_prompts} prompts x "
        f"{cfg.max_new_tokens} new tokens per phase, interleaved; the probe as the measure stage runs it, "
        f"{cfg.latency_repeats} repeats, medians). Target calls, ms: the step (one new token) and the "
        f"verification of {k + 1} positions; the decoding's median and mean over its calls.",
        "",
        f"| when | step | step mean | verify {k + 1} | verify mean | verify / step |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        *rows,
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.record:
        args.record.write_text(args.record.read_text().rstrip("\n") + "\n\n" + text)


if __name__ == "__main__":
    main()
