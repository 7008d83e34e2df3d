"""The report's cells: repetitions, latency-model predictions and their error, and the in-domain vs out-of-domain verdict."""

from __future__ import annotations

import math

from polydraft.decoding.measurement.results import ResultRow
from polydraft.decoding.measurement.tables import (
    domain_table,
    pooled_std,
    repetitions,
    rescoring_table,
    speedup_table,
    table,
)

CONTEXT = {"target": "t", "device": "cpu", "hardware": "cpu", "date": "d", "torch": "2", "transformers": "4"}
METRICS = {
    "prompts": 8,
    "new_tokens": 64,
    "target_calls": 10,
    "draft_calls": 30,
    "mean_accepted_length": None,
    "mean_draft_length": None,
    "acceptance_rate": None,
    "draft_proportion": None,
    "hm": None,
    "mbsu": None,
    "token_rate": 100.0,
    "wall_seconds": 1.0,
    "target_seconds": 0.5,
    "draft_seconds": 0.2,
    "overhead_share": 0.3,
    "eos_stops": 0,
}


def row(dataset: str, seed: int, be: float, speedup: float, predicted: float | None = None) -> ResultRow:
    pair = dataset.split("-test")[0]
    return ResultRow(
        engine="polydraft",
        engine_detail=None,
        acceptance_per_position=None,
        batch_rates=None,
        decoder="sd",
        method="sd[de-en] K=4",
        drafter="de-en",
        drafter_kind="finetune",
        drafter_pair="de-en",
        dataset=dataset,
        dataset_pair=pair,
        in_domain=pair == "de-en",
        temperature=0.0,
        top_p=1.0,
        seed=seed,
        draft_length=4,
        control="fixed",
        tree=None,
        max_new_tokens=64,
        size_ratio=0.1,
        block_efficiency=be,
        speedup=speedup,
        predicted_speedup=predicted,
        matches_ar=True,
        group_rows=2,
        **METRICS,
        **CONTEXT,
    )


def test_one_repetition_shows_its_count_not_a_zero_spread():
    rows = [row("de-en-test", 0, 2.5, 1.2, 1.5)]
    text = table(rows, "block_efficiency")
    assert "2.50 (n=1)" in text and "±" not in text
    assert "1.20 (n=1) (predicted 1.50, error -20%)" in speedup_table(rows)
    assert repetitions(rows) == "1"
    assert repetitions(rows + [row("de-en-test", 1, 2.7, 1.3), row("fr-en-test", 0, 2.0, 1.0)]) == "1-2"


def test_speedup_cells_carry_the_latency_models_prediction_and_its_error():
    rows = [row("de-en-test", 0, 2.5, 1.2, 1.5), row("de-en-test", 1, 2.5, 1.4, 1.5)]
    assert "| sd[de-en] K=4 | 1.30 ± 0.14 (predicted 1.50, error -13%) |" in speedup_table(rows)
    above = [row("de-en-test", 0, 2.5, 1.56, 1.5)]  # a prediction, not a bound: measured can exceed it
    assert "(predicted 1.50, error +4%)" in speedup_table(above)
    assert "(predicted" not in speedup_table([row("de-en-test", 0, 2.5, 1.2)])
    assert "ideal" not in speedup_table(rows + above)


def test_rows_written_with_the_old_field_name_still_load():
    old = row("de-en-test", 0, 2.5, 1.2, 1.5).model_dump()
    old["ideal_speedup"] = old.pop("predicted_speedup")
    assert ResultRow.model_validate(old).predicted_speedup == 1.5
    assert "ideal_speedup" not in ResultRow.model_validate(old).model_dump()


def test_domain_table_calls_a_difference_beyond_noise_only_past_twice_the_pooled_std():
    assert pooled_std([1.0], [2.0, 3.0]) is None
    assert math.isclose(pooled_std([1.0, 3.0], [2.0, 4.0, 6.0]), math.sqrt((2 + 8) / 3))
    inside = [row("de-en-test", s, be, 1.0) for s, be in enumerate([3.0, 3.1, 2.9])]
    far = [row("fr-en-test", s, be, 0.8) for s, be in enumerate([2.0, 2.1, 1.9])]
    near = [row("fr-en-test", s, be, 0.8) for s, be in enumerate([2.85, 2.95, 2.75])]
    # pooled std 0.1 in both cases: a difference of 1.0 is beyond noise, one of 0.15 (1.5 std) is not
    assert "| sd[de-en] K=4 | 0 | 3.00 ± 0.10 | 2.00 ± 0.10 | +1.00 | 0.20 | yes |" in domain_table(
        inside + far
    )
    assert "| +0.15 | 0.20 | no |" in domain_table(inside + near)
    assert "| - | - |" in domain_table(inside[:1] + far[:1])


def test_rescoring_gain_against_both_spreads():
    """A gain smaller than twice the methods' spread over prompts (unpaired: no) but steady seed by seed
    (paired: yes); the other way round when the gain flips sign between seeds."""

    def blockwise(decoder: str, method: str, seed: int, be: float) -> ResultRow:
        rescorer = "de-en" if decoder.endswith("+rescore") else None
        return row("de-en-test", seed, be, 1.0).model_copy(
            update={"decoder": decoder, "method": method, "drafter": "heads", "drafter_kind": "heads",
                    "rescorer": rescorer, "in_domain": None}
        )  # fmt: skip

    alone = [blockwise("bpd", "bpd[heads] K=3", s, be) for s, be in enumerate([1.5, 1.8, 2.1])]
    steady = [
        blockwise("bpd+rescore", "bpd+rescore[de-en] K=3", s, be) for s, be in enumerate([1.6, 1.9, 2.2])
    ]
    text = rescoring_table(alone + steady)
    assert (
        "| bpd+rescore[de-en] K=3 | bpd[heads] K=3 | de-en-test | 0 | 1.90 ± 0.30 | 1.80 ± 0.30 | +0.10 | 0.60 "
        "| no | +0.10 ± 0.00 | yes |"
    ) in text, text
    flipping = [
        blockwise("bpd+rescore", "bpd+rescore[de-en] K=3", s, be) for s, be in enumerate([1.9, 1.5, 2.4])
    ]
    assert "| 1.93 ± 0.45 | 1.80 ± 0.30 | +0.13 | 0.77 | no | +0.13 ± 0.38 | no |" in rescoring_table(
        alone + flipping
    )
    assert rescoring_table(steady).startswith("No `+rescore` decoder")
