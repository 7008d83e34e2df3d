"""The seeds' headline tables, measured by the `make study-full` variants: seed 001's main result (EESD
against vanilla SD and Medusa, Tables 1-3), each decoder trained with every training seed and all three
measured interleaved in one run per seed, and seed 002's Exp1 at every draft length it reports (2-5,
Fig. 4 and App. Tables 1-8), the best tree per length and decoder. Every check is paired by prompt
(and training seed) and decided by the one rule of `pipelines.study.verdicts`."""

from __future__ import annotations

from polydraft.pipelines.study.arms import PromptMetric, prompt_values
from polydraft.pipelines.study.model import (
    HEADLINE_K,
    LENGTH_TREES,
    TRAIN_SEEDS,
    TREES_LENGTHS,
    Finding,
    Panel,
    Runs,
    Series,
    finish,
    headline_variant,
    rows_of,
    temperatures,
    tree_length,
)
from polydraft.pipelines.study.verdicts import ArmValues, Check, arm_stat, compare

SEED_TABLE_1 = {
    ("Beta-TS", "SD"): 1.57 - 1.28,
    ("Cali-TS", "SD"): 1.59 - 1.28,
    ("Beta-TS", "Medusa"): 1.57 - 1.53,
    ("Cali-TS", "Medusa"): 1.59 - 1.53,
}
"""Seed 001 Table 1 (Vicuna-13B, Gsm8k, greedy; its vanilla SD drafts with Vicuna-68M, the row nearest a
small standalone drafter like the study's): EESD's speedup minus the baseline's."""
TABLE_1_NUMBERS = (
    "Table 1 (speedup on Gsm8k / XSum, greedy): LLaMA-2-13B: Vanilla SD (LLaMA-2-7B) 0.96× / 0.77×, "
    "(TinyLLaMA-1.1B) 1.19× / 1.05×, Self-SD 1.37× / 1.35×, Medusa 1.77× / 1.53×, EESD (+Beta-TS) 1.91× / "
    "1.84×, EESD (+Cali-TS) 2.04× / 1.92×; Vicuna-13B: Vanilla SD (Vicuna-68M) 1.28× / 1.17×, Medusa 1.53× / "
    "1.21×, EESD (+Beta-TS) 1.57× / 1.25×, EESD (+Cali-TS) 1.59× / 1.27×; LLaMA-2-70B: Vanilla SD 1.88×, "
    "Medusa 1.73×, EESD 2.13× / 2.29× (Gsm8k). Tables 2-3 (Humaneval, MT-bench): EESD (+Cali-TS) 2.15× and "
    "2.11× against Medusa 1.61× and 1.89× (LLaMA-2-13B). All 'statistically significant with respect to "
    "all baselines (all p-value < 0.005)'."
)


def _arm(runs: Runs, metric: PromptMetric, **fields: object) -> ArmValues:
    """`metric` per prompt of the rows matching `fields` in each training seed's headline run."""
    return {
        seed: prompt_values(rows_of(runs, headline_variant(seed)), metric, **fields) for seed in TRAIN_SEEDS
    }


