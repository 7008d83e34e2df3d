"""Which EAGLE-3 training settings the demo can afford: heads trained on a finished demo run's distilled mix
with several settings, each measured by its block efficiency on held-out prompts beside the run's own
finetuned drafter.

For each variant (a list of `eagle3.*` overrides of the run's recipe), one head is trained for `--pair` in
this process, through the stage's own code (`pipelines.stages.eagle3.Job`), then decodes held-out prompts of
every eval set greedily with `eagle3` at K (prompts 24.. of each set: the measure stage decodes the first
24); the run's finetuned drafter of the pair decodes the same prompts with `sd`. Block efficiency is
deterministic at T=0 (one pass); training seconds are wall clock on this machine (run it alone).

    python -m bench.eagle3_demo --run runs/demo/demo --record bench/results/eagle3_demo.md
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from bench.held_out import record

BASE = ["eagle3.enabled=true", "eagle3.multilingual=false", "eagle3.loop.eval_every=0"]
VARIANTS = {
    "the demo's": [],
    "random start": [],
    "batch 16": ["eagle3.loop.per_device_batch_size=16"],
    "batch 8": ["eagle3.loop.per_device_batch_size=8"],
    "batch 2": ["eagle3.loop.per_device_batch_size=2"],
    "answers only": ["eagle3.open_rows=false"],
    "lengths not grouped": ["eagle3.loop.group_by_length=false"],
}
"""Each differs from the run's recipe in one setting (the demo's `eagle3` block: 1 epoch of batch 4 over the
mix with its open rows, lengths grouped, the head started from the target's last layer); `random start`
starts the layer and fc at random, as the reference implementations do, instead
(`models.eagle3.head_for_target`)."""


def block_efficiency(decode, prompts: list[torch.Tensor]) -> float:
    generations = [decode(prompt) for prompt in prompts]
    return sum(len(g.tokens) for g in generations) / sum(len(g.rounds) for g in generations)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, default=Path("runs/demo/demo"))
    parser.add_argument("--pair", default="de-en")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    parser.add_argument("--record", type=Path, default=None)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    import polydraft.pipelines.stages.eagle3 as stage
    from polydraft.decoding.control import FixedK
    from polydraft.decoding.eagle3 import Eagle3Drafter, eagle3_decode
    from polydraft.decoding.lm import CachedLM
    from polydraft.decoding.measurement.groups import eos_ids_of
    from polydraft.decoding.sampling import Sampling
    from polydraft.decoding.sd import speculative
    from polydraft.models.eagle3 import load_eagle3
    from polydraft.models.loading import load_tokenizer
    from polydraft.pipelines.run.recipe import load_recipe
    from polydraft.pipelines.runtime.contract import StageSpec
    from polydraft.pipelines.runtime.tracking import Tracker
    from polydraft.pipelines.schema.inputs import Eagle3Inputs, EvalPrompts
    from polydraft.train.runtime import make_accelerator

    manifest = json.loads((args.run / "distill" / "manifest.json").read_text(encoding="utf-8"))
    target_spec = manifest["config"]["target"]
    target = AutoModelForCausalLM.from_pretrained(target_spec["path"], dtype=torch.float32).eval()
    tokenizer = load_tokenizer(target_spec["path"], None, False)
    recipe = load_recipe(args.run / "recipe.yaml")
    count = 24 + args.prompts
    eval_sets = EvalPrompts.of(recipe).load(count, recipe.measure.max_prompt_tokens, tokenizer)
    prompts = {s.name: s.prompts[24:count] for s in eval_sets}
    eos, greedy, k = eos_ids_of(target, tokenizer), Sampling(), args.k
    plain, new = CachedLM(target, profile=False), args.max_new_tokens
    drafter = CachedLM(
        AutoModelForCausalLM.from_pretrained(args.run / "finetune" / args.pair).eval(), profile=False
    )
    reference = {
        name: block_efficiency(
            lambda p: speculative(plain, drafter, p, new, greedy, FixedK(k), torch.Generator(), eos), chosen
        )
        for name, chosen in prompts.items()
    }
    header = ["variant", "steps", "train s", *(f"eagle3 BE {name}" for name in prompts)]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines.append(
        f"| sd[{args.pair}] K={k} (the run's drafter) | | | "
        + " | ".join(f"{v:.2f}" for v in reference.values())
        + " |"
    )
    random_start = stage.head_for_target
    for name in args.variants:
        overrides = [*BASE, *VARIANTS[name]]
        resolved = load_recipe(args.run / "recipe.yaml", overrides)
        inputs = Eagle3Inputs.of(resolved, _resolved_target(target_spec)).model_copy(
            update={"pairs": [args.pair]}
        )
        work = Path(tempfile.mkdtemp(prefix="eagle3-bench-"))
        spec = StageSpec(stage="eagle3", run_dir=str(work), work_dir=str(work), upstream={"distill": str(args.run / "distill")},
                         inputs=inputs.model_dump(mode="json"), tracking={"mode": "disabled"}, quiet=True)  # fmt: skip
        stage.head_for_target = _random_layer(random_start) if name == "random start" else random_start
        start = time.perf_counter()
        stage.train_heads(
            spec, inputs, make_accelerator(inputs.eagle3.loop.grad_accum_steps, "no"), Tracker(None, "eagle3")
        )
        seconds = time.perf_counter() - start
        stage.head_for_target = random_start
        steps = json.loads((work / f"{args.pair}.metrics.json").read_text(encoding="utf-8"))["steps"]
        head = load_eagle3(work / args.pair)
        featured = CachedLM(target, profile=False, aux_layers=head.aux_layers)
        head_drafter = Eagle3Drafter(head, target.get_input_embeddings(), profile=False)

        def decode(prompt, featured=featured, head_drafter=head_drafter):
            return eagle3_decode(
                featured, head_drafter, prompt, new, greedy, FixedK(k), torch.Generator(), eos
            )

        cells = [block_efficiency(decode, chosen) for chosen in prompts.values()]
        lines.append(f"| {name} | {steps} | {seconds:.0f} | " + " | ".join(f"{v:.2f}" for v in cells) + " |")
        print(lines[-1], flush=True)
        shutil.rmtree(work, ignore_errors=True)
    setting = (
        f"Run `{args.run}` (its distilled mix, target and `finetune/{args.pair}` drafter); one {args.pair} head per "
        f"variant, trained in this process (`train s`: the stage's work for it, target load and mix tokenization "
        f"included); block efficiency at K={k}, T=0, on held-out prompts 24-{count - 1} of each eval set, "
        f"up to {new} new tokens."
    )
    record("eagle3_demo", setting, lines, args.record)


def _resolved_target(spec: dict):
    from polydraft.pipelines.schema import ResolvedTarget

    return ResolvedTarget.model_validate(spec)


def _random_layer(build):
    """`head_for_target` leaving the layer and fc at their random start (the lm head and norm still the
    target's): the reference implementations' start."""

    def build_random(target, draft_ids, aux_layers, intermediate_size=None, seed=0):
        head = build(target, draft_ids, aux_layers, intermediate_size, seed)
        generator = torch.Generator().manual_seed(seed)
        std = getattr(target.config.get_text_config(), "initializer_range", 0.02)
        with torch.no_grad():
            for module in (head.fc, head.layers):
                for parameter in module.parameters():
                    if parameter.dim() == 2:
                        parameter.copy_(
                            torch.randn(parameter.shape, generator=generator).to(parameter.device) * std
                        )
                    else:
                        parameter.fill_(1.0)  # the norms
        return head

    return build_random


if __name__ == "__main__":
    main()
