"""The tree round's time between forward calls: this checkout's `decoding.tree`, `decoding.sampling` and
`CachedLM.keep` (`decoding.lm`) against another commit's, interleaved prompt by prompt in one process.

Loads a finished demo run's target and drafters as its measure stage does (`pipelines.stages.measure.load`),
builds the `rsd_s` row of one drafter on one eval set, and decodes every repetition's prompts at T=0 twice
per prompt, once with each version of the three pieces (the order alternating), `--repeats` times. Prints
per version the wall time, the time inside the models' forward calls (the engine's own clocks) and the time
between them per round, and checks that both versions wrote the same tokens.

    python -m bench.tree_rounds --run-dir runs/demo/demo --against 2b5ab8a [--drafter de-en] [--eval-set de-en]
        [--repeats 2] [--record bench/results/engine_overhead.md]

Run it with nothing else on the machine (one thread: OMP_NUM_THREADS=1, as the demo's measure processes).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import polydraft.decoding.lm as lm  # noqa: E402
import polydraft.decoding.rsd as rsd  # noqa: E402
import polydraft.decoding.tree as tree  # noqa: E402
from bench.engine_overhead import greedy_methods, load_run  # noqa: E402
from bench.held_out import module_at  # noqa: E402
from polydraft.decoding.measurement.eval_inputs import repetition_prompts  # noqa: E402
from polydraft.decoding.measurement.groups import method_label  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "demo" / "demo")
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "demo" / "demo.yaml"))
    parser.add_argument("--against", required=True, help="the commit whose tree round to compare with")
    parser.add_argument("--drafter", default="de-en")
    parser.add_argument("--eval-set", default="de-en")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--record", type=Path)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as folder:
        other_sampling = module_at(
            args.against, "decoding/sampling.py", "polydraft.decoding.sampling_then", Path(folder)
        )
        other = module_at(args.against, "decoding/tree.py", "polydraft.decoding.tree_then", Path(folder))
        other_lm = module_at(args.against, "decoding/lm.py", "polydraft.decoding.lm_then", Path(folder))
    other.stochastic_beam_step = other_sampling.stochastic_beam_step  # the tree round of that commit, whole
    versions = {args.against: other, "this checkout": tree}
    # each version's cache too: its reset (the cache it builds), forward and keep; the objects are this checkout's
    parts = ("reset", "forward", "keep")
    caches = {
        args.against: {part: getattr(other_lm.CachedLM, part) for part in parts},
        "this checkout": {part: getattr(lm.CachedLM, part) for part in parts},
    }

    inputs, loaded = load_run(args.recipe, args.run_dir)
    cfg = inputs.measure
    eval_set = next(s for s in loaded.eval_sets if s.name == args.eval_set)
    label = f"rsd_s[{args.drafter}]"
    results: dict[str, list] = {name: [] for name in versions}
    for seed in cfg.seeds:
        prompts = repetition_prompts(eval_set.prompts, cfg.seeds, seed, cfg.num_prompts, cfg.disjoint_prompts)
        methods = greedy_methods(inputs, loaded, eval_set, seed)
        method = next(m for m in methods if method_label(m.fields).startswith(label))
        method.decode(prompts[0], 0)  # warm-up
        for repeat in range(args.repeats):
            for index, prompt in enumerate(prompts):
                order = list(versions) if (index + repeat) % 2 == 0 else list(versions)[::-1]
                for name in order:
                    rsd.tree_decode, rsd.draft_tree = versions[name].tree_decode, versions[name].draft_tree
                    for part, function in caches[name].items():
                        setattr(lm.CachedLM, part, function)
                    results[name].append(method.decode(prompt, index))
    rsd.tree_decode, rsd.draft_tree = tree.tree_decode, tree.draft_tree
    for part, function in caches["this checkout"].items():
        setattr(lm.CachedLM, part, function)
    same = [g.tokens for g in results[args.against]] == [g.tokens for g in results["this checkout"]]

    lines = [
        f"## {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%MZ} - the tree round against {args.against}",
        "",
        f"`OMP_NUM_THREADS={torch.get_num_threads()} python -m bench.tree_rounds --against {args.against} "
        f"--drafter {args.drafter} --eval-set {args.eval_set} --repeats {args.repeats}` ({label} on "
        f"{args.eval_set}, T=0, {len(cfg.seeds)} repetitions of {cfg.num_prompts} prompts x "
        f"{cfg.max_new_tokens} new tokens, each prompt decoded {args.repeats} times with each version, "
        f"interleaved; the same tokens from both: {same})",
        "",
        "| tree round | wall s | forward s | rounds | between the forward calls, ms a round |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, generations in results.items():
        wall = sum(g.wall_seconds for g in generations)
        forward = sum(g.target_seconds + g.draft_seconds for g in generations)
        rounds = sum(g.target_calls for g in generations)
        lines.append(
            f"| {name} | {wall:.2f} | {forward:.2f} | {rounds} | {1e3 * (wall - forward) / rounds:.3f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if not same:
        raise SystemExit("the two versions wrote different tokens")
    if args.record:
        args.record.write_text(args.record.read_text().rstrip("\n") + "\n\n" + text)


if __name__ == "__main__":
    main()
