"""The study's verdicts, from one rule written once (`decoding.measurement.claims`).

A *check* compares two arms on the same prompts: each arm's value on each prompt (per training seed and
repetition; `pipelines.study.arms`), paired by training seed and prompt, and decided by the interval of
the mean paired difference (`claims.paired_interval`: a hierarchical bootstrap over training seeds, then
prompts, with Student's t) at its stated level. A strict claim `A > B` *holds* when the interval lies above
zero, is *contradicted* when it lies below, and is *within noise* otherwise, with the smallest difference
the check could have found at 80% power (*detectable*), printed beside the seed's own effect where the
finding quotes one; `A >= B` is at best *consistent*. A finding is *reproduced* only when every one of its
checks is a strict claim that holds; *consistent* when none is contradicted or open and at least one is
merely consistent; *not reproduced* when one is contradicted; *inconclusive* otherwise (the reason names
the open checks and what each could have detected); *not run* when the pipeline produced no rows for it.
A sanity check (every decoder lossless) is exact, not statistical: it *passed* only when every row
matches, and is reported apart, never counted among the findings. Nothing in the rule is chosen per finding.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict

from polydraft.decoding.measurement.claims import Claim, Outcome, PairedInterval, paired_interval
from polydraft.decoding.measurement.metrics import mean_std

Verdict = Literal["reproduced", "consistent", "not reproduced", "inconclusive", "not run"]
VERDICTS: tuple[Verdict, ...] = ("reproduced", "consistent", "not reproduced", "inconclusive", "not run")
SanityVerdict = Literal["passed", "failed", "not run"]
OPEN: tuple[Outcome, ...] = ("within noise", "too few prompts")
"""Outcomes that settle nothing."""

Prompt = tuple[int, int]
"""(repetition, position): the study decodes disjoint prompts per repetition, so this names one prompt
of an eval set."""
ArmValues = Mapping[int, Mapping[Prompt, float]]
"""Training seed -> prompt -> one arm's value on that prompt."""


class Stat(BaseModel):
    """Mean ± sample std over n values."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mean: float
    std: float
    n: int

    def text(self) -> str:
        return f"{self.mean:.3f} ± {self.std:.3f} (n={self.n})"


def stat(values: list[float | None]) -> Stat | None:
    """Mean ± std of the values that are not None (None without any)."""
    present = [v for v in values if v is not None]
    mean, std = mean_std(present)
    if mean is None or std is None:
        return None
    return Stat(mean=mean, std=std, n=len(present))


def arm_stat(values: ArmValues) -> Stat | None:
    """Mean ± std over every prompt of every training seed of an arm."""
    return stat([v for by_prompt in values.values() for v in by_prompt.values()])


class PromptValue(BaseModel):
    """One arm's value on one prompt."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int
    """The training seed of the arm's drafter (0 where a check compares decoders on one drafter)."""
    repetition: int
    """The measure seed (repetition) that decoded the prompt."""
    prompt: int
    """The prompt's position among the repetition's prompts."""
    value: float


class Interval(BaseModel):
    """The mean paired difference A - B and its interval (`claims.PairedInterval`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mean: float
    low: float
    high: float
    level: float
    detectable: float
    """The smallest |A - B| the check finds at 80% power."""
    seeds: int
    prompts: int
    """Paired prompts over every training seed."""

    def text(self) -> str:
        return f"{self.mean:+.3f} [{self.low:+.3f}, {self.high:+.3f}] at {self.level:.0%}"


def interval_of(paired: PairedInterval) -> Interval:
    return Interval(
        mean=paired.mean, low=paired.low, high=paired.high, level=paired.level, detectable=paired.detectable,
        seeds=paired.seeds, prompts=paired.prompts,
    )  # fmt: skip


class Check(BaseModel):
    """One comparison of a finding, with the per-prompt values and the interval its outcome rests on."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    label: str
    """What is compared, e.g. `de-en, T=0: P-F > F`."""
    claim: Claim
    first: str
    second: str
    a: Stat | None
    """The first arm over its prompts."""
    b: Stat | None
    first_values: list[PromptValue]
    second_values: list[PromptValue]
    interval: Interval | None
    """Of the paired difference first - second (None with fewer than 2 paired prompts, or for an exact
    sanity check)."""
    seed_effect: float | None = None
    """The seed's own first - second in this metric, where the finding quotes one."""
    outcome: Outcome


