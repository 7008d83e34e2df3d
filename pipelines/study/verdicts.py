"""The study's verdicts, from one rule written once.

A *check* compares two measured quantities, each a mean ± sample std over n repetitions (seeds over
disjoint prompts), or tests a fitted slope. Its outcome follows `decoding.measurement.claims`: the noise
is twice the pooled std of the two groups (for a slope: twice its standard error); a strict claim `A > B`
*holds* only beyond the noise, `A >= B` is at best *consistent*, `A == B` (a sanity check, such as
outputs identical to `ar`) holds within the noise. A sanity check *passed* when every one of its checks
holds and *failed* otherwise. A finding is *reproduced* only when every one of its checks is a strict
claim that holds; *consistent* when none is contradicted or open and at least one is merely consistent;
*not reproduced* when one is contradicted; *inconclusive* otherwise (the reason names the checks within
noise or with fewer than 2 repetitions); *not run* when the pipeline produced no rows for it. The seeds'
findings are strict claims; sanity checks (every decoder lossless) are judged by the same rule and
reported apart, never counted among the findings. Nothing in the rule is chosen per finding.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict

from polydraft.decoding.measurement.claims import Claim, Outcome, noise_of, outcome_of
from polydraft.decoding.measurement.metrics import mean_std

Verdict = Literal["reproduced", "consistent", "not reproduced", "inconclusive", "not run"]
VERDICTS: tuple[Verdict, ...] = ("reproduced", "consistent", "not reproduced", "inconclusive", "not run")
SanityVerdict = Literal["passed", "failed", "not run"]
MIN_REPETITIONS = 2


class Stat(BaseModel):
    """Mean ± sample std over n values."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mean: float
    std: float
    n: int

    def text(self) -> str:
        return f"{self.mean:.3f} ± {self.std:.3f} (n={self.n})"


def stat(values: list[float | None]) -> Stat | None:
    present = [v for v in values if v is not None]
    mean, std = mean_std(present)
    if mean is None or std is None:
        return None
    return Stat(mean=mean, std=std, n=len(present))


class Check(BaseModel):
    """One comparison (or slope test) of a finding, with the numbers its outcome rests on."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    label: str
    """What is compared, e.g. `de-en, T=0: P-F > F`."""
    claim: Claim
    first: str
    second: str
    a: Stat | None
    b: Stat | None
    difference: float | None
    """a.mean - b.mean."""
    noise: float | None
    """Twice the pooled std of the two groups (for a slope: twice its standard error)."""
    outcome: Outcome


def compare(label: str, claim: Claim, first: str, a: list[float], second: str, b: list[float]) -> Check:
    """Check `first claim second` from the per-repetition values of each."""
    sa, sb = stat(a), stat(b)
    few = sa is None or sb is None or min(sa.n, sb.n) < MIN_REPETITIONS
    if few or sa is None or sb is None:
        return Check(
            label=label, claim=claim, first=first, second=second, a=sa, b=sb, difference=None,
            noise=None, outcome="too few repetitions",
        )  # fmt: skip
    noise = noise_of([v for v in a if v is not None], [v for v in b if v is not None]) or 0.0
    difference = sa.mean - sb.mean
    return Check(
        label=label, claim=claim, first=first, second=second, a=sa, b=sb, difference=difference,
        noise=noise, outcome=outcome_of(claim, difference, noise),
    )  # fmt: skip


class Fit(BaseModel):
    """Least squares y = intercept + slope * log10(x), with the slope's standard error."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    intercept: float
    slope: float
    slope_se: float
    n: int
    r2_log: float
    """R^2 of the fit in log10(x)."""
    r2_linear: float
    """R^2 of the same data fitted in x itself, for comparison with the logarithmic shape."""


def _least_squares(xs: list[float], ys: list[float]) -> tuple[float, float, float, float]:
    """(intercept, slope, slope standard error, R^2) of y on x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    slope = sxy / sxx
    intercept = my - slope * mx
    residual = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys))
    total = sum((y - my) ** 2 for y in ys)
    se = math.sqrt(residual / (n - 2) / sxx) if n > 2 else float("inf")
    return intercept, slope, se, (1 - residual / total) if total > 0 else 1.0


def log_fit(xs: list[float], ys: list[float]) -> Fit | None:
    """The logarithmic fit of points (x > 0), or None with fewer than 3 points or 2 distinct x."""
    if len(xs) < 3 or len(set(xs)) < 2:
        return None
    intercept, slope, se, r2_log = _least_squares([math.log10(x) for x in xs], ys)
    r2_linear = _least_squares(xs, ys)[3]
    return Fit(intercept=intercept, slope=slope, slope_se=se, n=len(xs), r2_log=r2_log, r2_linear=r2_linear)


def slope_check(label: str, fit: Fit | None) -> Check:
    """Check that the slope of `fit` is > 0: its difference from 0 against twice its standard error."""
    if fit is None:
        return Check(
            label=label, claim=">", first="slope", second="0", a=None, b=None, difference=None,
            noise=None, outcome="too few repetitions",
        )  # fmt: skip
    noise = 2 * fit.slope_se
    return Check(
        label=label, claim=">", first="slope", second="0",
        a=Stat(mean=fit.slope, std=fit.slope_se, n=fit.n), b=Stat(mean=0.0, std=0.0, n=fit.n),
        difference=fit.slope, noise=noise, outcome=outcome_of(">", fit.slope, noise),
    )  # fmt: skip


def verdict_of(checks: list[Check]) -> tuple[Verdict, str]:
    """The finding's verdict from its checks, with the reason (see the module docstring)."""
    if not checks:
        return "not run", "the study produced no rows for it"
    contradicted = [c.label for c in checks if c.outcome == "contradicted"]
    if contradicted:
        return "not reproduced", "contradicted beyond noise: " + "; ".join(contradicted)
    few = [c.label for c in checks if c.outcome == "too few repetitions"]
    within = [c.label for c in checks if c.outcome == "within noise"]
    if few or within:
        parts = []
        if within:
            parts.append(
                f"{len(within)} of {len(checks)} checks within noise (difference within ± 2 x pooled std): "
                + "; ".join(within)
            )
        if few:
            parts.append(f"fewer than {MIN_REPETITIONS} repetitions for: " + "; ".join(few))
        return "inconclusive", ". ".join(parts)
    consistent = [c.label for c in checks if c.outcome == "consistent"]
    if consistent:
        return "consistent", (
            f"nothing contradicted, but {len(consistent)} of {len(checks)} checks are non-strict claims that "
            "can only be consistent: " + "; ".join(consistent)
        )
    return "reproduced", f"all {len(checks)} checks hold beyond noise"


def sanity_verdict(checks: list[Check]) -> tuple[SanityVerdict, str]:
    """A sanity check's verdict: passed only when every check holds (see the module docstring)."""
    if not checks:
        return "not run", "the study produced no rows for it"
    failing = [f"{c.label} ({c.outcome})" for c in checks if c.outcome != "holds"]
    if failing:
        return "failed", "; ".join(failing)
    return "passed", f"all {len(checks)} checks hold"
