"""Seed 003's findings on standalone drafters (pretrain-then-finetune, in domain, the token curve), and the
study item on distillation temperatures (no seed claim). Every compared drafter is trained with each
training seed and measured in one interleaved measure run; each check paired by training seed and prompt."""

from __future__ import annotations

from polydraft.pipelines.study.arms import prompt_values
from polydraft.pipelines.study.fits import PromptPoints, ShapeFits, held_out_errors, shape_fits
from polydraft.pipelines.study.model import (
    COMPARE,
    DOMAIN_IO,
    F_BUDGETS,
    IO_DRAFTER,
    IO_PAIRS,
    PF_BUDGETS,
    TEMPS_COMPARE,
    TRAIN_SEEDS,
    Finding,
    Panel,
    Runs,
    Series,
    budgets_variant,
    drafter_name,
    finish,
    pf_variant,
    pooled,
    rows_of,
)
from polydraft.pipelines.study.verdicts import ArmValues, Check, compare, stat

TABLE_3 = (
    "Table 3 (WMT19 Zh→En, speedup): Gemma-7B-it + Gemma 250M: P 0.92 ± 0.01, P+F 1.04 ± 0.02; "
    "Llama2-chat 7B + Llama 68M: P 1.47 ± 0.00, P+F 1.95 ± 0.01. Table 1 (Vicuna 7B, P-F, speedup): T=0 "
    "De→En 2.42 ± 0.02, Fr→En 2.05 ± 0.04; T=1 De→En 1.99 ± 0.01, Fr→En 1.86 ± 0.03."
)


def _names(kind: str, fraction: float | None, pair: str | None) -> list[str]:
    return [drafter_name(kind, seed, fraction, pair) for seed in TRAIN_SEEDS]


def _sd(rows: list, names: list[str], dataset: str, t: float, k: int) -> ArmValues:
    """The speedup per prompt of `sd` at fixed K=k with each training seed's drafter of `names`."""
    return pooled(
        rows, names, "speedup", decoder="sd", control="fixed", draft_length=k, dataset=dataset, temperature=t
    )


SEED_PF_OVER_P = 1.95 - 1.47
"""Seed 003 Table 3, Llama2-chat 7B + Llama 68M, greedy: P+F 1.95 against P 1.47 (Gemma 250M: +0.12)."""


def pf_over_p(runs: Runs, k: int, pairs: list[str]) -> Finding:
    def build() -> tuple[list[Check], str, list[Panel]]:
        rows, checks = rows_of(runs, COMPARE), []
        for pair in pairs:
            for t in (0.0, 1.0):
                a = _sd(rows, _names("pf", 1.0, pair), pair, t, k)
                b = _sd(rows, _names("p", None, None), pair, t, k)
                effect = SEED_PF_OVER_P if t == 0 else None
                checks.append(
                    compare(f"{pair}, T={t:g}, full finetune: P-F > P", ">", "P-F", a, "P", b, effect)
                )
        return checks, "", []

    return finish(
        "pf_over_p",
        "pretrain-then-finetune (P-F) > pretrain only (P), at the full finetune",
        "seed 003 Table 3 (and Table 1)",
        "finetuning the pretrained drafter on the language pair raises its speedup: P 1.47 → P+F 1.95 "
        "(Llama 68M), 0.92 → 1.04 (Gemma 250M), greedy",
        TABLE_3,
        f"wall-clock speedup of `sd` (fixed K={k}) per prompt on the drafter's own pair, the full finetune "
        f"(the seed's budget), T=0 (the seed's greedy) and T=1 (Table 1); every drafter trained with seeds "
        f"{list(TRAIN_SEEDS)}, one interleaved measure run. The smaller budgets are the study item "
        "`pf_over_p_budgets`",
        [COMPARE],
        runs,
        build,
    )