def _values(values: ArmValues) -> list[PromptValue]:
    return [
        PromptValue(seed=seed, repetition=prompt[0], prompt=prompt[1], value=value)
        for seed, by_prompt in sorted(values.items())
        for prompt, value in sorted(by_prompt.items())
    ]


def compare(
    label: str,
    claim: Claim,
    first: str,
    a: ArmValues,
    second: str,
    b: ArmValues,
    seed_effect: float | None = None,
) -> Check:
    """Check `first claim second` from each arm's per-prompt values, paired by training seed and prompt
    (the prompts only one arm decoded are kept in its values but not paired)."""
    differences = {
        seed: {p: [a[seed][p] - b[seed][p]] for p in a[seed] if p in b[seed]} for seed in a if seed in b
    }
    paired = paired_interval(differences)
    return Check(
        label=label, claim=claim, first=first, second=second, a=arm_stat(a), b=arm_stat(b),
        first_values=_values(a), second_values=_values(b),
        interval=None if paired is None else interval_of(paired), seed_effect=seed_effect,
        outcome="too few prompts" if paired is None else paired.outcome(claim),
    )  # fmt: skip


def open_text(check: Check) -> str:
    """An open check's label with what it could have detected and the seed's effect."""
    if check.interval is None:
        return f"{check.label} (too few paired prompts)"
    seed = "" if check.seed_effect is None else f"; the seed's effect {check.seed_effect:+.3f}"
    return f"{check.label} ({check.interval.text()}, detectable {check.interval.detectable:.3f}{seed})"


def verdict_of(checks: list[Check]) -> tuple[Verdict, str]:
    """The finding's verdict from its checks, with the reason (see the module docstring)."""
    if not checks:
        return "not run", "the study produced no rows for it"
    contradicted = [c.label for c in checks if c.outcome == "contradicted"]
    if contradicted:
        return "not reproduced", "contradicted (the interval excludes 0 the other way): " + "; ".join(
            contradicted
        )
    unsettled = [c for c in checks if c.outcome in OPEN]
    if unsettled:
        return "inconclusive", (
            f"{len(unsettled)} of {len(checks)} checks open (the interval of the paired difference holds 0): "
            + "; ".join(open_text(c) for c in unsettled)
        )
    consistent = [c.label for c in checks if c.outcome == "consistent"]
    if consistent:
        return "consistent", (
            f"nothing contradicted, but {len(consistent)} of {len(checks)} checks are non-strict claims that "
            "can only be consistent: " + "; ".join(consistent)
        )
    return "reproduced", f"all {len(checks)} checks hold (each interval excludes 0 on the claimed side)"


def counts(checks: list[Check]) -> tuple[int, int, int]:
    """(holds or consistent, contradicted, open) among the checks."""
    contradicted = sum(c.outcome == "contradicted" for c in checks)
    unsettled = sum(c.outcome in OPEN for c in checks)
    return len(checks) - contradicted - unsettled, contradicted, unsettled


def sanity_verdict(checks: list[Check]) -> tuple[SanityVerdict, str]:
    """A sanity check's verdict: passed only when every check holds (see the module docstring)."""
    if not checks:
        return "not run", "the study produced no rows for it"
    failing = [f"{c.label} ({c.outcome})" for c in checks if c.outcome != "holds"]
    if failing:
        return "failed", "; ".join(failing)
    return "passed", f"all {len(checks)} checks hold"
