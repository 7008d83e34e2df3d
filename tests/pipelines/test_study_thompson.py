"""The study's findings on seed 001's controls in the seed's setting (`pipelines.study.findings_thompson`:
long answers, Table 4's Cali-TS ablations, the literal Beta-TS, 1 vs 2 exit layers) decided on synthetic
result rows by the one paired rule."""

from __future__ import annotations

import numpy as np
import pytest

from polydraft.decoding.measurement.results import PromptResult, ResultRow
from polydraft.pipelines.study.findings_thompson import (
    beta_literal,
    cali_ablations,
    exit_layers_two,
    thompson_long,
)
from polydraft.pipelines.study.model import VariantData, eesd_long_variant, eesd_variant
from tests.export_setup import result_row

REPETITIONS, PROMPTS = 3, 6


def eesd_rows(arms: dict[tuple[str, int | None], tuple[float, int]], seed: int) -> list[ResultRow]:
    """`ar` and `eesd` rows on de-en at T=0: each (control, K) of `arms` decodes its prompts `speedup` times
    faster than `ar`, accepting `accepted` of 10 drafted tokens (10 drafted in the first round)."""
    rng = np.random.default_rng(seed)
    rows = []
    for repetition in range(REPETITIONS):
        walls = 1.0 + rng.uniform(0.0, 1.0, size=PROMPTS)
        ar = [PromptResult(new_tokens=100, target_calls=100, wall_seconds=w) for w in walls]
        rows.append(result_row(decoder="ar", method="ar", drafter=None, seed=repetition, per_prompt=ar))
        for (control, k), (speedup, accepted) in arms.items():
            noisy = walls / speedup * (1 + rng.normal(0.0, 0.01, size=PROMPTS))
            per_prompt = [
                PromptResult(new_tokens=100, target_calls=100 - accepted * 5, wall_seconds=w, drafted=50,
                             accepted=accepted * 5 + int(rng.integers(0, 2)), first_round_drafted=10 if control == "cali_ts" else 3)
                for w in noisy
            ]  # fmt: skip
            rows.append(result_row(
                decoder="eesd", method=f"eesd {control} {k}", control=control, draft_length=k, drafter="early_exit",
                drafter_pair=None, seed=repetition, per_prompt=per_prompt,
            ))  # fmt: skip
    return rows


def long_runs(speedups: dict[str, float]) -> dict[str, VariantData]:
    arms = {(c, 10): (v, 5) for c, v in speedups.items()}
    return {eesd_long_variant(s): VariantData(status="ok", rows=eesd_rows(arms, s)) for s in (0, 1)}


SEED_ORDER = {  # Table 4's order: Cali-TS > w/o model > w/o sampling > Beta-TS > K=10; as read > as written
    "fixed": 1.2,
    "beta_ts": 1.5,
    "beta_ts_literal": 1.4,
    "cali_ts": 1.8,
    "cali_ts_model": 1.6,
    "cali_ts_sampling": 1.7,
}


def test_table_4_in_the_seeds_order_is_reproduced_on_long_answers():
    runs = long_runs(SEED_ORDER)
    preset, cali = thompson_long(runs, cali=False), thompson_long(runs, cali=True)
    assert [c.label for c in preset.checks] == ["de-en, long answers: Beta-TS > fixed K=10"]
    assert preset.verdict == "reproduced" and preset.checks[0].seed_effect == pytest.approx(1.91 - 1.66)
    assert cali.verdict == "reproduced" and cali.checks[0].interval.seeds == 2
    # Cali-TS's first-round cost is shown: 10 of its 50 drafts a prompt, 3 for Beta-TS
    assert "de-en, cali_ts: answers 100.000 ± 0.000 (n=36) tokens; first-round drafts 10.000" in cali.details
    assert "20.0% of all its drafted tokens" in cali.details and "de-en, beta_ts:" in cali.details
    ablations = cali_ablations(runs)
    assert [c.label for c in ablations.checks] == [
        "de-en, long answers: Cali-TS > w/o sampling prediction",
        "de-en, long answers: Cali-TS > w/o model prediction",
        "de-en, long answers: w/o model prediction > w/o sampling prediction",
    ]
    assert ablations.verdict == "reproduced"
    assert ablations.checks[2].seed_effect == pytest.approx(1.88 - 1.82)
    literal = beta_literal(runs)
    assert not literal.seed_claim and literal.checks[0].outcome == "holds"


