"""Each arm of a check as its values per prompt, read from the measure rows' `per_prompt` results
(`decoding.measurement.results.PromptResult`).

A row is one decoder x drafter x eval set x temperature x repetition; its `per_prompt` lists the prompts
of its group in order, and every row of a group decoded the same prompts. The study decodes disjoint
prompts per repetition (`measure.disjoint_prompts`, checked by `pipelines.study.run`), so (repetition,
position) names one prompt of an eval set, and two arms measured on the same eval set pair by it, even
from two measure runs of the same recipe (the early-exit variants). An arm whose fields pin another eval
set (in domain against out of domain) pairs by position only: independent prompts, whose difference
carries both arms' spread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from polydraft.decoding.measurement.results import PromptResult, ResultRow, prompt_speedup
from polydraft.pipelines.study.verdicts import ArmValues, Prompt

PromptMetric = Literal["speedup", "block_efficiency", "token_rate", "mbsu", "hm"]


def prompt_metric(
    metric: PromptMetric, row: ResultRow, result: PromptResult, ar: PromptResult | None
) -> float | None:
    """`metric` of one prompt of `row`: block efficiency new tokens / target calls; speedup the token rate
    over `ar`'s on the same prompt (None without `ar`); MBSU the prompt's block efficiency over the row's
    (L r + 1) (L the row's mean draft length, fixed for the chains and trees compared); HM from the
    prompt's drafted and accepted tokens."""
    if metric == "block_efficiency":
        return result.block_efficiency
    if metric == "token_rate":
        return result.token_rate
    if metric == "speedup":
        return None if ar is None else prompt_speedup(result, ar)
    if metric == "hm":
        return result.hm
    if row.mbsu is None or not row.block_efficiency:
        return None
    return result.block_efficiency * row.mbsu / row.block_efficiency


def prompt_values(rows: Sequence[ResultRow], metric: PromptMetric, **fields: object) -> dict[Prompt, float]:
    """`metric` per prompt of the polydraft rows whose fields equal `fields`, keyed by (repetition,
    position); ValueError when two matching rows share a repetition (the fields do not pin one arm)."""
    ar = {r.group: r.per_prompt for r in rows if r.engine == "polydraft" and r.decoder == "ar"}
    values: dict[Prompt, float] = {}
    seen: set[int] = set()
    for row in rows:
        if row.engine != "polydraft" or any(getattr(row, k) != v for k, v in fields.items()):
            continue
        if row.seed in seen:
            raise ValueError(f"{fields}: two rows of repetition {row.seed} ({row.method}): not one arm")
        seen.add(row.seed)
        base = ar.get(row.group)
        for position, result in enumerate(row.per_prompt or []):
            value = prompt_metric(metric, row, result, base[position] if base else None)
            if value is not None:
                values[row.seed, position] = value
    return values


def arm(rows_by_seed: dict[int, Sequence[ResultRow]], metric: PromptMetric, **fields: object) -> ArmValues:
    """Training seed -> prompt -> `metric`, from each training seed's rows (`prompt_values`)."""
    return {seed: prompt_values(rows, metric, **fields) for seed, rows in rows_by_seed.items()}


def flat(values: ArmValues) -> list[float]:
    """Every value of an arm, over training seeds and prompts."""
    return [v for by_prompt in values.values() for v in by_prompt.values()]
