"""The study's headline findings (`pipelines.study.findings_headline`: seed 001 Tables 1-3, seed 002 Exp1
at draft lengths 2-5) decided on synthetic result rows by the one paired rule."""

from __future__ import annotations

import numpy as np
import pytest

from polydraft.decoding.measurement.results import PromptResult, ResultRow
from polydraft.pipelines.study.findings_headline import eesd_vs_baselines, trees_lengths
from polydraft.pipelines.study.model import (
    DEPTHS_COMPARE,
    HEADLINE_K,
    LENGTH_TREES,
    TREES_LENGTHS,
    VariantData,
    headline_variant,
    sd_medusa_variant,
    tree_length,
)
from tests.export_setup import result_row

REPETITIONS, PROMPTS = 3, 6


def speed_rows(speedups: dict[tuple, float], seed: int) -> list[ResultRow]:
    """`ar` and one row per (decoder, control, K) of `speedups` for each repetition of 6 prompts on de-en,
    each prompt decoded `speedups[...]` times faster than `ar`'s, give or take 1%."""
    rng = np.random.default_rng(seed)
    rows = []
    for repetition in range(REPETITIONS):
        walls = 1.0 + rng.uniform(0.0, 1.0, size=PROMPTS)
        ar = [PromptResult(new_tokens=10, target_calls=10, wall_seconds=w) for w in walls]
        rows.append(result_row(decoder="ar", method="ar", drafter=None, seed=repetition, per_prompt=ar))
        for (decoder, control, k), speedup in speedups.items():
            noisy = walls / speedup * (1 + rng.normal(0.0, 0.01, size=PROMPTS))
            per_prompt = [
                PromptResult(new_tokens=10, target_calls=4, wall_seconds=w, drafted=12, accepted=6)
                for w in noisy
            ]
            drafter = {"eesd": "early_exit", "medusa": "heads"}.get(decoder, "de-en")
            rows.append(result_row(
                decoder=decoder, method=f"{decoder} {control} {k}", control=control, draft_length=k,
                drafter=drafter, seed=repetition, per_prompt=per_prompt,
            ))  # fmt: skip
    return rows


def headline_runs(medusa: float) -> dict[str, VariantData]:
    speedups = {
        ("eesd", "beta_ts", 10): 1.5,
        ("eesd", "cali_ts", 10): 1.6,
        ("eesd", "fixed", 10): 1.1,
        ("sd", "fixed", HEADLINE_K): 1.2,
        ("sd", "fixed", 3): 1.9,  # another K of sd: not the seed's K=10, must not enter its arm
        ("medusa", None, None): medusa,
    }
    return {headline_variant(s): VariantData(status="ok", rows=speed_rows(speedups, s)) for s in (0, 1)}


def test_eesd_beats_sd_at_k10_and_medusa_per_prompt_over_both_training_seeds():
    finding = eesd_vs_baselines(headline_runs(medusa=1.3))
    assert finding.verdict == "reproduced", finding.reason
    assert [c.label for c in finding.checks] == [
        "de-en, T=0: EESD (Beta-TS) > SD K=10",
        "de-en, T=0: EESD (Beta-TS) > Medusa",
        "de-en, T=0: EESD (Cali-TS) > SD K=10",
        "de-en, T=0: EESD (Cali-TS) > Medusa",
    ]
    first = finding.checks[0]
    assert first.interval is not None and first.interval.seeds == 2
    assert first.interval.prompts == 2 * REPETITIONS * PROMPTS  # paired by training seed and prompt
    assert first.interval.mean == pytest.approx(1.5 - 1.2, abs=0.03)  # K=10's arm, not K=3's
    assert first.seed_effect == pytest.approx(1.57 - 1.28)
    assert "Self-SD" in finding.details and "HM" in finding.details
    assert "Table 1" in finding.seed_numbers and "0.005" in finding.seed_numbers