def eesd_vs_baselines(runs: Runs) -> Finding:
    names = [headline_variant(s) for s in TRAIN_SEEDS]

    def build() -> tuple[list[Check], str, list[Panel]]:
        checks, lines = [], []
        rows = rows_of(runs, names[0])
        for pair in sorted({r.drafter_pair for r in rows if r.decoder == "sd" and r.drafter_pair}):
            common = {"dataset": pair, "temperature": 0.0}
            arms = {
                "Beta-TS": _arm(runs, "speedup", decoder="eesd", control="beta_ts", **common),
                "Cali-TS": _arm(runs, "speedup", decoder="eesd", control="cali_ts", **common),
                "SD": _arm(
                    runs,
                    "speedup",
                    decoder="sd",
                    control="fixed",
                    draft_length=HEADLINE_K,
                    drafter=pair,
                    **common,
                ),  # fmt: skip
                "Medusa": _arm(runs, "speedup", decoder="medusa", **common),
            }
            for control in ("Beta-TS", "Cali-TS"):
                for base in ("SD", "Medusa"):
                    label = f"{pair}, T=0: EESD ({control}) > {'SD K=' + str(HEADLINE_K) if base == 'SD' else base}"
                    checks.append(compare(label, ">", f"EESD {control}", arms[control], base, arms[base], SEED_TABLE_1[control, base]))  # fmt: skip
            hm = {
                "EESD Beta-TS": _arm(runs, "hm", decoder="eesd", control="beta_ts", **common),
                f"SD K={HEADLINE_K}": _arm(
                    runs, "hm", decoder="sd", control="fixed", draft_length=HEADLINE_K, drafter=pair, **common
                ),  # fmt: skip
            }
            parts = [
                f"{name} {s.text() if (s := arm_stat(v)) else '-'}" for name, v in {**arms, **hm}.items()
            ]
            lines.append(f"- {pair}: speedup per prompt (first four) and HM: " + "; ".join(parts))
        lines.append(
            "- Self-SD (the target with layers skipped, the seeds' third baseline) is no decoder of this "
            "project: not compared."
        )
        return checks, "\n".join(lines), []

    return finish(
        "eesd_headline",
        "EESD (Beta-TS and Cali-TS) > vanilla SD and > Medusa, on the same prompts",
        "seed 001 Tables 1-3",
        "'EESD significantly outperforms the previous methods on both 13B and 70B models' (vanilla SD with a "
        "homologous small drafter at K=10, Self-SD, Medusa with 4 heads trained on the same data; greedy)",
        TABLE_1_NUMBERS,
        f"wall-clock speedup per prompt at T=0 on each pair's eval set, in one measure run per training seed "
        f"({list(TRAIN_SEEDS)}): `eesd` (one exit layer) under Beta-TS and Cali-TS, `sd` at the seed's fixed "
        f"K={HEADLINE_K} with the pair's full-budget P-F drafter, `medusa` with the recipe's heads, every "
        "one of them trained with that seed",
        names,
        runs,
        build,
    )


SEED_TABLE_6_BY_LENGTH = {
    2: {"SD": (1.661, 1.655, 13.331), "RSD-C": (1.853, 1.847, 14.512), "RSD-S": (1.907, 1.900, 14.727)},
    3: {"SD": (1.778, 1.769, 13.620), "RSD-C": (2.021, 2.010, 14.875), "RSD-S": (2.140, 2.129, 15.591)},
    4: {"SD": (1.866, 1.854, 13.698), "RSD-C": (2.132, 2.117, 14.406), "RSD-S": (2.408, 2.392, 15.962)},
    5: {"SD": (1.917, 1.901, 13.430), "RSD-C": (2.246, 2.227, 14.022), "RSD-S": (2.650, 2.628, 15.941)},
}
"""Seed 002 App. Table 6 (Llama 2-70B + 115M, WMT, T=0.3): the best tree per draft length and decoder,
(block efficiency, MBSU, token rate)."""
EXP1_METRICS: dict[PromptMetric, tuple[int, str]] = {
    "block_efficiency": (0, "block efficiency"),
    "mbsu": (1, "MBSU"),
    "token_rate": (2, "token rate"),
}
EXP1_NUMBERS = (
    "App. Table 6 (Llama 2-70B + 115M, WMT, T=0.3; the best tree per L, Eff. / MBSU / token rate): "
    + "; ".join(
        f"L={length}: " + ", ".join(f"{d} {v[0]:.3f} / {v[1]:.3f} / {v[2]:.3f}" for d, v in best.items())
        for length, best in SEED_TABLE_6_BY_LENGTH.items()
    )
    + ". Trees per L from App. C.3.1, e.g. L=5: RSD-C 2-2-2-2-2, 6-1-1-1-1, 12-1-1-1-1; RSD-S 6×5, 12×5."
)


