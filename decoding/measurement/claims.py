"""The one rule that turns two groups of repeated measurements into an outcome, used by the study's
verdicts (`pipelines.study.verdicts`) and by the mixed-traffic decision (`decoding.measurement.mixed`).

The noise of a comparison is twice the pooled sample std of the two groups. A strict claim `A > B`
*holds* only when A - B exceeds the noise, is *contradicted* when B - A does, and is *within noise*
otherwise. A claim `A >= B` can never hold: it is *consistent* unless A is below B by more than the
noise. A claim `A == B` holds when |A - B| is within the noise and is contradicted otherwise.
"""

from __future__ import annotations

from typing import Literal

from polydraft.decoding.measurement.report import pooled_std

Claim = Literal[">", ">=", "=="]
Outcome = Literal["holds", "consistent", "contradicted", "within noise", "too few repetitions"]


def noise_of(first: list[float], second: list[float]) -> float | None:
    """Twice the pooled sample std of the two groups (None without 2 values in each)."""
    spread = pooled_std(first, second)
    return None if spread is None else 2 * spread


def outcome_of(claim: Claim, difference: float, noise: float) -> Outcome:
    """The outcome of `A claim B` given difference = A - B and the noise (see the module docstring)."""
    if claim == "==":
        return "holds" if abs(difference) <= noise else "contradicted"
    if difference < -noise:
        return "contradicted"
    if claim == ">=":
        return "consistent"  # not contradicted is all a non-strict claim can show
    return "holds" if difference > noise else "within noise"