def pf_over_p_budgets(runs: Runs, k: int, pairs: list[str]) -> Finding:
    smaller = [f for f in PF_BUDGETS if f < 1.0]

    def build() -> tuple[list[Check], str, list[Panel]]:
        checks = []
        for pair in pairs:
            rows = rows_of(runs, budgets_variant(pair))
            for fraction in smaller:
                a = _sd(rows, _names("pf", fraction, pair), pair, 0.0, k)
                b = _sd(rows, _names("p", None, None), pair, 0.0, k)
                checks.append(compare(f"{pair}, T=0, finetune x{fraction:g}: P-F > P", ">", "P-F", a, "P", b))
        return checks, "", []

    return finish(
        "pf_over_p_budgets",
        "P-F > P at smaller finetune budgets than the recipe's",
        "no seed claim (seed 003 Table 3 compares P and P+F at its full finetune only)",
        "the budget sweep of `pf_over_p`: whether a shorter finetune already beats the pretrained drafter",
        "Table 3 reports P and P+F at one finetune; Fig. 4 plots P-F against tokens without P.",
        f"wall-clock speedup of `sd` (fixed K={k}, T=0) per prompt on the drafter's own pair at "
        f"{', '.join(f'x{f:g}' for f in smaller)} of the recipe's finetune; seeds {list(TRAIN_SEEDS)}, one "
        "measure run per pair",
        [budgets_variant(p) for p in pairs],
        runs,
        build,
        seed_claim=False,
    )


def pf_over_f(runs: Runs, k: int, pairs: list[str]) -> Finding:
    def build() -> tuple[list[Check], str, list[Panel]]:
        checks = []
        for pair in pairs:
            rows = rows_of(runs, budgets_variant(pair))
            for fraction in F_BUDGETS:
                a = _sd(rows, _names("pf", fraction, pair), pair, 0.0, k)
                b = _sd(rows, _names("f", fraction, pair), pair, 0.0, k)
                checks.append(compare(f"{pair}, T=0, finetune x{fraction:g}: P-F > F", ">", "P-F", a, "F", b))
            full = rows_of(runs, COMPARE)
            for dataset in pairs:
                for t in (0.0, 1.0) if dataset != pair else (1.0,):
                    a = _sd(full, _names("pf", 1.0, pair), dataset, t, k)
                    b = _sd(full, _names("f", 1.0, pair), dataset, t, k)
                    where = "in domain" if dataset == pair else f"out of domain, on {dataset}"
                    checks.append(compare(f"{pair} drafters {where}, T={t:g}, full finetune: P-F > F", ">", "P-F", a, "F", b))  # fmt: skip
        return checks, "", []

    return finish(
        "pf_over_f",
        "pretrain-then-finetune (P-F) > finetune only (F), at the same finetune budgets and out of domain",
        "seed 003 Fig. 4",
        "'Our P-F approach outperforms models that are only finetuned (F)' along the finetune token axis "
        "(WMT16 De-En, greedy)",
        "Fig. 4 (WMT16 De-En, speedup with greedy sampling against finetune tokens, log axis): the P-F curve "
        "above F at every token count, the gap largest at the fewest tokens (a figure; the text gives no F "
        "numbers). Out of domain the seed measures P-F only (Fig. 5); the F comparison there is ours.",
        f"wall-clock speedup of `sd` (fixed K={k}): P-F and F at the same budgets "
        f"({', '.join(f'x{f:g}' for f in F_BUDGETS)}) greedy on their own pair, and at the full budget at "
        f"T=1 and on the other pairs; seeds {list(TRAIN_SEEDS)}, one measure run per comparison",
        [COMPARE, *(budgets_variant(p) for p in pairs)],
        runs,
        build,
    )


def in_domain(runs: Runs, k: int, pairs: list[str]) -> Finding:
    def build() -> tuple[list[Check], str, list[Panel]]:
        rows = rows_of(runs, COMPARE)
        checks = []
        for pair in pairs:
            names = _names("pf", 1.0, pair)
            for other in [d for d in pairs if d != pair]:
                for t in (0.0, 1.0):
                    label = f"drafter {pair}, T={t:g}: on {pair} > on {other}"
                    inside, outside = _sd(rows, names, pair, t, k), _sd(rows, names, other, t, k)
                    checks.append(compare(label, ">", "in-domain", inside, "out-of-domain", outside))
        return checks, "", []

    return finish(
        "in_domain",
        "a language drafter is faster on its own language pair (in domain) than on another (out of domain)",
        "seed 003 Fig. 5 and Fig. 8",
        "the De-En drafter gives 'the highest speedups' on German-input pairs and limited gains elsewhere",
        "Fig. 5: the drafter trained on WMT16 De-En gives its highest speedups on German-input pairs and "
        "limited gains on pairs with other input languages; Fig. 8: the same for Ru-En, Ja-En, Zh-En "
        "drafters (figures; the text gives no numbers).",
        f"wall-clock speedup of `sd` (fixed K={k}) of the full-budget P-F drafters (seeds {list(TRAIN_SEEDS)}) "
        "on their own pair vs each other pair's eval set, T=0 and T=1",
        [COMPARE],
        runs,
        build,
    )


