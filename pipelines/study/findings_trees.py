"""Seed 002's tree findings (Exp1 at a fixed draft length, Exp2 at fixed target budgets, with block
efficiency, MBSU and token rate) and seed 000's local rescoring at T = 0, 0.7 and 1 with speedups. These
compare decoders on one trained drafter (training seed 0)."""

from __future__ import annotations

from polydraft.pipelines.study.model import (
    BUDGET_TREES,
    HEADS,
    RSD_BUDGET,
    TREE_DEPTH,
    TREES,
    Finding,
    Panel,
    Runs,
    Series,
    finish,
    rows_of,
    temperatures,
    tree_budget,
    where,
)
from polydraft.pipelines.study.verdicts import Check, compare, stat

METRICS = {"block_efficiency": "block efficiency", "mbsu": "MBSU", "token_rate": "token rate"}


def _own(rows: list, pair: str, t: float, metric: str, **fields: object) -> list:
    return where(rows, metric, drafter=pair, dataset=pair, temperature=t, **fields)


def trees(runs: Runs, pairs: list[str]) -> Finding:
    def build() -> tuple[list[Check], str, list[Panel]]:
        rows, checks = rows_of(runs, TREES), []
        for pair in pairs:
            for t in [t for t in temperatures(rows) if t > 0]:
                s = {m: _own(rows, pair, t, m, decoder="rsd_s") for m in METRICS}
                c = {m: _own(rows, pair, t, m, decoder="rsd_c") for m in METRICS}
                sd = {m: _own(rows, pair, t, m, decoder="sd", control="fixed", draft_length=TREE_DEPTH) for m in METRICS}  # fmt: skip
                label = f"{pair}, T={t:g}"
                for m in ("block_efficiency", "mbsu"):
                    checks.append(compare(f"{label}: {METRICS[m]} RSD-S 3x3 > RSD-C 2-2-2", ">", "RSD-S", s[m], "RSD-C", c[m]))  # fmt: skip
                    checks.append(compare(f"{label}: {METRICS[m]} RSD-C 2-2-2 > SD K=3", ">", "RSD-C", c[m], "SD", sd[m]))  # fmt: skip
                for m in METRICS:
                    checks.append(compare(f"{label}: {METRICS[m]} RSD-S 3x3 > SD K=3", ">", "RSD-S", s[m], "SD", sd[m]))  # fmt: skip
        return checks, "", []

    return finish(
        "trees",
        "at a fixed draft length, trees beat SD in block efficiency and MBSU, and RSD-S beats SD in all metrics",
        "seed 002 Exp1: Fig. 4 and App. Table 6",
        "'tree-based methods always outperform SD in terms of block efficiency and MBSU … RSD-S strictly "
        "outperforms both SD and SpecTr for all performance metrics' (WMT, T=0.3, draft lengths 2-5)",
        "App. Table 6 (Llama 2-70B + 115M, WMT, T=0.3, draft length 3; Eff. / MBSU / token rate): SD K=3 "
        "1.778 / 1.769 / 13.620, RSD-C 2-2-2 2.021 / 2.010 / 14.875, RSD-S 3×3 2.068 / 2.057 / 15.132.",
        f"block efficiency, MBSU and token rate at draft length {TREE_DEPTH} (SD K=3, RSD-C 2-2-2, RSD-S 3x3) "
        "at T > 0, each P-F drafter (training seed 0) on its own pair",
        [TREES],
        runs,
        build,
        quantity="block efficiency / MBSU / token rate",
    )


def _best(rows: list, pair: str, decoder: str, budget: int, metric: str) -> tuple[str, list]:
    """The tree (or K) of `decoder` at target budget `budget` with the highest mean `metric` (the seed
    shows 'the best results across all tree structures for each B and algorithm')."""
    found: dict[str, list] = {}
    for r in rows:
        if (
            r.decoder == decoder
            and r.dataset == pair
            and tree_budget(r.decoder, r.tree, r.draft_length) == budget
        ):
            found.setdefault(r.tree or f"K={r.draft_length}", []).append(getattr(r, metric))
    means = {label: s.mean for label, v in found.items() if (s := stat(v)) is not None}
    if not means:
        return "-", []
    label = max(means, key=lambda k: means[k])
    return label, found[label]


def _side(best: dict, decoder: str, metric: str) -> tuple[str, list]:
    """(label, values) of a decoder's best tree at one budget, for `compare`."""
    label, values = best[decoder, metric]
    return f"{decoder.upper().replace('_', '-')} {label}", values