def test_a_faster_medusa_contradicts_the_seed_and_a_missing_run_is_not_run():
    finding = eesd_vs_baselines(headline_runs(medusa=1.8))
    outcomes = {c.label: c.outcome for c in finding.checks}
    assert outcomes["de-en, T=0: EESD (Beta-TS) > Medusa"] == "contradicted"
    assert outcomes["de-en, T=0: EESD (Cali-TS) > SD K=10"] == "holds"
    assert finding.verdict == "not reproduced"
    runs = headline_runs(medusa=1.3)
    del runs[headline_variant(1)]
    missing = eesd_vs_baselines(runs)
    assert missing.verdict == "not run" and headline_variant(1) in missing.reason


def test_tree_length_is_a_chains_k_or_a_trees_depth():
    assert tree_length("sd", None, 4) == 4
    assert tree_length("rsd_c", "12-1-1-1-1", None) == 5
    assert tree_length("rsd_s", "7x4", None) == 4
    assert tree_length("rsd_c", None, None) is None


def length_rows(worse_c_at: int | None = None) -> list[ResultRow]:
    """Exp1 rows at T=0.3 on de-en: per draft length L, SD K=L, seed 002's RSD-C and RSD-S trees; block
    efficiency (and MBSU) SD 1 + 0.1 L, each RSD-C tree 0.2 above, each RSD-S tree 0.4 above (its second
    tree best); token rates SD 10, RSD-S 11; `worse_c_at`: RSD-C below SD at that L."""
    rng = np.random.default_rng(1)
    rows = []

    def arm(decoder: str, be: float, rate: float, **fields: object) -> None:
        for repetition in range(REPETITIONS):
            bes = be + rng.normal(0.0, 0.01, size=PROMPTS)
            per_prompt = [
                PromptResult(
                    new_tokens=round(1000 * b), target_calls=1000, wall_seconds=round(1000 * b) / rate
                )
                for b in bes
            ]
            rows.append(result_row(
                decoder=decoder, method=f"{decoder} {fields}", temperature=0.3, seed=repetition,
                per_prompt=per_prompt, block_efficiency=be, mbsu=be, **fields,
            ))  # fmt: skip

    for length, (c_trees, s_trees) in LENGTH_TREES.items():
        sd = 1 + 0.1 * length
        arm("sd", sd, 10.0, control="fixed", draft_length=length, tree=None)
        for i, b in enumerate(c_trees):
            gain = -0.3 if length == worse_c_at else 0.2
            arm(
                "rsd_c",
                sd + gain + 0.01 * i,
                9.0,
                control=None,
                draft_length=None,
                tree="-".join(map(str, b)),
            )
        for i, (w, d) in enumerate(s_trees):
            arm("rsd_s", sd + 0.4 + 0.05 * i, 11.0 + i, control=None, draft_length=None, tree=f"{w}x{d}")
    ar = [PromptResult(new_tokens=10, target_calls=10, wall_seconds=1.0)] * PROMPTS
    rows += [
        result_row(decoder="ar", method="ar", drafter=None, temperature=0.3, seed=r, per_prompt=ar)
        for r in range(3)
    ]
    return rows


def test_trees_beat_sd_at_every_draft_length_with_the_best_tree_per_length():
    finding = trees_lengths({TREES_LENGTHS: VariantData(status="ok", rows=length_rows())}, ["de-en"])
    assert finding.verdict == "reproduced", finding.reason
    # per L: RSD-C in block efficiency and MBSU, RSD-S in those and token rate (RSD-C's rate is no claim)
    assert len(finding.checks) == 5 * len(LENGTH_TREES)
    labels = [c.label for c in finding.checks]
    assert "de-en, T=0.3, L=5: block efficiency RSD-S (12x5) > SD (K=5)" in labels  # the best of 6x5, 12x5
    assert "de-en, T=0.3, L=2: MBSU RSD-C (3-1) > SD (K=2)" in labels  # the best of 2-2, 2-1, 3-1
    assert not any("token rate RSD-C" in label for label in labels)
    effect = {c.label: c.seed_effect for c in finding.checks}
    assert effect["de-en, T=0.3, L=5: block efficiency RSD-S (12x5) > SD (K=5)"] == pytest.approx(
        2.650 - 1.917
    )
    assert effect["de-en, T=0.3, L=3: token rate RSD-S (4x3) > SD (K=3)"] is None
    assert finding.panels and {s.label for s in finding.panels[0].series} == {
        "sd (de-en)", "rsd_c (de-en)", "rsd_s (de-en)"
    }  # fmt: skip


