"""What the findings are made of: the variants' names and data, the typed finding, and the helpers that
select rows (`decoding.measurement.results.ResultRow`) by every field that defines them, never by a label."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict

from polydraft.decoding.measurement.results import ResultRow
from polydraft.pipelines.study.arms import PromptMetric, prompt_values
from polydraft.pipelines.study.verdicts import (
    ArmValues,
    Check,
    SanityVerdict,
    Verdict,
    sanity_verdict,
    verdict_of,
)

# variant names and settings (the variants themselves are built in `pipelines.study.variants`)
TRAIN_SEEDS = (0, 1)
"""Training seeds of every compared trained drafter, added to the recipe's `loop.seed` of each stage that
trains it: each check pairs its arms by training seed and prompt, so training variance enters its interval."""
PF_BUDGETS = (0.015625, 0.0625, 0.25, 1.0)
"""P-F finetune lengths as fractions of the recipe's, a factor 4 apart (seed 003 Fig. 4: a token axis
over decades; evenly spaced in log tokens, where a log curve is a line)."""
F_BUDGETS = (0.0625, 0.25, 1.0)
"""F (finetune only) at the same token budgets as P-F, the smallest where Fig. 4's gap is largest."""
COMPARE = "compare"
"""One interleaved measure run of the full-budget P-F, F and P drafters of every training seed."""
TS_SD = "ts_sd"
TREES = "trees"
RSD_BUDGET = "rsd_budget"
HEADS = "heads"
TEMPS_COMPARE = "temps_compare"
K_SWEEP = (1, 2, 3, 4, 6, 10)
"""Fixed draft lengths measured for `sd` and `eesd` (seed 001 Fig. 3 plots speedup against K; K=10 is its
preset, Tables 4 and 5), dense at the short drafts where this CPU's best K lies (2 to 4 on the demo,
bench/results/study.md)."""
MORE_SHARED_LAYERS = 2
"""Seed 001 Fig. 4: EESD heads on N and N + 2 shared layers (N the recipe's)."""
PRESET_K = 10
"""Seed 001 Tables 4 and 5: Thompson sampling against a pre-defined K=10."""
TREE_DEPTH = 3
"""Seed 002 App. C.3.1 at draft length 3: SD K=3, RSD-C 2-2-2, RSD-S 3x3 (its Table 2 rows)."""
BUDGET_TREES: dict[int, tuple[list[list[int]], list[list[int]]]] = {
    6: ([[2, 1, 1], [2, 2], [3, 1]], [[2, 3], [3, 2]]),
    10: ([[2, 1, 1, 1, 1], [2, 2, 1], [5, 1]], [[2, 5], [5, 2]]),
    14: ([[2, 1, 1, 1, 1, 1], [2, 2, 2], [7, 1]], [[2, 7], [7, 2]]),
    21: ([[3, 1, 1, 1, 1, 1], [3, 2, 2], [7, 1, 1]], [[3, 7], [7, 3]]),
    30: ([[2, 2, 2, 2], [5, 1, 1, 1, 1], [6, 1, 1, 1, 1]], [[5, 6], [6, 5]]),
}
"""Seed 002 App. C.3.2: target budget B -> (RSD-C branching vectors, RSD-S [W, L]); SD drafts K = B."""
SEED_TEMPERATURES = (0.0, 0.3, 0.7, 1.0)
"""Seed 003 §2.3 distils at these four temperatures."""
LENGTH_TREES: dict[int, tuple[list[list[int]], list[list[int]]]] = {
    2: ([[2, 2], [2, 1], [3, 1]], [[2, 2], [3, 2]]),
    3: ([[2, 2, 2], [3, 1, 1], [4, 1, 1]], [[3, 3], [4, 3]]),
    4: ([[2, 2, 2, 2], [5, 1, 1, 1], [7, 1, 1, 1]], [[5, 4], [7, 4]]),
    5: ([[2, 2, 2, 2, 2], [6, 1, 1, 1, 1], [12, 1, 1, 1, 1]], [[6, 5], [12, 5]]),
}
"""Seed 002 App. C.3.1 (Exp1): draft length L -> (RSD-C branching vectors, RSD-S [W, L]); SD drafts K = L."""
TREES_LENGTHS = "trees_lengths"
"""Exp1 at every draft length of `LENGTH_TREES` (a `make study-full` variant)."""
HEADLINE_K = 10
"""Seed 001 Table 1's vanilla SD drafts a fixed K=10 (its 1.88× is Table 5's fixed-K=10 row)."""


DEPTH_FACTORS = (1, 2, 3)
"""Seed 003 Table 5 (drafter size): P-F drafters at 1, 2 and 3 times the recipe's drafter depth (its
layers), every other setting the recipe's (a `make study-full` item)."""
DEPTHS_COMPARE = "compare_depths"
"""One interleaved measure run of the P-F drafters of every depth and training seed."""


