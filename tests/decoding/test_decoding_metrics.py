"""The metric formulas on a hand-made trace."""

from __future__ import annotations

import math

from polydraft.decoding.engine import Generation, Round
from polydraft.decoding.measurement.metrics import mean_std, summarize


def trace() -> list[Generation]:
    # prompt 1: three rounds with K = 4 (accepted 4, 1, 2) -> 5 + 2 + 3 = 10 tokens
    first = Generation(
        tokens=list(range(10)),
        stop="length",
        rounds=[Round(4, 4, 4), Round(4, 4, 1), Round(4, 4, 2)],
        target_calls=3,
        draft_calls=12,
        wall_seconds=2.0,
        target_seconds=1.0,
        draft_seconds=0.5,
    )
    # prompt 2: a tree round (depth 2, 6 nodes, 2 accepted) and a plain target step -> 3 + 1 = 4 tokens
    second = Generation(
        tokens=[1, 2, 3, 4],
        stop="eos",
        rounds=[Round(2, 6, 2), Round(0, 0, 0)],
        target_calls=2,
        draft_calls=2,
        wall_seconds=1.0,
        target_seconds=0.5,
        draft_seconds=0.25,
    )
    return [first, second]


def test_summarize_by_hand():
    m = summarize(trace(), size_ratio=0.1)
    assert m["new_tokens"] == 14 and m["target_calls"] == 5 and m["prompts"] == 2
    assert math.isclose(m["block_efficiency"], 14 / 5)
    # rounds with drafts: 4 of them, accepted 4 + 1 + 2 + 2 = 9, drafted 4 + 4 + 4 + 6 = 18
    assert math.isclose(m["mean_accepted_length"], 9 / 4)
    assert math.isclose(m["acceptance_rate"], 9 / 18)
    assert math.isclose(m["draft_proportion"], 9 / 14)
    v, r = 0.5, 9 / 14
    assert math.isclose(m["hm"], 2 * v * r / (v + r))
    # mean draft length L = (4 + 4 + 4 + 2) / 4 = 3.5; MBSU = eta / (L r + 1)
    assert math.isclose(m["mean_draft_length"], 3.5)
    assert math.isclose(m["mbsu"], (14 / 5) / (3.5 * 0.1 + 1))
    assert math.isclose(m["token_rate"], 14 / 3.0)
    assert math.isclose(m["overhead_share"], (3.0 - 2.25) / 3.0)
    assert m["eos_stops"] == 1 and m["draft_calls"] == 14
    # rounds with drafts whose first i+1 drafts were accepted: accepted 4, 1, 2, 2 over 4 rounds
    assert m["acceptance_per_position"] == [1.0, 3 / 4, 1 / 4, 1 / 4]


def test_ar_has_block_efficiency_one_and_no_acceptance():
    ar = Generation(
        tokens=[1, 2, 3], stop="length", rounds=[Round(0, 0, 0)] * 3, target_calls=3, wall_seconds=1.5
    )
    m = summarize([ar], size_ratio=None)
    assert m["block_efficiency"] == 1.0 and m["mbsu"] == 1.0
    assert m["acceptance_rate"] is None and m["hm"] is None and m["mean_draft_length"] is None
    assert m["acceptance_per_position"] is None
    assert m["overhead_share"] == 1.0  # no forward time recorded in this hand-made trace


def test_mean_std_is_the_sample_standard_deviation():
    mean, std = mean_std([1.0, 2.0, 4.0])
    assert math.isclose(mean, 7 / 3)
    assert math.isclose(std, math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2))
    assert mean_std([3.0]) == (3.0, 0.0)
    assert mean_std([None, 2.0, None]) == (2.0, 0.0)
    assert mean_std([]) == (None, None)


def test_mbsu_of_a_decoder_without_rounds_uses_its_fixed_draft_length():
    # transformers' assisted generation reports no rounds: 12 tokens in 4 target calls with K = 4
    assisted = Generation(tokens=list(range(12)), stop="length", rounds=[], target_calls=4, wall_seconds=1.0)
    m = summarize([assisted], size_ratio=0.05, fixed_draft_length=4)
    assert math.isclose(m["block_efficiency"], 3.0)
    assert math.isclose(m["mbsu"], 3.0 / (4 * 0.05 + 1))