def test_trees_worse_than_sd_at_one_length_contradict_the_seed():
    finding = trees_lengths(
        {TREES_LENGTHS: VariantData(status="ok", rows=length_rows(worse_c_at=4))}, ["de-en"]
    )
    contradicted = [c.label for c in finding.checks if c.outcome == "contradicted"]
    assert contradicted == [
        "de-en, T=0.3, L=4: block efficiency RSD-C (7-1-1-1) > SD (K=4)",
        "de-en, T=0.3, L=4: MBSU RSD-C (7-1-1-1) > SD (K=4)",
    ]
    assert finding.verdict == "not reproduced"


def test_the_headline_variants_run_in_study_full_only_with_every_stage_seeded():
    from pathlib import Path

    from polydraft.pipelines.run.recipe import load_recipe
    from polydraft.pipelines.study.run import FULL, chosen
    from polydraft.pipelines.study.variants import variants

    recipe = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "demo" / "study.yaml", [])
    plan = {v.name: v for v in variants(recipe, Path("runs/study"))}
    full = sorted(name for name, v in plan.items() if v.full)
    assert full == sorted([
        *(f(s) for f in (headline_variant, sd_medusa_variant) for s in (0, 1)), TREES_LENGTHS,
        "pf_depth2_s0", "pf_depth3_s0", "pf_depth2_s1", "pf_depth3_s1", DEPTHS_COMPARE,
        "eesd_long_s0", "eesd_long_s1", "eesd_2layers_s0", "eesd_2layers_s1", "domain_io",
        "eesd_open_only_s0", "eesd_open_only_s1",
    ])  # fmt: skip
    # Thompson sampling in the seed's setting: long answers, Table 4's rows, the heads of eesd_s* (same stages)
    long = plan["eesd_long_s1"].overrides
    assert "entries_per_sample: [14, 16]" in next(o for o in long if o.startswith("data.eval="))
    measure = next(o for o in long if o.startswith("measure="))
    assert "max_new_tokens: 160" in measure and "eesd_draft_length: 10" in measure
    assert "controls: [fixed, beta_ts, beta_ts_literal, cali_ts, cali_ts_model, cali_ts_sampling]" in measure
    same = [o for o in plan["eesd_s1"].overrides if o.startswith(("early_exit", "calibrate"))]
    assert all(o in long for o in same)
    assert "early_exit.num_exit_layers=2" in plan["eesd_2layers_s0"].overrides
    assert "pretrain.drafter.num_layers=3" in plan["pf_depth3_s1"].overrides
    depths = next(o for o in plan[DEPTHS_COMPARE].overrides if o.startswith("measure="))
    assert "d1_s1_de-en: " + str(Path("runs/study").absolute() / "pf_s1_x1" / "finetune" / "de-en") in depths
    assert (
        "d3_s0_fr-en: " + str(Path("runs/study").absolute() / "pf_depth3_s0" / "finetune" / "fr-en") in depths
    )
    standard, headline = plan["trees"], plan[headline_variant(1)]
    assert chosen(standard, [], quick=False) and not chosen(headline, [], quick=False)  # `make study`
    assert chosen(headline, [FULL], quick=False) and chosen(
        standard, [FULL], quick=False
    )  # `make study-full`
    assert chosen(headline, [], quick=True) and chosen(headline, [headline.name], quick=False)
    assert not chosen(headline, ["trees"], quick=False)
    # every decoder of the headline run trained with the same training seed, sd at the seed's K=10
    for stage in ("pretrain", "finetune", "early_exit", "heads"):
        seed = getattr(recipe, stage).loop.seed + 1
        assert f"{stage}.loop.seed={seed}" in headline.overrides, stage
    measure = next(o for o in headline.overrides if o.startswith("measure="))
    assert "decoders: [ar, sd, eesd, medusa]" in measure and "draft_length: 10" in measure
    assert "cali_ts" in measure and "beta_ts" in measure
    trees = next(o for o in plan[TREES_LENGTHS].overrides if o.startswith("measure="))
    for c_trees, s_trees in LENGTH_TREES.values():
        assert all(str(b) in trees for b in c_trees) and all(str(t) in trees for t in s_trees)


