"""The seeds' metrics, computed from the records of a set of generations.

- block efficiency eta: generated tokens per target call (seed 002 C.2); `ar` has exactly 1;
- mean accepted length: accepted draft tokens per verification round that had drafts;
- acceptance rate v_d = N_right / N_all_draft and draft proportion r_d = N_right / L (seed 001 App. D,
  eq. 11-12: accepted draft tokens over drafted tokens, and over output tokens), their harmonic mean
  HM = 2 v_d r_d / (v_d + r_d); for trees N_all_draft counts every node sent to the target;
- MBSU = eta / (L r + 1) (seed 002 C.2) with L the mean draft length per round (K of a chain, depth of
  a tree) and r the drafter/target parameter-count ratio;
- token rate (generated tokens per second of wall time), target calls, and the engine's overhead:
  the share of wall time spent outside the models' forward passes.
Wall-clock speedup is a ratio of token rates measured side by side (`decoding.measurement.groups`). Over seeds,
`mean_std` gives the mean and the sample standard deviation (seed 003 Table 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from polydraft.decoding.engine import Generation


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def summarize(
    generations: Sequence[Generation], size_ratio: float | None, fixed_draft_length: int | None = None
) -> dict[str, float | int | None]:
    """Metrics of a set of generations (one decoder, one drafter, one dataset, one seed).

    `size_ratio`: drafter parameters / target parameters, None for `ar`. Metrics that do not apply
    (acceptance of a decoder that drafts nothing) are None. `fixed_draft_length` is the L of MBSU for a
    decoder that does not report its rounds (transformers' assisted generation drafts K every round).
    """
    tokens = sum(len(g.tokens) for g in generations)
    target_calls = sum(g.target_calls for g in generations)
    rounds = [r for g in generations for r in g.rounds if r.drafted]
    drafted = sum(r.drafted for r in rounds)
    accepted = sum(r.accepted for r in rounds)
    wall = sum(g.wall_seconds for g in generations)
    forward = sum(g.target_seconds + g.draft_seconds for g in generations)
    efficiency = _ratio(tokens, target_calls)
    rescore = sum(g.rescore_seconds for g in generations)
    v_d = _ratio(accepted, drafted)
    r_d = _ratio(accepted, tokens) if rounds else None
    hm = 2 * v_d * r_d / (v_d + r_d) if v_d is not None and r_d is not None and v_d + r_d > 0 else None
    draft_length = _ratio(sum(r.draft_length for r in rounds), len(rounds)) or float(fixed_draft_length or 0)
    positions = max((r.draft_length for r in rounds), default=0)
    per_position = [_ratio(sum(r.accepted > i for r in rounds), len(rounds)) for i in range(positions)]
    mbsu = None
    if efficiency is not None:
        mbsu = efficiency / (draft_length * size_ratio + 1) if size_ratio is not None else efficiency
    return {
        "prompts": len(generations),
        "new_tokens": tokens,
        "target_calls": target_calls,
        "draft_calls": sum(g.draft_calls for g in generations),
        "block_efficiency": efficiency,
        "mean_accepted_length": _ratio(accepted, len(rounds)),
        "mean_draft_length": draft_length if rounds else None,
        "acceptance_rate": v_d,
        "acceptance_per_position": per_position or None,
        "draft_proportion": r_d,
        "hm": hm,
        "mbsu": mbsu,
        "token_rate": _ratio(tokens, wall),
        "wall_seconds": wall,
        "target_seconds": sum(g.target_seconds for g in generations),
        "draft_seconds": sum(g.draft_seconds for g in generations),
        "overhead_share": _ratio(wall - forward, wall),
        "rescore_seconds": rescore,
        "rescore_ms_per_round": _ratio(1000 * rescore, target_calls) if rescore else None,
        "eos_stops": sum(g.stop == "eos" for g in generations),
    }


def mean_std(values: Sequence[float | None]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (0 for a single value) of the values that are not None."""
    present = [v for v in values if v is not None]
    if not present:
        return None, None
    mean = sum(present) / len(present)
    if len(present) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in present) / (len(present) - 1))


def format_cell(cell: tuple[float | None, float | None, int] | None, percent: bool) -> str:
    """A table cell: `mean ± std`, or `mean (n=1)` for one repetition, `-` when nothing was measured."""
    if cell is None or cell[0] is None:
        return "-"
    mean, std, count = cell
    value = f"{mean:.1%}" if percent else f"{mean:.2f}"
    if count < 2 or std is None:
        return f"{value} (n={count})"
    return f"{value} ± {std:.1%}" if percent else f"{value} ± {std:.2f}"