def rsd_budget(runs: Runs, pairs: list[str]) -> Finding:
    budgets = sorted(BUDGET_TREES)
    low, high = budgets[:2], budgets[-2:]

    def build() -> tuple[list[Check], str, list[Panel]]:
        rows = [r for r in rows_of(runs, RSD_BUDGET) if r.temperature > 0]
        checks, series = [], []
        for pair in sorted({r.dataset for r in rows if r.decoder != "ar"}):
            for b in budgets:
                best = {(d, m): _best(rows, pair, d, b, m) for d in ("sd", "rsd_c", "rsd_s") for m in METRICS}

                if b in low:
                    checks.append(compare(f"{pair}, B={b}: block efficiency SD > RSD-C", ">", *_side(best, "sd", "block_efficiency"), *_side(best, "rsd_c", "block_efficiency")))  # fmt: skip
                if b in high:
                    for m in ("block_efficiency", "mbsu"):
                        checks.append(compare(f"{pair}, B={b}: {METRICS[m]} RSD-S > SD", ">", *_side(best, "rsd_s", m), *_side(best, "sd", m)))  # fmt: skip
                checks.append(compare(f"{pair}, B={b}: token rate RSD-S > SD", ">", *_side(best, "rsd_s", "token_rate"), *_side(best, "sd", "token_rate")))  # fmt: skip
            for d in ("sd", "rsd_c", "rsd_s"):
                means = [stat(_best(rows, pair, d, b, "block_efficiency")[1]) for b in budgets]
                series.append(Series(label=f"{d} ({pair})", x=[float(b) for b in budgets],
                                     y=[m.mean if m else 0.0 for m in means], yerr=[m.std if m else 0.0 for m in means]))  # fmt: skip
        panel = Panel(title="best tree per target budget (T>0)", xlabel="target budget B", ylabel="block efficiency", series=series)  # fmt: skip
        return checks, "", [panel]

    return finish(
        "rsd_budget",
        "at fixed target budgets, SD beats RSD-C at low budgets, RSD-S beats SD at high budgets and in token rate",
        "seed 002 Exp2: §5.2, Fig. 5 and App. C.3.2",
        "'SD beats RSD-C in the relatively low budget regime, e.g. {6, 10}' for well-aligned drafters (SD "
        "block efficiency close to 3.0); 'in the high budget regime RSD-S beats SD for both block efficiency "
        "and MBSU'; 'in terms of token rate, RSD-S strictly outperforms our baselines' (WMT/XSum T=0.3)",
        f"Fig. 5 (Llama 2-70B and Llama 2-Chat-70B, budgets B in {budgets}, the best tree per B and method; "
        "a figure). Trees per B from App. C.3.2, e.g. B=6: RSD-C 2-1-1, 2-2, 3-1; RSD-S 2×3, 3×2; SD K=B.",
        f"block efficiency, MBSU and token rate of SD K=B and the seed's trees per budget B in {budgets} "
        f"(the best tree per B and method, chosen after measuring as the seed does), T=0.3, on {pairs[0]} "
        f"(seed 002's WMT De-En), the P-F drafter of training seed 0; low budgets {low}, high {high}",
        [RSD_BUDGET],
        runs,
        build,
        quantity="block efficiency / MBSU / token rate",
    )


def rescoring(runs: Runs) -> Finding:
    def build() -> tuple[list[Check], str, list[Panel]]:
        rows = rows_of(runs, HEADS)
        checks = []
        for pair in sorted({r.rescorer for r in rows if r.rescorer is not None}):
            for t in temperatures(rows):
                for heads in ("bpd", "medusa"):
                    for metric in ("block_efficiency", "speedup"):
                        common = {"dataset": pair, "temperature": t}
                        alone = where(rows, metric, decoder=heads, **common)
                        rescored = where(rows, metric, decoder=f"{heads}+rescore", rescorer=pair, **common)
                        label = f"{pair}, T={t:g}: {metric.replace('_', ' ')} {heads} + rescoring > {heads}"
                        checks.append(compare(label, ">", "rescored", rescored, "heads alone", alone))
        return checks, "", []

    return finish(
        "rescoring",
        "local rescoring by a small drafter beats the heads alone, for BPD and Medusa, at T = 0, 0.7 and 1",
        "seed 000 Tables A-D",
        "every dataset and temperature improves with rescoring, in block efficiency and in speedup (Vicuna "
        "7B/13B + a 68M rescorer, T = 0, 0.7, 1)",
        "Table A (Vicuna 7B, block efficiency, MT-bench): BPD 1.768 → 2.073 (T=0), 1.879 → 2.289 (T=0.7), "
        "1.918 → 2.410 (T=1); Medusa 2.639 → 2.864, 2.738 → 3.040, 2.793 → 3.104. Table B (speedup, A100): "
        "BPD 1.752 → 1.843, 1.781 → 1.903, 1.858 → 1.998; Medusa 2.254 → 2.482, 2.425 → 2.597, 2.511 → 2.657.",
        "block efficiency and wall-clock speedup of `bpd` / `medusa` vs their `+rescore` variants (the eval "
        "set's own P-F drafter, training seed 0, rescores) at T = 0, 0.7 and 1",
        [HEADS],
        runs,
        build,
        quantity="block efficiency / speedup",
    )