def input_domain(runs: Runs, k: int) -> Finding:
    names = _names("pf", 1.0, IO_DRAFTER)

    def build() -> tuple[list[Check], str, list[Panel]]:
        rows, checks = rows_of(runs, DOMAIN_IO), []
        on = {pair: _sd(rows, names, pair, 0.0, k) for pair in [IO_DRAFTER, *IO_PAIRS]}
        shared = [p for p, what in IO_PAIRS.items() if what == "input"]
        for inside in shared:
            for other in [p for p, what in IO_PAIRS.items() if what != "input"]:
                label = f"drafter {IO_DRAFTER}, T=0: on {inside} (input shared) > on {other} ({IO_PAIRS[other]} shared)"
                checks.append(compare(label, ">", inside, on[inside], other, on[other]))
        means = [f"{p} {s.text() if (s := stat([v for by in on[p].values() for v in by.values()])) else '-'}" for p in on]  # fmt: skip
        return checks, f"- speedup of the {IO_DRAFTER} drafters per eval set: " + "; ".join(means), []

    return finish(
        "input_domain",
        "a language drafter's speedup follows its input language more than its output language",
        "seed 003 Fig. 5 and §5",
        "'Speedups are consistently higher when translating from German to other languages … translations "
        "involving non-German languages with English and English-German pairings show limited gains … "
        "effective speculation relies more on matching the translation task's input domain with the "
        "training data than on the output domain' (the WMT16 De-En drafter, greedy)",
        "Fig. 5 (Vicuna 7B, the De-En P-F and F drafters on De→X, X→En and En→De pairs): highest speedups on "
        "German-input pairs, limited gains elsewhere (a figure; the text gives no numbers).",
        f"wall-clock speedup per prompt of `sd` (fixed K={k}) with the full-budget {IO_DRAFTER} P-F drafters "
        f"(seeds {list(TRAIN_SEEDS)}) at T=0 on De-Fr (its input language, another output), Fr-En (its "
        "output language, another input) and En-De (neither: German answers), one measure run; the eval "
        "sets differ, so each difference pairs independent prompts by position",
        [DOMAIN_IO],
        runs,
        build,
    )


def finetune_tokens(runs: Runs, k: int, pairs: list[str]) -> Finding:
    names = [pf_variant(s, f) for s in TRAIN_SEEDS for f in PF_BUDGETS]

    def build() -> tuple[list[Check], str, list[Panel]]:
        checks, lines, series = [], [], []
        for pair in pairs:
            points = _token_points(runs, rows_of(runs, budgets_variant(pair)), pair, k)
            xs = [x for by_prompt in points.values() for ps in by_prompt.values() for x, _ in ps]
            ys = [y for by_prompt in points.values() for ps in by_prompt.values() for _, y in ps]
            linear, log = held_out_errors(points)
            checks.append(compare(
                f"{pair}: a log curve predicts held-out prompts better than a line (squared error, line > log)",
                ">", "line", linear, "log curve", log,
            ))  # fmt: skip
            fits = shape_fits(xs, ys)
            lines += _fit_lines(pair, fits)
            series.append(Series(label=f"{pair} (per prompt)", x=xs, y=ys, style="points"))
            if fits is not None:
                grid = [min(xs) * (max(xs) / min(xs)) ** (i / 20) for i in range(21)]
                series.append(Series(label=f"{pair} log fit", x=grid, y=[fits.log.predict(x) for x in grid]))
                series.append(Series(label=f"{pair} linear fit", x=grid, y=[fits.linear.predict(x) for x in grid]))  # fmt: skip
        panel = Panel(
            title="speedup vs finetune tokens (T=0)", xlabel="finetune tokens (log scale)",
            ylabel=f"speedup of sd K={k}", log_x=True, series=series,
        )  # fmt: skip
        return checks, "\n".join(lines), [panel]

    return finish(
        "finetune_tokens",
        "the speedup's curve against finetune tokens is logarithmic: a log curve fits it better than a line",
        "seed 003 Fig. 4 and §6",
        "'This gain grows logarithmically with the increase in the number of training tokens' (P-F, WMT16 "
        "De-En, greedy)",
        "Fig. 4 (WMT16 De-En, greedy): the P-F drafter's speedup rises along a logarithmic token axis and "
        "passes the 1.12 of Yang et al.'s drafter (a figure; the text gives no other numbers).",
        f"the shape of the wall-clock speedup of `sd` (fixed K={k}, T=0) per prompt against the finetune "
        f"tokens of the P-F drafters at {len(PF_BUDGETS)} budgets (x{', x'.join(f'{f:g}' for f in PF_BUDGETS)}; "
        f"separate trainings, seeds {list(TRAIN_SEEDS)}) on their own pair: a + b log10(tokens) against "
        "a + b tokens, compared by each one's squared error on the prompt left out of its fit (leave one "
        "prompt out), paired per prompt: holds when the log curve predicts better, contradicted when the "
        "line does. Both fits (R², AIC) are listed",
        [*names, *(budgets_variant(p) for p in pairs)],
        runs,
        build,
    )


