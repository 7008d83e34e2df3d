"""What the findings are made of: the variants' names and data, the typed finding, and the helpers that
select rows (`decoding.measurement.results.ResultRow`) by every field that defines them, never by a label."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict

from polydraft.decoding.measurement.results import ResultRow
from polydraft.pipelines.study.verdicts import Check, SanityVerdict, Verdict, sanity_verdict, verdict_of

# variant names (the variants themselves are built in `pipelines.study.variants`)
PF = "pf"
F_ONLY = "f_only"
DISTILL_T0 = "distill_t0"
TREES = "trees"
HEADS = "heads"
EESD = "eesd"
EESD_NO_LAYER = "eesd_no_layer"
BUDGETS = (0.125, 0.25, 0.5)
"""Finetune lengths as fractions of the recipe's; the recipe's own (the `pf` variant) is the fourth."""


def budget_variant(fraction: float) -> str:
    return f"finetune_x{fraction:g}"


TREE_DEPTH = 3
"""Seed 002 App. C.3.1 at draft length 3: SD K=3, RSD-C 2-2-2, RSD-S 3x3 (its Table 2 rows)."""
K_SWEEP = (1, 2, 3, 4, 6)
"""Fixed draft lengths of seed 001 Fig. 3 (speedup against K) measured for `eesd`."""


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


def pairs(rows: list[ResultRow]) -> list[str]:
    return sorted(
        {r.drafter_pair for r in rows if r.drafter_pair is not None and r.drafter_kind == "finetune"}
    )


def temperatures(rows: list[ResultRow]) -> list[float]:
    return sorted({r.temperature for r in rows})


def finish(
    key: str,
    title: str,
    source: str,
    seed_numbers: str,
    metric: str,
    variants: list[str],
    runs: Runs,
    build: Callable[[], tuple[list[Check], str, list[Panel]]],
    quantity: str = "speedup",
    sanity: bool = False,
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
        key=key, title=title, source=source, seed_numbers=seed_numbers, metric=metric, quantity=quantity,
        variants=variants, checks=checks, details=details, panels=panels, sanity=sanity, verdict=verdict,
        reason=why,
    )  # fmt: skip


def chain(rows: list[ResultRow], k: int, drafter: str, dataset: str, t: float, metric: str) -> list:
    return where(
        rows, metric, decoder="sd", control="fixed", draft_length=k, drafter=drafter, dataset=dataset,
        temperature=t,
    )  # fmt: skip