def test_the_pf_drafter_beats_medusa_per_prompt_at_both_temperatures():
    from polydraft.pipelines.study.findings_headline import sd_vs_medusa

    def runs(medusa: float) -> dict[str, VariantData]:
        out = {}
        for seed in (0, 1):
            rows = []
            for t in (0.0, 1.0):
                speedups = {("sd", "fixed", 4): 1.5, ("sd", "fixed", 10): 0.5, ("medusa", None, None): medusa}
                rows += [r.model_copy(update={"temperature": t}) for r in speed_rows(speedups, seed)]
            out[sd_medusa_variant(seed)] = VariantData(status="ok", rows=rows)
        return out

    finding = sd_vs_medusa(runs(medusa=1.2), k=4)
    assert [c.label for c in finding.checks] == [
        "de-en, T=0: sd (P-F drafter, K=4) > Medusa",
        "de-en, T=1: sd (P-F drafter, K=4) > Medusa",
    ]
    assert finding.verdict == "reproduced", finding.reason
    assert finding.checks[0].interval.mean == pytest.approx(0.3, abs=0.03)  # K=4's arm, not K=10's
    assert finding.checks[0].seed_effect == pytest.approx(2.42 - 1.58)
    assert finding.checks[1].seed_effect == pytest.approx(1.99 - 1.61)
    assert sd_vs_medusa(runs(medusa=1.8), k=4).verdict == "not reproduced"


def depth_rows(speedups: list[float], efficiency: list[float]) -> list[ResultRow]:
    """The drafter-size run: `ar` and `sd` K=4 with the drafters of depths 1, 2, 3 of both training seeds on
    de-en, each depth's prompts `speedups[i]` faster than `ar`'s with block efficiency `efficiency[i]`."""
    from polydraft.pipelines.study.model import drafter_name

    rng = np.random.default_rng(2)
    rows = []
    for repetition in range(REPETITIONS):
        walls = 1.0 + rng.uniform(0.0, 1.0, size=PROMPTS)
        ar = [PromptResult(new_tokens=100, target_calls=100, wall_seconds=w) for w in walls]
        rows.append(result_row(decoder="ar", method="ar", drafter=None, seed=repetition, per_prompt=ar))
        for seed in (0, 1):
            for depth, speedup, be in zip((1, 2, 3), speedups, efficiency):
                calls = [round(100 / (be + rng.normal(0.0, 0.02))) for _ in walls]
                noisy = walls / speedup * (1 + rng.normal(0.0, 0.01, size=PROMPTS))
                per_prompt = [
                    PromptResult(new_tokens=100, target_calls=c, wall_seconds=w) for c, w in zip(calls, noisy)
                ]
                name = drafter_name(f"d{depth}", seed, None, "de-en")
                rows.append(result_row(method=name, drafter=name, seed=repetition, per_prompt=per_prompt))
    return rows