def _token_points(runs: Runs, rows: list, pair: str, k: int) -> PromptPoints:
    """Training seed -> prompt -> (finetune tokens, speedup) at each budget the prompt was measured at."""
    points: PromptPoints = {}
    for seed in TRAIN_SEEDS:
        for fraction in PF_BUDGETS:
            tokens = runs[pf_variant(seed, fraction)].finetune_tokens.get(pair)
            if not tokens:
                continue
            speedups = prompt_values(
                rows, "speedup", drafter=drafter_name("pf", seed, fraction, pair), decoder="sd",
                control="fixed", draft_length=k, dataset=pair, temperature=0.0,
            )  # fmt: skip
            for prompt, speedup in speedups.items():
                points.setdefault(seed, {}).setdefault(prompt, []).append((float(tokens), speedup))
    return points


def _fit_lines(pair: str, fits: ShapeFits | None) -> list[str]:
    if fits is None:
        return [f"- {pair}: too few points to fit"]
    return [
        f"- {pair}, log fit: {fits.log.text()}; {fits.n} points ({fits.budgets} budgets x seeds x prompts)",
        f"- {pair}, linear fit: {fits.linear.text()}",
    ]


def distill_temperatures(runs: Runs, k: int, pairs: list[str]) -> Finding:
    def build() -> tuple[list[Check], str, list[Panel]]:
        rows = rows_of(runs, TEMPS_COMPARE)
        checks = []
        for pair in pairs:
            for t in (0.0, 1.0):
                a = _sd(rows, _names("t4", None, pair), pair, t, k)
                b = _sd(rows, _names("t0", None, pair), pair, t, k)
                checks.append(
                    compare(f"{pair}, T={t:g}: four temperatures > T=0 only", ">", "4 T", a, "T=0", b)
                )
        counts = [stat([float(v) for v in runs[n].finetune_tokens.values()]) for n in ("temps4_s0", "temps0_s0") if n in runs]  # fmt: skip
        details = "Finetune tokens per pair (seed 0): " + ", ".join(c.text() if c else "-" for c in counts)
        return checks, details, []

    return finish(
        "distill_temperatures",
        "drafters finetuned on distillations at four temperatures beat those finetuned on T=0 only",
        "no seed claim (seed 003 §2.3 uses four temperatures as a design choice)",
        "seed 003 generates responses at {0.0, 0.3, 0.7, 1.0} 'to capture the full range "
        "of the target's output variability' and reports no comparison",
        "§2.3: responses are generated at temperatures {0.0, 0.3, 0.7, 1.0}; no table compares them.",
        f"wall-clock speedup of `sd` (fixed K={k}) on the drafter's own pair at T=0 and T=1: P-F drafters "
        "finetuned on the four temperatures (a quarter of the prompts, so as many distilled rows) against T=0 "
        f"only (all the prompts), each a quarter of the recipe's finetune, seeds {list(TRAIN_SEEDS)}, one "
        "measure run",
        [TEMPS_COMPARE],
        runs,
        build,
        seed_claim=False,
    )
