"""Where a decoding round's time goes, against what the latency model predicts for it.

The measure stage predicts each method's speedup from forward latencies timed in probes
(`decoding.measurement.latency`): a round costs its forward calls and nothing else. This bench loads a
finished demo run's target and drafters exactly as its measure stage does (`pipelines.stages.measure.load`,
which also times the probes), decodes one eval set's held-out prompts at T=0 with `ar`, `sd`, `rsd_s`,
`eesd` and `eagle3` (each pair-matched drafter of the set), the methods rotating prompt by prompt in one
process, `--repeats` times, and splits each method's measured time per round into:

- `forward`: time inside the models' forward passes during the rounds (the engine's own clocks:
  `Generation.target_seconds` + `draft_seconds`), less the prompt's first call of each model;
- `prefill`: that first call of each model on the whole prompt (timed apart here, on fresh caches, as
  the decoders make it), which the latency model leaves out;
- `between`: everything outside the forward passes (acceptance, host syncs, cache crops, commits,
  controllers, Python per round): wall clock - forward time;
- `probe`: the round cost the latency model charges (`Method.cost`).

Then `--profile` runs each method once more under cProfile and lists the engine's functions that take the
`between` time (own time, the models' forward passes excluded), so the overhead can be read by function;
`--ops` runs each once more under torch's profiler and counts the tensor operations a round runs outside
the forward passes (the outermost aten calls: what a fused or compiled round would have to take over).

    python -m bench.engine_overhead --run-dir runs/demo/demo [--eval-set de-en] [--repeats 3] [--profile] \
        [--ops] [--record bench/results/engine_overhead.md]

Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from polydraft.decoding.eagle3 import Eagle3Drafter  # noqa: E402
from polydraft.decoding.eesd import SelfSpeculative  # noqa: E402
from polydraft.decoding.lm import CachedLM  # noqa: E402
from polydraft.decoding.measurement.costs import predicted_speedup  # noqa: E402
from polydraft.decoding.measurement.eval_inputs import repetition_prompts  # noqa: E402
from polydraft.decoding.measurement.groups import method_label  # noqa: E402
from polydraft.decoding.sampling import Sampling  # noqa: E402
from polydraft.pipelines.run.recipe import load_recipe  # noqa: E402
from polydraft.pipelines.runtime.target import resolve_target  # noqa: E402
from polydraft.pipelines.schema.inputs import MeasureInputs  # noqa: E402
from polydraft.pipelines.stages.measure import load  # noqa: E402
from polydraft.pipelines.stages.measure_methods import build_methods  # noqa: E402

UPSTREAM = ("pretrain", "finetune", "early_exit", "heads", "eagle3", "calibrate")


def load_run(recipe_path: str, run_dir: Path):
    """(MeasureInputs, the measure stage's `load`) of a finished run of `recipe_path` in `run_dir`: its target,
    drafters and eval sets as the measure stage holds them, the probes timed again in this process."""
    recipe = load_recipe(recipe_path)
    inputs = MeasureInputs.of(recipe, resolve_target(recipe.target, recipe.data, build=False))
    upstream = {s: run_dir / s for s in UPSTREAM if (run_dir / s).is_dir()}
    with tempfile.TemporaryDirectory() as folder:  # measure writes the probes' latencies beside its rows
        return inputs, load(inputs, upstream, Path(folder) / "latency.json")


def greedy_methods(inputs: MeasureInputs, loaded, eval_set, seed: int) -> list:
    """The measure stage's methods for `eval_set` at T=0 with `seed`, on the loaded run."""
    return build_methods(
        inputs.measure, eval_set, Sampling(0.0, 1.0), seed, loaded.target, loaded.target_lm,
        loaded.drafters, loaded.eos_ids, loaded.latencies,
    )  # fmt: skip


def kept(fields: dict, pair: str) -> bool:
    """`ar`, and each decoder with the eval set's own drafter (eesd has one drafter for every pair)."""
    if fields["decoder"] in ("ar", "eesd"):
        return True
    return fields.get("drafter") in (pair, f"eagle3-{pair}")


def prefill_seconds(method_fields: dict, loaded, prompt: torch.Tensor) -> float:
    """The first call on the whole prompt, on fresh caches, of the target and (`sd`, `rsd_s`) the drafter.
    For `eesd` and `eagle3` the target's call stands for their own first call (the early exit's shared
    layers are the target's; the EAGLE-3 head's first step is not counted): an estimate, not their clock."""
    total = 0.0
    models = [loaded.target]
    drafter = next((d for d in loaded.drafters if d.source.name == method_fields.get("drafter")), None)
    if method_fields["decoder"] in ("sd", "rsd_s") and drafter is not None:
        models.append(drafter.model)
    for model in models:
        lm = CachedLM(model)
        with torch.inference_mode():
            started = time.perf_counter()
            lm.forward(prompt.view(1, -1), num_logits=1)
            total += time.perf_counter() - started
    return total


def split(method, prefill: dict[int, float]) -> dict[str, float]:
    """Per round (ms): forward time in the rounds, prefill, between the forward calls, the probe cost."""
    rounds = sum(g.target_calls for g in method.generations)
    wall = sum(g.wall_seconds for g in method.generations)
    forward = sum(g.target_seconds + g.draft_seconds for g in method.generations)
    first = sum(prefill[i] for i in range(len(method.generations)))
    probe = None
    if method.cost is not None:
        costs = [method.cost(r) for g in method.generations for r in g.rounds]
        probe = sum(costs) / len(costs) * 1e3 if costs else None
    tokens = sum(len(g.tokens) for g in method.generations)
    return {
        "tokens": tokens,
        "rounds": rounds,
        "round_ms": wall / rounds * 1e3,
        "forward_ms": (forward - first) / rounds * 1e3,
        "prefill_ms": first / rounds * 1e3,
        "between_ms": (wall - forward) / rounds * 1e3,
        "probe_ms": probe,
        "wall": wall,
    }


def engine_functions(profile: cProfile.Profile, top: int) -> list[tuple[str, float, int]]:
    """(function, own seconds, calls) of the package's code outside the models, by own time."""
    stats = pstats.Stats(profile)
    rows = []
    for (path, line, name), (_, calls, own, _cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        if "/decoding/" in path and "/measurement/" not in path:
            rows.append((f"{Path(path).parent.name}/{Path(path).name}:{line} {name}", own, calls))
    return sorted(rows, key=lambda r: -r[1])[:top]


FORWARD = "polydraft forward"
"""The profiler's name for a model's forward call (`tensor_ops`)."""
CLOCKED = (
    (CachedLM, "forward"),
    (SelfSpeculative, "draft_step"),
    (SelfSpeculative, "verify"),
    (Eagle3Drafter, "_forward"),
)
"""The calls whose time the engine counts as forward time (`Generation.target_seconds`, `draft_seconds`)."""


def tensor_ops(method, prompts: list) -> tuple[float, list[tuple[str, float]]]:
    """The outermost aten operations `method`'s rounds run outside the models' forward calls (`CLOCKED`),
    decoding `prompts` once under torch's profiler: (operations a round, the most frequent (name, a round))."""
    originals = [getattr(owner, name) for owner, name in CLOCKED]

    def marked(call):
        def run(*args, **kwargs):
            with torch.profiler.record_function(FORWARD):
                return call(*args, **kwargs)

        return run

    for (owner, name), call in zip(CLOCKED, originals, strict=True):
        setattr(owner, name, marked(call))
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            rounds = sum(method.decode(prompt, index).target_calls for index, prompt in enumerate(prompts))
    finally:
        for (owner, name), call in zip(CLOCKED, originals, strict=True):
            setattr(owner, name, call)
    counts: Counter[str] = Counter()
    for event in profile.events():
        if not event.name.startswith("aten::"):
            continue
        parent, outermost = event.cpu_parent, True
        while parent is not None and outermost:  # inside a forward call or inside another aten call
            outermost = parent.name != FORWARD and not parent.name.startswith("aten::")
            parent = parent.cpu_parent
        if outermost:
            counts[event.name] += 1
    return sum(counts.values()) / rounds, [(name, n / rounds) for name, n in counts.most_common(8)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "demo" / "demo")
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "demo" / "demo.yaml"))
    parser.add_argument("--eval-set", default="de-en")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--ops", action="store_true")
    parser.add_argument("--record", type=Path)
    args = parser.parse_args()

    inputs, loaded = load_run(args.recipe, args.run_dir)
    cfg = inputs.measure
    eval_set = next(s for s in loaded.eval_sets if s.name == args.eval_set)

    totals: dict[str, list[dict[str, float]]] = defaultdict(list)
    speedups: dict[str, list[tuple[float, float | None]]] = defaultdict(list)
    last = None
    for repeat in range(args.repeats):
        seed = cfg.seeds[repeat % len(cfg.seeds)]
        prompts = repetition_prompts(eval_set.prompts, cfg.seeds, seed, cfg.num_prompts, cfg.disjoint_prompts)

        def build(seed=seed):
            return [
                m for m in greedy_methods(inputs, loaded, eval_set, seed) if kept(m.fields, eval_set.pair)
            ]

        for method in build():  # warm-up, as measure_group does
            method.decode(prompts[0], -1)
        methods = build()
        for index, prompt in enumerate(prompts):
            shift = index % len(methods)
            for method in methods[shift:] + methods[:shift]:
                method.generations.append(method.decode(prompt, index))
        ar_rate = None
        for method in methods:
            label = method_label(method.fields)
            prefill = {i: prefill_seconds(method.fields, loaded, p) for i, p in enumerate(prompts)}
            row = split(method, prefill)
            totals[label].append(row)
            rate = row["tokens"] / row["wall"]
            if method.fields["decoder"] == "ar":
                ar_rate = rate
            assert ar_rate is not None, "ar is built first"
            t_ar = loaded.latencies.target.chain[1]
            predicted = None
            if method.cost is not None:  # the measure stage's prediction, prompt extras included
                predicted = predicted_speedup(method.generations, t_ar, method.cost, method.prefill, methods[0].prefill)  # fmt: skip
            speedups[label].append((rate / ar_rate, predicted))
        last = (methods, prompts)

    lines = [
        f"## {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%MZ} - `python -m bench.engine_overhead "
        f"--eval-set {args.eval_set} --repeats {args.repeats}{' --profile' if args.profile else ''}"
        f"{' --ops' if args.ops else ''}` "
        f"(commit {git_head()}, {torch.get_num_threads()} threads)",
        "",
        f"The run's target and drafters ({args.run_dir.name}), the `{args.eval_set}` eval set at T=0, "
        f"{cfg.num_prompts} prompts x {cfg.max_new_tokens} new tokens per repeat, the methods rotating per "
        "prompt in one process. Per round, ms (mean ± std over the repeats): the whole round; the forward "
        "passes in the rounds; the prompt's first call of each model; the time between forward calls; the "
        "latency model's cost of the same rounds. Speedups over `ar`: measured, predicted, error.",
        "",
        "| method | round | forward | prefill | between | probe | forward - probe | speedup | predicted | error |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, rows in totals.items():

        def cell(key: str, rows=rows) -> str:
            values = [r[key] for r in rows if r[key] is not None]
            if not values:
                return "-"
            std = statistics.stdev(values) if len(values) > 1 else 0.0
            return f"{statistics.mean(values):.2f} ± {std:.2f}"

        excess = [r["forward_ms"] - r["probe_ms"] for r in rows if r["probe_ms"]]
        measured = [s for s, _ in speedups[label]]
        predicted = [p for _, p in speedups[label] if p]
        err = f"{statistics.mean(measured) / statistics.mean(predicted) - 1:+.1%}" if predicted else "-"
        lines.append(
            f"| {label} | {cell('round_ms')} | {cell('forward_ms')} | {cell('prefill_ms')} | "
            f"{cell('between_ms')} | {cell('probe_ms')} | "
            f"{f'{statistics.mean(excess):+.2f}' if excess else '-'} | {statistics.mean(measured):.2f} | "
            f"{f'{statistics.mean(predicted):.2f}' if predicted else '-'} | {err} |"
        )
    extras = ", ".join(f"{name} {1e3 * f:.2f}" for name, f in loaded.latencies.prefill.items())
    lines += [
        "",
        f"The probe's prompt extras F, ms (`latency.json`'s `prefill`, charged once a generation): {extras}.",
    ]
    if args.profile and last is not None:
        methods, prompts = last
        lines += ["", "### Between the forward calls, by function (cProfile, one more pass, own time)", ""]
        for method in methods:
            profile = cProfile.Profile()
            profile.enable()
            for index, prompt in enumerate(prompts):
                method.decode(prompt, index)
            profile.disable()
            lines.append(f"- {method_label(method.fields)}: " + "; ".join(
                f"`{name}` {own * 1e3:.1f} ms / {calls} calls" for name, own, calls in engine_functions(profile, 6)
            ))  # fmt: skip
    if args.ops and last is not None:
        methods, prompts = last
        lines += ["", "### Tensor operations between the forward calls (torch profiler, one more pass)", ""]
        lines += ["| method | ops a round | the most frequent, a round |", "| --- | ---: | --- |"]
        for method in methods:
            per_round, names = tensor_ops(method, prompts)
            common = ", ".join(f"`{name.removeprefix('aten::')}` {n:.1f}" for name, n in names)
            lines.append(f"| {method_label(method.fields)} | {per_round:.1f} | {common} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.record:
        previous = args.record.read_text() if args.record.is_file() else "# Engine overhead\n\n"
        args.record.write_text(previous.rstrip("\n") + "\n\n" + text)


def git_head() -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()


if __name__ == "__main__":
    main()