def test_a_deeper_drafter_gives_less_speedup_for_as_many_tokens():
    from polydraft.pipelines.study.findings_headline import drafter_size
    from polydraft.pipelines.study.model import depth_variant

    def runs(speedups: list[float], efficiency: list[float]) -> dict[str, VariantData]:
        out = {depth_variant(s, d, 1): VariantData(status="ok") for s in (0, 1) for d in (1, 2, 3)}
        out[DEPTHS_COMPARE] = VariantData(status="ok", rows=depth_rows(speedups, efficiency))
        return out

    finding = drafter_size(runs([1.4, 1.1, 0.9], [2.0, 2.05, 2.1]), k=4, pairs=["de-en"], recipe_depth=1)
    assert [(c.label, c.claim, c.outcome) for c in finding.checks] == [
        ("de-en, T=0: speedup 1 layer(s) > 2 layers", ">", "holds"),
        ("de-en, T=0: speedup 1 layer(s) > 3 layers", ">", "holds"),
        ("de-en, T=0: block efficiency 3 layers >= 1 layer(s)", ">=", "consistent"),
    ]
    assert finding.verdict == "consistent"  # the block-efficiency half can only be consistent
    assert (
        finding.checks[1].seed_effect == pytest.approx(2.42 - 0.75) and finding.checks[0].seed_effect is None
    )
    assert finding.checks[0].interval.seeds == 2
    # a deeper drafter that is faster contradicts the seed; one that accepts fewer tokens too
    faster = drafter_size(runs([1.0, 1.1, 1.3], [2.0, 2.05, 2.1]), k=4, pairs=["de-en"], recipe_depth=1)
    assert faster.verdict == "not reproduced" and faster.checks[1].outcome == "contradicted"
    fewer = drafter_size(runs([1.4, 1.1, 0.9], [2.4, 2.0, 1.6]), k=4, pairs=["de-en"], recipe_depth=1)
    assert fewer.checks[2].outcome == "contradicted"
    missing = drafter_size({}, k=4, pairs=["de-en"], recipe_depth=1)
    assert missing.verdict == "not run" and "pf_depth2_s0" in missing.reason


def test_the_input_language_matters_more_than_the_output_language():
    from polydraft.pipelines.study.findings_drafters import input_domain
    from polydraft.pipelines.study.model import DOMAIN_IO, drafter_name

    def runs(speedups: dict[str, float]) -> dict[str, VariantData]:
        rows = []
        for pair, speedup in speedups.items():
            for seed in (0, 1):
                name = drafter_name("pf", seed, 1.0, "de-en")
                arm = speed_rows({("sd", "fixed", 4): speedup}, seed)
                rows += [
                    r.model_copy(update={"dataset": pair, "dataset_pair": pair, "drafter": name if r.decoder == "sd" else None,
                                         "in_domain": pair == "de-en" if r.decoder == "sd" else None})
                    for r in arm
                    if r.decoder == "sd" or seed == 0  # one ar row per group
                ]  # fmt: skip
        return {DOMAIN_IO: VariantData(status="ok", rows=rows)}

    finding = input_domain(runs({"de-en": 1.6, "de-fr": 1.4, "fr-en": 1.1, "en-de": 0.9}), k=4)
    assert [(c.label, c.outcome) for c in finding.checks] == [
        ("drafter de-en, T=0: on de-fr (input shared) > on fr-en (output shared)", "holds"),
        ("drafter de-en, T=0: on de-fr (input shared) > on en-de (neither shared)", "holds"),
    ]
    assert finding.verdict == "reproduced" and "en-de 0.9" in finding.details
    assert finding.checks[0].interval.seeds == 2
    output_first = input_domain(runs({"de-en": 1.6, "de-fr": 1.0, "fr-en": 1.3, "en-de": 0.9}), k=4)
    assert output_first.checks[0].outcome == "contradicted" and output_first.verdict == "not reproduced"


def test_the_domain_run_adds_de_fr_and_en_de_to_the_recipes_pairs():
    from pathlib import Path

    from polydraft.pipelines.run.recipe import load_recipe
    from polydraft.pipelines.study.model import DOMAIN_IO
    from polydraft.pipelines.study.variants import variants

    study = Path(__file__).resolve().parents[2] / "recipes" / "demo" / "study.yaml"
    plan = {v.name: v for v in variants(load_recipe(study, []), Path("runs/study"))}
    variant = plan[DOMAIN_IO]
    assert variant.full and variant.skip is None
    recipe = load_recipe(study, list(variant.overrides))  # a valid recipe: the pairs cover the eval sets
    assert [s.pair for s in recipe.data.eval] == ["de-en", "fr-en", "de-fr", "en-de"]
    assert recipe.measure.cross_pairs and not recipe.finetune.enabled
    assert set(recipe.measure.extra_drafters) == {"pf_s0_x1_de-en", "pf_s1_x1_de-en"}
