"""The plan of recipes/vicuna-7b/de.yaml on one 8xA100-80GB node, before and after issue 28: `polydraft plan`
with the recipe as it was (one vLLM engine; 4 training processes; batch 2 per GPU; 480 prompts decoded by
every seed) and as it ships now, on one node and on two. An estimate from pipelines/runtime/cluster.py's
constants, not a measurement: its range puts every rate the plan assumes for a GPU at half as good (each
throughput halved, each fixed cost doubled) beside the plan as assumed.

    python -m bench.plan_vicuna7b_de        # writes bench/results/plan_vicuna7b_de.md
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import io
import shlex
from pathlib import Path

from polydraft.pipelines.cli.main import main
from polydraft.pipelines.plan.estimate import estimate
from polydraft.pipelines.run.recipe import load_recipe
from polydraft.pipelines.runtime.cluster import Rates, parse_gpus

RECIPE = "recipes/vicuna-7b/de.yaml"
GPUS = ["--gpus", "8xA100-80GB"]
BEFORE = [
    "--distill-engines", "1",
    "launch.num_processes=4",
    "finetune.loop.per_device_batch_size=2",
    "measure.num_prompts=480",
    "measure.disjoint_prompts=false",
    "pretrain.loop.loss_chunk_tokens=null",
    "finetune.loop.loss_chunk_tokens=null",
]  # fmt: skip
"""The recipe's values before issue 28, distillation on one vLLM engine and the loss from the whole
logits (the stages' behaviour then)."""
AFTER: list[str] = []
"""The recipe as it is: one vLLM engine per GPU (`distill.vllm.data_parallel` None), chunked loss."""


def plan_of(args: list[str]) -> tuple[str, str]:
    command = ["plan", RECIPE, *GPUS, *args]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(command)
    if code:
        raise SystemExit(f"polydraft {shlex.join(command)} exited {code}")
    return shlex.join(["polydraft", *command]), out.getvalue()


def slow(rates: Rates) -> Rates:
    """Every assumed GPU rate half as good: throughputs halved, fixed costs doubled."""
    return dataclasses.replace(
        rates, train_flops=rates.train_flops / 2, step_overhead_s=rates.step_overhead_s * 2,
        generate_flops=rates.generate_flops / 2, vllm_flops=rates.vllm_flops / 2,
        vllm_startup_s=rates.vllm_startup_s * 2, decode_bandwidth=rates.decode_bandwidth / 2,
        layer_s=rates.layer_s * 2, load_bytes_per_s=rates.load_bytes_per_s / 2, launch_s=rates.launch_s * 2,
    )  # fmt: skip


def ranges() -> str:
    """The shipped recipe's hours on one and two nodes, as assumed and with every assumed rate half as good."""
    recipe = load_recipe(RECIPE)
    lines = ["| nodes | hours as assumed | every assumed rate half as good |", "| ---: | ---: | ---: |"]
    for nodes in (1, 2):
        cluster = parse_gpus(GPUS[1], nodes)
        assumed = estimate(recipe, cluster).hours
        halved = estimate(recipe, dataclasses.replace(cluster, rates=slow(cluster.rates))).hours
        lines.append(f"| {nodes} | {assumed:.2f} | {halved:.2f} |")
    return "\n".join(lines) + "\n"


def main_bench() -> None:
    parts = [
        f"## {datetime.date.today()} - `python -m bench.plan_vicuna7b_de` (an estimate: no GPU ran)\n",
    ]
    for title, args in (
        ("Before issue 28", BEFORE),
        ("As shipped, one node", AFTER),
        ("As shipped, two nodes", ["--nodes", "2"]),
    ):
        command, output = plan_of(args)
        print(f"$ {command}\n{output}")
        parts.append(f"### {title}\n\n```\n$ {command}\n```\n\n{output}")
    table = ranges()
    print(table)
    parts.append(f"### As shipped, its range\n\n{table}")
    path = Path(__file__).parent / "results" / "plan_vicuna7b_de.md"
    path.write_text("\n".join(parts), encoding="utf-8")
    print(f"wrote {path}")


if __name__ == "__main__":
    main_bench()
