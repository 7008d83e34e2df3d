"""The report's cells: repetitions, latency-model predictions and their error, and the in-domain vs
out-of-domain and rescoring verdicts (the paired rule on per-prompt values)."""

from __future__ import annotations

from polydraft.decoding.measurement.results import PromptResult, ResultRow
from polydraft.decoding.measurement.tables import (
    NOT_PAIRED,
    domain_table,
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


def prompts(*bes: float) -> list[PromptResult]:
    """Per-prompt results with these block efficiencies (new tokens over 100 target calls)."""
    return [PromptResult(new_tokens=round(be * 100), target_calls=100, wall_seconds=1.0) for be in bes]


def test_domain_table_decides_by_the_paired_rule_on_per_prompt_values_not_by_the_runs_spread():
    """The runs' means differ by 1.0 at a pooled std of 0.1 (twice the pooled std said `yes`), but prompt
    by prompt the difference is -1.5 and +3.5: two positions cannot settle it. The other way round: the
    runs' means scatter (pooled std 1.0, the old rule said `no`) while every position's difference is
    +0.2: it holds."""
    inside = [
        row("de-en-test", s, be, 1.0).model_copy(update={"per_prompt": prompts(1.0 + d, 5.0 + d)})
        for s, (be, d) in enumerate([(3.0, 0.0), (3.1, 0.2), (2.9, -0.2)])
    ]
    far = [
        row("fr-en-test", s, be, 0.8).model_copy(update={"per_prompt": prompts(2.5 + d, 1.5 + d)})
        for s, (be, d) in enumerate([(2.0, 0.0), (2.1, 0.2), (1.9, -0.2)])
    ]
    text = domain_table(inside + far)
    assert "| sd[de-en] K=4 | 0 | 3.00 ± 0.10 | 2.00 ± 0.10 | +1.00 [" in text, text
    assert "| within noise (independent prompts, by position) |" in text
    shifted = [
        row("de-en-test", s, be, 1.0).model_copy(
            update={"per_prompt": prompts(*(be + d for d in (-1, 0, 1, 0.5)))}
        )
        for s, be in enumerate([2.0, 3.0, 4.0])
    ]
    below = [
        row("fr-en-test", s, be - 0.2, 0.8).model_copy(
            update={"per_prompt": prompts(*(be - 0.2 + d for d in (-1, 0, 1, 0.5)))}
        )
        for s, be in enumerate([2.0, 3.0, 4.0])
    ]
    text = domain_table(shifted + below)
    assert (
        "| 3.00 ± 1.00 | 2.80 ± 1.00 | +0.20 [+0.20, +0.20] | 0.00 | holds (independent prompts, by position) |"
        in text
    ), text
    # rows without per-prompt values (older results) cannot be paired, and the table says why
    assert f"| - | - | {NOT_PAIRED} |" in domain_table(
        [row("de-en-test", 0, 3.0, 1.0), row("fr-en-test", 0, 2.0, 1.0)]
    )
    assert "| - | - | - |" in domain_table(inside[:1])


def test_rescoring_gain_is_decided_per_prompt_not_per_repetition():
    """A gain of +0.10 in every repetition (steady seed by seed: the old paired column said `yes`) made of
    +1.0 on one prompt and -0.8 on the other: within noise. A gain of +0.10 on every prompt while the
    repetitions scatter (twice the pooled std 0.60: the old unpaired column said `no`): it holds."""

    def blockwise(decoder: str, method: str, seed: int, be: float, per_prompt: list[float]) -> ResultRow:
        rescorer = "de-en" if decoder.endswith("+rescore") else None
        return row("de-en-test", seed, be, 1.0).model_copy(
            update={"decoder": decoder, "method": method, "drafter": "heads", "drafter_kind": "heads",
                    "rescorer": rescorer, "in_domain": None, "per_prompt": prompts(*per_prompt)}
        )  # fmt: skip

    levels = [1.5, 1.8, 2.1]
    alone = [blockwise("bpd", "bpd[heads] K=3", s, be, [be - 0.5, be + 0.5]) for s, be in enumerate(levels)]
    flipping = [
        blockwise("bpd+rescore", "bpd+rescore[de-en] K=3", s, be + 0.1, [be + 0.5, be - 0.3])
        for s, be in enumerate(levels)
    ]
    text = rescoring_table(alone + flipping)
    assert (
        "| bpd+rescore[de-en] K=3 | bpd[heads] K=3 | de-en-test | 0 | 1.90 ± 0.30 | 1.80 ± 0.30 | +0.10 ["
        in text
    )
    assert text.endswith("| within noise (same prompts) |"), text
    steady = [
        blockwise("bpd+rescore", "bpd+rescore[de-en] K=3", s, be + 0.1, [be - 0.4, be + 0.6])
        for s, be in enumerate(levels)
    ]
    assert rescoring_table(alone + steady).endswith("| +0.10 [+0.10, +0.10] | 0.00 | holds (same prompts) |")
    older = [r.model_copy(update={"per_prompt": None}) for r in alone + steady]
    assert rescoring_table(older).endswith(f"| - | - | {NOT_PAIRED} |")
    assert rescoring_table(steady).startswith("No `+rescore` decoder")


def test_the_bar_charts_hold_the_legend_of_a_study_sized_run_without_a_layout_warning(tmp_path):
    import warnings

    from polydraft.decoding.measurement.tables import write_report

    rows = [
        row(dataset, seed, 2.0, 1.5).model_copy(
            update={"method": f"sd[pf_s{i % 2}_x0.25] K={i} beta_ts_literal"}
        )
        for i in range(90)
        for dataset in ("de-en", "fr-en")
        for seed in (0, 1)
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "Tight layout not applied" is a UserWarning
        written = write_report(rows, tmp_path)
    assert (tmp_path / "speedup.png") in written and (tmp_path / "speedup.png").stat().st_size > 0