def _best_at(rows: list, pair: str, decoder: str, length: int, metric: PromptMetric) -> tuple[str, ArmValues]:
    """(label, per-prompt values) of the tree (or K) of `decoder` at draft length `length` with the highest
    mean `metric`, the drafter of `pair` on its own pair (the seed's Fig. 4 shows 'the best results across
    all tree structures for each L and algorithm')."""
    found: dict[str, ArmValues] = {}
    for r in rows:
        own = r.decoder == decoder and r.drafter == pair and r.dataset == pair
        if own and tree_length(r.decoder, r.tree, r.draft_length) == length:
            label = r.tree or f"K={r.draft_length}"
            if label not in found:
                fields = {"decoder": decoder, "drafter": pair, "dataset": pair, "tree": r.tree, "draft_length": r.draft_length, "temperature": r.temperature}  # fmt: skip
                found[label] = {0: prompt_values(rows, metric, **fields)}
    means = {label: s.mean for label, v in found.items() if (s := arm_stat(v)) is not None}
    if not means:
        return "-", {}
    label = max(means, key=lambda k: means[k])
    return label, found[label]


def trees_lengths(runs: Runs, pairs: list[str]) -> Finding:
    def build() -> tuple[list[Check], str, list[Panel]]:
        checks, panels = [], []
        for t in [t for t in temperatures(rows_of(runs, TREES_LENGTHS)) if t > 0]:
            rows = [r for r in rows_of(runs, TREES_LENGTHS) if r.temperature == t]
            series = []
            for pair in sorted({r.dataset for r in rows if r.decoder != "ar"}):
                curves: dict[str, list[float]] = {"sd": [], "rsd_c": [], "rsd_s": []}
                for length in sorted(LENGTH_TREES):
                    best = {(d, m): _best_at(rows, pair, d, length, m) for d in curves for m in EXP1_METRICS}
                    seed = SEED_TABLE_6_BY_LENGTH[length]
                    for tree in ("rsd_c", "rsd_s"):
                        name = tree.upper().replace("_", "-")
                        for m, (i, words) in EXP1_METRICS.items():
                            if m == "token_rate" and tree == "rsd_c":
                                continue  # the seed: RSD-C's token rate 'can be lower than that for SD'
                            (la, a), (lb, b) = best[tree, m], best["sd", m]
                            effect = None if m == "token_rate" else seed[name][i] - seed["SD"][i]
                            checks.append(compare(f"{pair}, T={t:g}, L={length}: {words} {name} ({la}) > SD ({lb})", ">", f"{name} {la}", a, f"SD {lb}", b, effect))  # fmt: skip
                    for d in curves:
                        s = arm_stat(best[d, "block_efficiency"][1])
                        curves[d].append(s.mean if s else 0.0)
                series += [
                    Series(label=f"{d} ({pair})", x=[float(x) for x in sorted(LENGTH_TREES)], y=y)
                    for d, y in curves.items()
                ]
            panels.append(Panel(title=f"best tree per draft length, T={t:g}", xlabel="draft length L", ylabel="block efficiency", series=series))  # fmt: skip
        return checks, "", panels

    return finish(
        "trees_lengths",
        "at every draft length 2-5, trees beat SD in block efficiency and MBSU, and RSD-S beats SD in token "
        "rate too",
        "seed 002 Exp1: Fig. 4, App. C.3.1 and Tables 1-8",
        "'tree-based methods (SpecTr, RSD-C and RSD-S) always outperform SD in terms of block efficiency and "
        "MBSU, whereas token rates for SpecTr and RSD-C can be lower than that for SD … RSD-S strictly "
        "outperforms both SD and SpecTr for all performance metrics' (draft lengths 2-5; XSum and WMT, "
        "T=0.3)",
        EXP1_NUMBERS,
        f"block efficiency, MBSU and token rate per prompt at each draft length L in {sorted(LENGTH_TREES)}: "
        "SD K=L against the best of seed 002's RSD-C and RSD-S trees for that L (chosen after measuring, as "
        "the seed's Fig. 4 does), T=0.3, each pair's P-F drafter (training seed 0) on its own pair; RSD-C's "
        "token rate is not claimed. The single-length finding at L=3 with the seed's Table 6 trees is `trees`",
        [TREES_LENGTHS],
        runs,
        build,
        quantity="block efficiency / MBSU / token rate",
    )