def test_model_prediction_outweighing_sampling_contradicts_the_seed():
    ablations = cali_ablations(long_runs(SEED_ORDER | {"cali_ts_model": 1.75, "cali_ts_sampling": 1.6}))
    assert {c.label: c.outcome for c in ablations.checks}[
        "de-en, long answers: w/o model prediction > w/o sampling prediction"
    ] == "contradicted"
    assert ablations.verdict == "not reproduced"
    assert thompson_long({}, cali=True).verdict == "not run"


def test_two_exit_layers_raise_hm_and_one_is_as_fast():
    def runs(accepted_two: int, speedup_two: float) -> dict[str, VariantData]:
        out = {}
        for s in (0, 1):
            out[eesd_variant(s)] = VariantData(status="ok", rows=eesd_rows({("beta_ts", 10): (1.5, 5)}, s))
            two = eesd_rows({("beta_ts", 10): (speedup_two, accepted_two)}, s + 10)
            out[eesd_variant(s, exit_layers=2)] = VariantData(status="ok", rows=two)
        return out

    finding = exit_layers_two(runs(accepted_two=7, speedup_two=1.3))
    assert [(c.label, c.outcome) for c in finding.checks] == [
        ("de-en: HM with 2 exit layers > with 1", "holds"),
        ("de-en: speedup with 1 exit layer >= with 2", "consistent"),
    ]
    assert finding.verdict == "consistent"
    worse = exit_layers_two(runs(accepted_two=3, speedup_two=1.3))
    assert worse.checks[0].outcome == "contradicted" and worse.verdict == "not reproduced"
    faster = exit_layers_two(runs(accepted_two=7, speedup_two=1.8))
    assert faster.checks[1].outcome == "contradicted"


def test_self_distillation_against_open_rows_alone():
    from polydraft.pipelines.study.findings_thompson import self_distillation
    from polydraft.pipelines.study.model import eesd_open_variant

    def runs(accepted_open: int, speedup_open: float) -> dict[str, VariantData]:
        out = {}
        for s in (0, 1):
            out[eesd_variant(s)] = VariantData(status="ok", rows=eesd_rows({("beta_ts", 10): (1.5, 6)}, s))
            rows = eesd_rows({("beta_ts", 10): (speedup_open, accepted_open)}, s + 10)
            out[eesd_open_variant(s)] = VariantData(status="ok", rows=rows)
        return out

    finding = self_distillation(runs(accepted_open=4, speedup_open=1.3))
    assert [(c.label, c.outcome) for c in finding.checks] == [
        ("de-en, Beta-TS: speedup with self-distillation > without", "holds"),
        ("de-en, Beta-TS: hm with self-distillation > without", "holds"),
    ]
    assert finding.verdict == "reproduced" and finding.checks[0].seed_effect == pytest.approx(1.91 - 1.82)
    assert "w/o Self-Distillation 1.82×" in finding.seed_numbers
    assert self_distillation(runs(accepted_open=6, speedup_open=1.8)).verdict == "not reproduced"


def test_the_open_only_mix_keeps_the_recipes_row_count():
    from pathlib import Path

    from polydraft.pipelines.run.recipe import load_recipe
    from polydraft.pipelines.study.model import eesd_open_variant
    from polydraft.pipelines.study.variants import variants

    study = Path(__file__).resolve().parents[2] / "recipes" / "demo" / "study.yaml"
    base = load_recipe(study, [])
    variant = {v.name: v for v in variants(base, Path("runs/study"))}[eesd_open_variant(1)]
    assert variant.full and variant.skip is None
    recipe = load_recipe(study, list(variant.overrides))
    assert {s.limit for s in recipe.data.distill} == {1} and {s.limit for s in base.data.distill} == {400}
    temperatures = len(base.distill.temperatures)
    rows = 400 * temperatures * (1 + base.distill.open_fraction)  # distilled + open rows a pair
    assert 1 * temperatures * (1 + recipe.distill.open_fraction) == pytest.approx(rows)
    assert (
        recipe.early_exit.loop.seed == base.early_exit.loop.seed + 1
        and recipe.early_exit.num_exit_layers == 1
    )