def depth_variant(seed: int, depth: int, recipe_depth: int) -> str:
    """The P-F drafters of `depth` layers (the recipe's own depth: the full-budget `pf_s<seed>_x1`)."""
    return pf_variant(seed, 1.0) if depth == recipe_depth else f"pf_depth{depth}_s{seed}"


def sd_medusa_variant(seed: int) -> str:
    """Seed 003 Table 1: `sd` with the pair's P-F drafter and Medusa, both trained with training seed
    `seed`, measured interleaved at T=0 and T=1 (a `make study-full` variant)."""
    return f"sd_medusa_s{seed}"


def headline_variant(seed: int) -> str:
    """One interleaved measure run of EESD, `sd` and Medusa (seed 001 Tables 1-3), each trained with
    training seed `seed` (a `make study-full` variant)."""
    return f"headline_s{seed}"


def pf_variant(seed: int, fraction: float) -> str:
    return f"pf_s{seed}_x{fraction:g}"


def f_variant(seed: int, fraction: float) -> str:
    return f"f_s{seed}_x{fraction:g}"


def budgets_variant(pair: str) -> str:
    return f"compare_budgets_{pair}"


def ts_variant(pair: str) -> str:
    return f"ts_sd_{pair}"


def eesd_variant(seed: int, exit_layers: int = 1, shared: int | None = None) -> str:
    """EESD variant names: `eesd_s0` (the recipe's N, one exit layer), `eesd_no_layer_s0`, `eesd_n2_s0`,
    `eesd_2layers_s0` (`make study-full`)."""
    if shared is not None:
        return f"eesd_n{shared}_s{seed}"
    if exit_layers > 1:
        return f"eesd_{exit_layers}layers_s{seed}"
    return f"eesd_s{seed}" if exit_layers else f"eesd_no_layer_s{seed}"


LONG_ENTRIES = [14, 16]
"""Entries per eval sample of the long-answer Thompson-sampling runs, against the demo's 4 to 8: the
study's eval prompts grow from 59 / 82 tokens (de-en / fr-en, mean) to 95 / 146, and their answers with
them: 92-99 tokens a prompt on average (at most 138, every answer ending at EOS; `--only eesd_long_s0`,
2026-11-29) against about 40. No longer: prompt and answer must fit the 256-token sequences the demo
target was trained on (fr-en's longest prompt is 162 tokens). The report lists the answer lengths."""
LONG_TOKENS_FACTOR = 2.5
"""measure.max_new_tokens of the long-answer runs, as a multiple of the recipe's: 160 for the demo's 64,
above the longest answer, so that answers end at EOS (`--quick`'s 6 become 15, which keeps it quick)."""
LONG_CONTROLS = ["fixed", "beta_ts", "beta_ts_literal", "cali_ts", "cali_ts_model", "cali_ts_sampling"]
"""Seed 001 Table 4's rows (K=10, Beta-TS, Cali-TS and its two ablations) and the literal Beta-TS."""


DOMAIN_IO = "domain_io"
"""Seed 003 Fig. 5: the De-En P-F drafters of every training seed on pairs that share its input language
(De-Fr), its output language (Fr-En) or neither (En-De, whose answers are German), one measure run."""
IO_DRAFTER = "de-en"
IO_PAIRS = {"de-fr": "input", "fr-en": "output", "en-de": "neither"}
"""Eval pairs of `DOMAIN_IO` and what each shares with the De-En drafter's training pair (the demo target
translates all four; en-de is the demo recipe's third pair)."""


def eesd_open_variant(seed: int) -> str:
    """EESD trained without self-distillation: on the open rows (seed 001 Table 4's ablation)."""
    return f"eesd_open_only_s{seed}"


def eesd_long_variant(seed: int) -> str:
    """EESD's controls on long answers (seed 001 Table 4, Thompson sampling in the seed's setting)."""
    return f"eesd_long_s{seed}"


def temps_variant(seed: int, four: bool) -> str:
    return f"temps{4 if four else 0}_s{seed}"


def drafter_name(kind: str, seed: int, fraction: float | None = None, pair: str | None = None) -> str:
    """The `measure.extra_drafters` name of a trained drafter in a comparison's measure run, e.g.
    `pf_s1_x0.25_de-en` (P-F, training seed 1, a quarter of the finetune) or `p_s0` (pretrained only)."""
    parts = [
        kind,
        f"s{seed}",
        *([f"x{fraction:g}"] if fraction is not None else []),
        *([pair] if pair else []),
    ]
    return "_".join(parts)


def tree_budget(decoder: str, tree: str | None, draft_length: int | None) -> int | None:
    """Seed 002's target budget B of a row: the draft tokens the target verifies per call (a chain's K,
    a tree's node count from its label: `2-2-1` branching or `3x2` beamwidth x depth)."""
    if decoder == "sd":
        return draft_length
    if tree is None:
        return None
    if decoder == "rsd_s":
        width, depth = tree.split("x")
        return int(width) * int(depth)
    total, level = 0, 1
    for b in tree.split("-"):
        level *= int(b)
        total += level
    return total


