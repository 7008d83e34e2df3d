"""Thompson-sampling hyper-parameters the seed leaves to the user, swept: Beta-TS's prior (alpha_0, beta_0)
and Cali-TS's sigma_M, sigma_S and theta_hat_0 (seed 001 §3.3, App. A-B name them, give no values).

Trains nothing: reads a finished run of a recipe with the early_exit and calibrate stages (the demo): the
target, `early_exit/head` and `calibrate/early_exit` (trained on every draft step up to
`measure.max_draft_length`, checked). In ONE process, at temperature 0, `eesd` with fixed K, Beta-TS at
each prior and Cali-TS at each (sigma_M, sigma_S, theta_hat_0) decodes each eval set's held-out prompts in
`--repetitions` disjoint subsets starting at `--offset` (default 24: after the 3 x 8 prompts the demo's
measure stage decodes, so that nothing is chosen on the prompts it reports). The score is the latency
model's predicted speedup (`decoding.measurement.latency`: each round costs the measured t_T(k+1) plus k
early-exit draft steps, the drafts a round sent in vain included), not wall time, which the shared CPU
makes noisy; block efficiency and the mean verified draft length are printed beside it. Every output is
checked against `ar`'s. A synthetic part first shows what the counting of failures does: Beta-TS on
rounds whose tokens are each accepted with probability 0.8, counted as `decoding.control` counts them
(one failure per rejection) and as Alg. 2 lines 18-19 read literally (r = A, n = min(A + 2, K)).

    python -m bench.ts_sweep --run-dir runs/demo/demo [--recipe recipes/demo/demo.yaml] [--prompts 8] \
        [--repetitions 3] [--offset 24] [--record bench/results/ts_sweep.md] [key.path=value ...]
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.held_out import load_held_out, mean_std, record  # noqa: E402
from polydraft.decoding.control import BetaTS, CaliTS, FixedK  # noqa: E402
from polydraft.decoding.eesd import SelfSpeculative, self_speculative  # noqa: E402
from polydraft.decoding.engine import autoregressive  # noqa: E402
from polydraft.decoding.lm import CachedLM  # noqa: E402
from polydraft.decoding.measurement.latency import (  # noqa: E402
    chain_cost,
    predicted_speedup,
    self_speculative_latencies,
)
from polydraft.decoding.measurement.metrics import summarize  # noqa: E402
from polydraft.decoding.sampling import Sampling  # noqa: E402

PRIORS = [(1.0, 1.0), (2.0, 1.0), (4.0, 1.0), (1.0, 2.0)]
SIGMA_M = [0.1, 0.3]
SIGMA_S = [0.1, 0.3, 0.5]
THETA0 = [0.5, 0.8]


def synthetic(cap: int, acceptance: float, rounds: int = 4000) -> list[str]:
    """Mean drafts per round of Beta-TS(1, 1) when each draft is accepted with probability `acceptance`."""
    lines = []
    for label, literal in (
        ("one failure per rejection (decoding.control)", False),
        ("r = A, n = min(A+2, K)", True),
    ):
        control, rng, drafted = BetaTS(1.0, 1.0, cap, 0), random.Random(1), []
        for _ in range(rounds):
            k = 1
            while k < cap and control.keep_drafting(k, torch.zeros(1)):
                k += 1
            accepted = next((i for i in range(k) if rng.random() >= acceptance), k)
            drafted.append(k)
            if literal:
                control.alpha += accepted
                control.beta += min(accepted + 2, k) - accepted
            else:
                control.update(k, accepted)
        late = drafted[rounds // 2 :]
        posterior = control.alpha / (control.alpha + control.beta)
        lines.append(f"| {label} | {statistics.mean(late):.2f} | {posterior:.3f} |")
    return lines


def controls(cap: int, fixed: list[int], predict, seed: int) -> list[tuple[str, str, object]]:
    """(family, setting, controller) of every swept configuration."""
    out: list[tuple[str, str, object]] = [("fixed", f"K={k}", FixedK(k)) for k in fixed]
    out += [("beta_ts", f"prior ({a:g}, {b:g})", BetaTS(a, b, cap, seed)) for a, b in PRIORS]
    for sm, ss, t0 in itertools.product(SIGMA_M, SIGMA_S, THETA0):
        out.append(("cali_ts", f"sM={sm:g} sS={ss:g} t0={t0:g}", CaliTS(sm, ss, t0, predict, cap, seed)))
    return out


def measure(args: argparse.Namespace) -> list[str]:
    """Decode and return the result table's lines."""
    from polydraft.models.calibration import CalibrationModel, check_covers
    from polydraft.models.early_exit import attach_exit_head

    count = args.offset + args.prompts * args.repetitions
    held = load_held_out(args.recipe, args.overrides, count)
    target, eos_ids, eval_sets = held.target, held.eos_ids, held.eval_sets
    cap = held.recipe.measure.max_draft_length
    calibration = args.run_dir / "calibrate" / "early_exit"
    check_covers(calibration, cap)
    predict = CalibrationModel.load(calibration).predict
    model = SelfSpeculative(target, attach_exit_head(target, args.run_dir / "early_exit" / "head"), False)
    target_lm = CachedLM(target, False)
    context = eval_sets[0].prompts[0].view(1, -1)
    rounds = self_speculative_latencies(model, context, cap, args.latency_repeats)
    cost, target_step = chain_cost(rounds), rounds.verify[1]
    greedy, new = Sampling(0.0), args.max_new_tokens
    scores: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for eval_set in eval_sets:
        if len(eval_set.prompts) < count:
            raise SystemExit(f"{eval_set.name}: {len(eval_set.prompts)} prompts, {count} needed")
        for rep in range(args.repetitions):
            start = args.offset + rep * args.prompts
            prompts = eval_set.prompts[start : start + args.prompts]
            reference = [
                autoregressive(target_lm, p, new, greedy, torch.Generator(), eos_ids).tokens for p in prompts
            ]
            for family, setting, control in controls(cap, args.fixed, predict, rep):
                gens = [
                    self_speculative(model, p, new, greedy, control, torch.Generator(), eos_ids)
                    for p in prompts
                ]
                if [g.tokens for g in gens] != reference:
                    raise SystemExit(f"{family} {setting} on {eval_set.name}: output differs from ar's")
                verified = [r.draft_length for g in gens for r in g.rounds if r.drafted]
                scores.setdefault((family, setting), []).append(
                    (
                        predicted_speedup(gens, target_step, cost) or 0.0,
                        summarize(gens, None)["block_efficiency"] or 0.0,
                        statistics.mean(verified),
                    )
                )
    lines = [
        f"eesd, cap {cap} drafts a round; latency model: t_T(1) = {target_step * 1e3:.2f} ms, "
        f"early-exit step {rounds.draft[0] * 1e3:.2f} ms",
        "",
        "| control | setting | predicted speedup | block efficiency | verified drafts / round |",
        "| --- | --- | --- | --- | --- |",
    ]
    for (family, setting), values in scores.items():
        cells = [mean_std([v[i] for v in values], 3) for i in range(3)]
        lines.append(f"| {family} | {setting} | {' | '.join(cells)} |")
    lines.append("")
    for family in ("beta_ts", "cali_ts"):
        best = max(
            (key for key in scores if key[0] == family),
            key=lambda key: statistics.mean(v[0] for v in scores[key]),
        )
        lines.append(f"Best {family}: {best[1]} ({statistics.mean(v[0] for v in scores[best]):.3f}).")
    lines.append(
        f"Cells mean ± std over {len(eval_sets)} eval sets x {args.repetitions} repetitions. Every output equals ar's."
    )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("overrides", nargs="*", metavar="key.path=value", help="recipe overrides")
    parser.add_argument("--recipe", default="recipes/demo/demo.yaml")
    parser.add_argument(
        "--run-dir", type=Path, required=True, help="a finished run with early_exit and calibrate"
    )
    parser.add_argument("--fixed", type=int, nargs="+", default=[1, 2, 3, 4], help="fixed K shown beside")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per eval set and repetition")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--offset", type=int, default=24, help="first prompt of the shuffled eval set")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--latency-repeats", type=int, default=20)
    parser.add_argument("--record", type=Path, help="append the command and tables to this markdown file")
    args = parser.parse_args()
    started = time.perf_counter()
    torch.manual_seed(0)
    lines = [
        "Synthetic: Beta-TS(1, 1), cap 10, each draft accepted with probability 0.8, 4000 rounds (mean over "
        "the last 2000)",
        "",
        "| failures counted | drafts / round | posterior mean |",
        "| --- | --- | --- |",
        *synthetic(10, 0.8),
        "",
        *measure(args),
    ]
    setting = (
        f"T=0, {args.prompts} held-out prompts x {args.repetitions} disjoint repetitions per eval set "
        f"(prompts {args.offset} to {args.offset + args.prompts * args.repetitions - 1} of each shuffled set, "
        f"none of the demo's measured ones), up to {args.max_new_tokens} new tokens "
        f"({time.perf_counter() - started:.0f} s in all)."
    )
    record("ts_sweep", setting, lines, args.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