def tree_length(decoder: str, tree: str | None, draft_length: int | None) -> int | None:
    """Seed 002's (maximum) draft length L of a row: a chain's K, a tree's depth from its label (`2-2-1`
    branching: 3 levels; `3x2` beamwidth x depth: 2)."""
    if decoder == "sd":
        return draft_length
    if tree is None:
        return None
    if decoder == "rsd_s":
        return int(tree.split("x")[1])
    return len(tree.split("-"))


@dataclass
class VariantData:
    """What a variant left: its measure rows and its finetune stage's tokens per pair."""

    status: str
    """`ok`, `failed: <why>` or `skipped: <why>`."""
    rows: list[ResultRow] = field(default_factory=list)
    finetune_tokens: dict[str, int] = field(default_factory=dict)


Runs = dict[str, VariantData]


class Series(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    label: str
    x: list[float]
    y: list[float]
    yerr: list[float] | None = None
    style: Literal["line", "points", "hline"] = "line"


class Panel(BaseModel):
    """One plot of a finding that is not a bar chart of its checks."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    title: str
    xlabel: str
    ylabel: str
    log_x: bool = False
    series: list[Series]


class Finding(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str
    title: str
    source: str
    """The seed's table or figure."""
    claim: str
    """The seed's claim in its own words and setting (or, for a study item, what is tested and why)."""
    seed_claim: bool = True
    """False for a study item that is no seed claim, and for a seed's side remark (labelled so in the
    report, counted apart from the seeds' findings)."""
    side_remark: bool = False
    """A seed's hedged side remark, not one of its headline claims (`seed_claim` is False)."""
    seed_numbers: str
    """The seed's numbers, as its table gives them (markdown)."""
    metric: str
    """What is compared, in words."""
    quantity: str
    """The metric's short name (a plot's axis)."""
    variants: list[str]
    checks: list[Check]
    details: str = ""
    """Extra markdown: the fit, the best K, rows that were missing."""
    panels: list[Panel] = []
    sanity: bool = False
    """A sanity check of the pipeline (it cannot come out otherwise when the code is right), not a seed's
    finding: judged passed/failed and reported apart from the findings."""
    verdict: Verdict | SanityVerdict
    reason: str


def where(rows: list[ResultRow], metric: str, **fields: object) -> list[float | None]:
    """`metric` of the polydraft rows whose fields equal `fields` (one per seed when fully specified)."""
    return [
        getattr(r, metric)
        for r in rows
        if r.engine == "polydraft" and all(getattr(r, k) == v for k, v in fields.items())
    ]


def rows_of(runs: Runs, name: str) -> list[ResultRow]:
    data = runs.get(name)
    return data.rows if data is not None else []


def not_run(runs: Runs, names: list[str]) -> str | None:
    """Why a finding cannot be computed: a variant it needs did not complete."""
    missing = [f"`{n}` {runs[n].status if n in runs else 'not planned'}" for n in names if not ok(runs, n)]
    return "; ".join(missing) or None


def ok(runs: Runs, name: str) -> bool:
    return name in runs and runs[name].status == "ok"


def temperatures(rows: list[ResultRow]) -> list[float]:
    return sorted({r.temperature for r in rows})


def finish(
    key: str,
    title: str,
    source: str,
    claim: str,
    seed_numbers: str,
    metric: str,
    variants: list[str],
    runs: Runs,
    build: Callable[[], tuple[list[Check], str, list[Panel]]],
    quantity: str = "speedup",
    sanity: bool = False,
    seed_claim: bool = True,
    side_remark: bool = False,
) -> Finding:
    """The finding with its checks and verdict, or `not run` with the reason when a variant is missing;
    `sanity` judges it as a sanity check (passed/failed) instead of a seed's finding."""
    reason = not_run(runs, variants)
    checks: list[Check] = []
    details, panels = "", []
    if reason is None:
        checks, details, panels = build()
    judge = sanity_verdict if sanity else verdict_of
    verdict, why = ("not run", reason) if reason is not None else judge(checks)
    return Finding(
        key=key, title=title, source=source, claim=claim, seed_claim=seed_claim and not side_remark, side_remark=side_remark, seed_numbers=seed_numbers, metric=metric, quantity=quantity,
        variants=variants, checks=checks, details=details, panels=panels, sanity=sanity, verdict=verdict,
        reason=why,
    )  # fmt: skip


def pooled(rows: list[ResultRow], names: list[str], metric: PromptMetric, **fields: object) -> ArmValues:
    """`metric` per prompt of each drafter in `names` (one per training seed of `TRAIN_SEEDS`, in order)."""
    return {
        seed: prompt_values(rows, metric, drafter=name, **fields) for seed, name in zip(TRAIN_SEEDS, names)
    }
