"""`polydraft study`: the report's structure on a `--quick` study of the study recipe (not its verdicts,
which tiny models cannot support), the sharing of stages between variants, and the verdict rule."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from polydraft.decoding.measurement.results import PromptResult, ResultRow
from polydraft.pipelines.cli.main import main
from polydraft.pipelines.schema.inputs import stage_manifests
from polydraft.pipelines.study.arms import prompt_values
from polydraft.pipelines.study.findings import all_findings, sanity_checks
from polydraft.pipelines.study.fits import held_out_errors, shape_fits
from polydraft.pipelines.study.model import (
    DEPTH_FACTORS,
    HEADS,
    PF_BUDGETS,
    Finding,
    VariantData,
    pf_variant,
    tree_budget,
)
from polydraft.pipelines.study.report import checks_table, headline, summary_table, tally
from polydraft.pipelines.study.verdicts import (
    VERDICTS,
    Check,
    compare,
    counts,
    sanity_verdict,
    verdict_of,
)
from tests.export_setup import result_row

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "recipes" / "demo" / "study.yaml"  # the demo recipe with the study's measure settings
FINDINGS = [  # the seeds' findings by seed, then those counted apart; written here so that dropping one fails
    "pf_over_p",
    "pf_over_f",
    "in_domain",
    "input_domain",
    "finetune_tokens",
    "pf_over_medusa",
    "drafter_size",
    "eesd_headline",
    "exit_layer",
    "exit_layers_two",
    "self_distillation",
    "shared_layers",
    "thompson_eesd_preset",
    "thompson_eesd_cali",
    "thompson_eesd_best",
    "thompson_long_preset",
    "thompson_long_cali",
    "cali_ablations",
    "thompson_standalone_preset",
    "trees",
    "trees_lengths",
    "rsd_budget",
    "rescoring_efficiency",
    "rescoring_speedup",
    "rsd_budget_low",
    "pf_over_p_budgets",
    "thompson_standalone_best",
    "beta_ts_literal",
    "distill_temperatures",
]
SIDE_REMARKS = {"rsd_budget_low"}
NOT_SEED_CLAIMS = {"pf_over_p_budgets", "thompson_standalone_best", "beta_ts_literal", "distill_temperatures"}
SANITY = ["lossless"]  # reported apart: it cannot come out otherwise, so it is no finding
NUMBER = r"-?\d+\.\d+ ± \d+\.\d+ \(n=(\d+)\)"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    study_dir = tmp_path_factory.mktemp("study")
    assert main(["study", str(DEMO), "--quick", "--study-dir", str(study_dir), "--quiet"]) == 0
    return study_dir


def summary_rows(report: str) -> list[list[str]]:
    """The cells of the summary table's rows (a `\\|` inside a cell is not a separator)."""
    table = report.split("## Summary")[1].split("## The rule")[0]
    rows = [line for line in table.strip().splitlines() if re.match(r"\| \d+ \|", line)]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows]


def test_the_report_has_every_finding_with_a_verdict_and_numbers_with_std_and_n(quick):
    report = (quick / "report.md").read_text()
    rows = summary_rows(report)
    keys = [re.match(r"`(\w+)`", row[1]).group(1) for row in rows]
    assert keys == FINDINGS + SANITY
    assert re.search(
        r"Of the seeds' 24 findings: \d+ reproduced, \d+ consistent,.*counted apart \(5:", report
    )
    assert report.startswith(
        f"# polydraft study: {headline(json.loads((quick / 'study.json').read_text())['findings'])}"
    )
    for number, key, (_, title, seed, measured, checked, verdict, reason) in zip(
        range(1, len(keys) + 1), keys, rows
    ):
        assert ("not a seed claim" in title) == (key in NOT_SEED_CLAIMS), key
        assert ("side remark" in title) == (key in SIDE_REMARKS), key
        assert re.fullmatch(r"\d+ / \d+ / \d+", checked), (key, checked)
        allowed = ("passed",) if key in SANITY else [v for v in VERDICTS if v != "not run"]
        assert verdict.strip("*") in allowed, (key, verdict)
        assert reason and "seed" in seed, key
        ns = [int(n) for n in re.findall(NUMBER, measured)]
        assert ns and min(ns) >= 3, (key, measured)  # >= 3 prompts behind every number
        trained = key not in {"trees", "trees_lengths", "rsd_budget", "rsd_budget_low", "rescoring_efficiency", "rescoring_speedup", "lossless"}  # fmt: skip
        assert not trained or ns[0] >= 12, (key, measured)  # 2 training seeds x 3 repetitions x 2 prompts
        section = report.split(f"### {number}. ")[1].split("\n### ")[0]
        assert f"(`{key}`)" in section and "**Verdict:" in section and "| check |" in section
        plot = re.search(r"!\[\w+\]\((plots/\w+\.png)\)", section)
        assert plot and (quick / plot.group(1)).stat().st_size > 1000, key
    study = json.loads((quick / "study.json").read_text())
    assert [f["key"] for f in study["findings"]] == FINDINGS
    assert [f["key"] for f in study["sanity_checks"]] == SANITY
    assert all(f["checks"] for f in study["findings"] + study["sanity_checks"])
    assert report.index("## Sanity checks") > report.index(
        f"### {len(FINDINGS)}. "
    )  # after the findings, apart
    checks = [c for f in study["findings"] for c in f["checks"]]
    assert any(c["interval"] and c["first_values"] and c["second_values"] for c in checks)
    assert {"seed", "repetition", "prompt", "value"} == set(checks[0]["first_values"][0])
    claims = report.split("## Finding → seed claim")[1].split("## The rule")[0]
    assert all(f"| `{key}` |" in claims for key in FINDINGS)
    assert {v["status"] for v in study["variants"]} == {"ok"}


def test_variants_share_identical_stages_and_a_rerun_runs_nothing(quick):
    variants = json.loads((quick / "study.json").read_text())["variants"]
    made = [stage for v in variants for stage in v["made"]]
    # the recipe's distillation once (+ the two of the temperature item and the open-only mix of make
    # study-full's self-distillation ablation), a pretrain per training seed and drafter depth (its
    # drafter-size item)
    assert made.count("distill") == 4 and made.count("pretrain") == 2 * len(DEPTH_FACTORS)
    assert sum(v["shared"].get("distill") == pf_variant(0, PF_BUDGETS[0]) for v in variants) >= 20
    assert all(v["ran"] == list(v["made"]) for v in variants)
    # only the trained variants train drafters: the others reuse theirs (the heads' rescorers included)
    trained = [v["name"] for v in variants if "finetune" in v["made"]]
    assert trained and all(name.startswith(("pf_", "f_", "temps")) for name in trained), trained
    assert main(["study", str(DEMO), "--quick", "--study-dir", str(quick), "--quiet"]) == 0
    again = json.loads((quick / "study.json").read_text())["variants"]
    assert [v["ran"] for v in again] == [[]] * len(variants)
    assert [v["made"] for v in again] == [v["made"] for v in variants]  # the accounting reads manifests


def test_only_runs_one_variant_and_reads_the_others_where_up_to_date(quick):
    (quick / "heads" / "measure" / "manifest.json").unlink()  # its measure is no longer complete
    assert main(["study", str(DEMO), "--quick", "--study-dir", str(quick), "--only", "trees", "--quiet"]) == 0
    study = json.loads((quick / "study.json").read_text())
    status = {v["name"]: v["status"] for v in study["variants"]}
    assert status["trees"] == "ok" and status["pf_s0_x1"] == "ok"
    assert status["heads"].startswith("not run: not in --only, and measure not up to date")
    findings = {f["key"]: f for f in study["findings"]}
    for key in ("rescoring_efficiency", "rescoring_speedup"):
        assert findings[key]["verdict"] == "not run" and "`heads` not run" in findings[key]["reason"]
    assert findings["trees"]["verdict"] != "not run"
    assert main(["study", str(DEMO), "--quick", "--study-dir", str(quick), "--only", "nope", "--quiet"]) == 2


# ----------------------------------------------------------------------------- the rule, on result rows


def rows_of_arm(decoder: str, values: list[list[float]], **fields: object) -> list[ResultRow]:
    """One row per repetition whose prompts have these block efficiencies (new tokens / target calls)."""
    return [
        result_row(
            decoder=decoder, method=decoder, seed=repetition, temperature=0.0,
            per_prompt=[PromptResult(new_tokens=round(1000 * v), target_calls=1000, wall_seconds=1.0) for v in prompts],
            **fields,
        )
        for repetition, prompts in enumerate(values)
    ]  # fmt: skip


def study_prompts(effect: float, seed: int = 0) -> tuple[list[list[float]], list[list[float]]]:
    """Arm A and arm B per repetition and prompt at the study's n (3 x 6): prompts spread 0.3 between
    them, A = B + `effect` + decoding noise (0.02)."""
    rng = np.random.default_rng(seed)
    b = 2.0 + rng.normal(0.0, 0.3, size=(3, 6))
    a = b + effect + rng.normal(0.0, 0.02, size=(3, 6))
    return a.round(3).tolist(), b.round(3).tolist()


def check_of(a: list[list[float]], b: list[list[float]], claim=">") -> Check:
    rows = rows_of_arm("rsd_s", a, tree="3x3") + rows_of_arm("sd", b, draft_length=3)
    first = {0: prompt_values(rows, "block_efficiency", decoder="rsd_s")}
    second = {0: prompt_values(rows, "block_efficiency", decoder="sd", draft_length=3)}
    return compare("x", claim, "A", first, "B", second, seed_effect=0.29)


def test_a_known_paired_effect_holds_its_reverse_is_contradicted_and_none_is_open_with_its_detectable():
    a, b = study_prompts(0.1)
    holds = check_of(a, b)
    assert holds.outcome == "holds" and holds.interval is not None and holds.interval.low > 0
    assert holds.interval.mean == pytest.approx(0.1, abs=0.01) and holds.interval.prompts == 18
    assert [(v.seed, v.repetition, v.prompt) for v in holds.first_values][:7] == [
        (0, 0, p) for p in range(6)
    ] + [(0, 1, 0)]
    assert [v.value for v in holds.first_values] == pytest.approx([v for r in a for v in r])
    assert [v.value for v in holds.second_values] == pytest.approx([v for r in b for v in r])
    assert check_of(b, a).outcome == "contradicted"
    a, b = study_prompts(0.0)
    none = check_of(a, b)
    assert none.outcome == "within noise" and none.interval is not None
    assert 0 < none.interval.detectable < 0.05  # paired: the prompts' spread (0.3) cancels
    verdict, reason = verdict_of([holds, none])
    assert verdict == "inconclusive"
    assert f"detectable {none.interval.detectable:.3f}; the seed's effect +0.290" in reason
    assert (
        check_of(a, b, ">=").outcome == "consistent" and verdict_of([check_of(a, b, ">=")])[0] == "consistent"
    )
    assert check_of(a[:1], [b[0][:1]]).outcome == "too few prompts"  # 1 paired prompt: no interval


def test_the_paired_rule_finds_an_effect_the_old_cutoff_called_noise():
    # arms whose repetition means differ by 0.1 against a spread of 0.3 between prompts: twice the pooled std
    # of the means (the old rule) is about 0.25, while the paired differences spread only 0.02
    a, b = study_prompts(0.1, seed=3)
    means_a, means_b = np.mean(a, axis=1), np.mean(b, axis=1)
    pooled = np.sqrt((np.var(means_a, ddof=1) + np.var(means_b, ddof=1)) / 2)
    assert np.mean(means_a) - np.mean(means_b) < 2 * pooled
    assert check_of(a, b).outcome == "holds"


def test_per_prompt_speedup_is_ars_wall_time_over_the_methods_on_the_same_prompt():
    def row(decoder: str, walls: list[float]) -> ResultRow:
        per_prompt = [PromptResult(new_tokens=10, target_calls=5, wall_seconds=w) for w in walls]
        return result_row(decoder=decoder, method=decoder, seed=0, per_prompt=per_prompt)

    rows = [row("ar", [2.0, 3.0]), row("sd", [1.0, 2.0])]
    assert prompt_values(rows, "speedup", decoder="sd") == {(0, 0): 2.0, (0, 1): 1.5}
    assert prompt_values(rows, "block_efficiency", decoder="sd") == {(0, 0): 2.0, (0, 1): 2.0}
    with pytest.raises(ValueError, match="not one arm"):
        prompt_values(rows + [row("sd", [1.0, 1.0])], "speedup", decoder="sd")


def test_a_finding_is_reproduced_only_when_every_check_is_strict_and_holds():
    a, b = study_prompts(0.1)
    holds, against, within = check_of(a, b), check_of(b, a), check_of(*study_prompts(0.0))
    merely = check_of(a, b, ">=")
    assert verdict_of([holds, holds])[0] == "reproduced"
    assert verdict_of([holds, merely])[0] == "consistent" and verdict_of([merely])[0] == "consistent"
    assert "1 of 2 checks are non-strict" in verdict_of([holds, merely])[1]
    assert verdict_of([merely, within])[0] == "inconclusive"  # an open check outranks a consistent one
    assert "1 of 2 checks open" in verdict_of([holds, within])[1]
    assert verdict_of([holds, within, against])[0] == "not reproduced"
    assert counts([holds, within, against, merely]) == (2, 1, 1)
    assert verdict_of([])[0] == "not run"


def eesd_rows(speedups: dict[str, float]) -> list[ResultRow]:
    """`ar` and `eesd` rows of 3 repetitions x 6 prompts; each control's prompts decoded `speedups[control]`
    times faster than `ar`'s, give or take 1% per prompt."""
    rng = np.random.default_rng(0)
    rows = []
    for repetition in range(3):
        walls = 1.0 + rng.uniform(0.0, 1.0, size=6)
        ar = [PromptResult(new_tokens=10, target_calls=10, wall_seconds=w) for w in walls]
        rows.append(result_row(decoder="ar", method="ar", seed=repetition, per_prompt=ar))
        for control, speedup in speedups.items():
            k = 2 if control == "fixed" else None
            noisy = walls / speedup * (1 + rng.normal(0.0, 0.01, size=6))
            per_prompt = [PromptResult(new_tokens=10, target_calls=5, wall_seconds=w) for w in noisy]
            rows.append(result_row(decoder="eesd", method=control, control=control, draft_length=k,
                                   seed=repetition, per_prompt=per_prompt))  # fmt: skip
    return rows


def test_every_check_of_the_seeds_findings_is_a_strict_claim_on_per_prompt_values():
    def rows(decoder: str, start: float, **fields: object) -> list:
        return rows_of_arm(decoder, [[start + 0.1 * s] * 6 for s in range(3)], **fields)

    measured = rows("rsd_s", 2.0, control=None, draft_length=None, tree="3x3")
    measured += rows("rsd_c", 1.5, control=None, draft_length=None, tree="2-2-2")
    measured += rows("sd", 1.0, control="fixed", draft_length=3)
    runs = {
        "trees": VariantData(status="ok", rows=[r.model_copy(update={"temperature": 0.3}) for r in measured])
    }
    eesd = eesd_rows({"fixed": 1.2, "beta_ts": 1.2, "cali_ts": 1.5})
    runs |= {f"eesd_s{s}": VariantData(status="ok", rows=eesd) for s in (0, 1)}  # two training seeds
    findings = {f.key: f for f in all_findings(runs, 2, ["de-en"], 1)}
    for key in ("trees", "thompson_eesd_best", "thompson_eesd_cali"):
        assert findings[key].checks and {c.claim for c in findings[key].checks} == {">"}, key
    best = findings["thompson_eesd_best"].checks
    assert [c.outcome for c in best] == ["within noise"] and best[0].a.n == 36  # 2 seeds x 3 x 6 prompts
    assert findings["thompson_eesd_best"].verdict == "inconclusive"
    (cali,) = findings["thompson_eesd_cali"].checks
    assert cali.outcome == "holds" and cali.interval.mean == pytest.approx(0.3, abs=0.02)
    assert cali.seed_effect == pytest.approx(0.13) and findings["thompson_eesd_cali"].verdict == "reproduced"
    assert findings["trees"].verdict == "reproduced"


def test_lossless_is_a_sanity_check_apart_from_the_findings():
    def rows(matches: list[bool]) -> list:
        return [
            result_row(decoder="sd", temperature=0.0, seed=s, matches_ar=m) for s, m in enumerate(matches)
        ]

    runs = {"pf": VariantData(status="ok", rows=rows([True, True, True]))}
    assert "lossless" not in {f.key for f in all_findings(runs, 4, ["de-en"], 1)}
    (check,) = sanity_checks(runs)
    assert check.sanity and check.verdict == "passed" and check.checks[0].claim == "=="
    runs["pf"] = VariantData(status="ok", rows=rows([True, False, True]))
    (broken,) = sanity_checks(runs)
    assert broken.verdict == "failed" and "sd: output identical to ar at T=0 (contradicted)" in broken.reason
    assert sanity_verdict([])[0] == "not run"


def token_points(curve) -> dict:
    """Two training seeds x 6 prompts, each measured at 4 budgets a factor 4 apart: `curve(tokens)` plus
    the prompt's own offset (spread 0.2) and decoding noise (0.01)."""
    rng = np.random.default_rng(0)
    budgets = [1e4 * 4**i for i in range(4)]
    return {
        seed: {
            (0, p): [(x, curve(x) + offset + rng.normal(0.0, 0.01)) for x in budgets]
            for p, offset in enumerate(rng.normal(0.0, 0.2, size=6))
        }
        for seed in (0, 1)
    }


def test_the_token_curves_shape_is_judged_on_held_out_prompts_log_against_line():
    def shape(curve) -> Check:
        linear, log = held_out_errors(token_points(curve))
        return compare("shape", ">", "line", linear, "log curve", log)

    assert shape(lambda x: 1.0 + 0.2 * math.log10(x)).outcome == "holds"
    assert shape(lambda x: 1.0 + 2e-6 * x).outcome == "contradicted"  # growth that speeds up: a line
    check = shape(lambda x: 1.0 + 0.2 * math.log10(x))
    assert check.a is not None and check.a.n == 12 and len(check.first_values) == 12  # one error per prompt


def test_a_finding_whose_variant_failed_is_not_run_with_the_reason():
    runs = {name: VariantData(status="ok") for name in ("compare", "trees")}
    runs[HEADS] = VariantData(status="failed: heads: training exited with status 1")
    findings = {f.key: f for f in all_findings(runs, 2, ["de-en"], 1)}
    assert sorted(findings) == sorted(FINDINGS)
    rescoring = findings["rescoring_efficiency"]
    assert rescoring.verdict == "not run" and "training exited with status 1" in rescoring.reason
    assert findings["exit_layer"].verdict == "not run" and "not planned" in findings["exit_layer"].reason
    assert findings["pf_over_f"].verdict == "not run"  # compare_budgets_de-en is missing
    assert findings["trees"].verdict == "not run" and findings["trees"].reason  # no rows at all


def test_rows_are_matched_on_their_fields_not_their_labels():
    def rows(decoder: str, start: float, **fields: object) -> list:
        values = [[start + 0.1 * s] * 6 for s in range(3)]
        return [r.model_copy(update={"method": "one label", "temperature": 0.3}) for r in rows_of_arm(decoder, values, **fields)]  # fmt: skip

    measured = rows("rsd_s", 2.0, control=None, draft_length=None, tree="3x3")
    measured += rows("rsd_c", 1.5, control=None, draft_length=None, tree="2-2-2")
    measured += rows("sd", 1.0, control="fixed", draft_length=3) + rows(
        "sd", 9.0, control="fixed", draft_length=4
    )
    runs = {"trees": VariantData(status="ok", rows=measured)}
    trees = {f.key: f for f in all_findings(runs, 2, ["de-en"], 1)}["trees"]
    assert {c.outcome for c in trees.checks} == {"holds"} and trees.verdict == "reproduced"
    assert trees.checks[1].b is not None and trees.checks[1].b.mean == pytest.approx(1.1)  # K=3 only


def test_both_fits_of_the_token_curve_are_reported_and_tell_a_log_curve_from_a_line():
    xs = [1e3, 1e3, 1e4, 1e4, 1e5, 1e5, 1e6, 1e6]
    log_ys = [1.0 + 0.2 * (i // 2) + (0.01 if i % 2 else -0.01) for i in range(8)]
    fits = shape_fits(xs, log_ys)
    assert fits is not None and fits.log.slope == pytest.approx(0.2) and fits.log.r2 > fits.linear.r2
    assert fits.log.aic < fits.linear.aic and fits.log.predict(1e4) == pytest.approx(1.2, abs=0.02)
    assert fits.linear.slope > 0 and len(fits.linear.squared_residuals) == 8
    assert "log10(tokens)" in fits.log.text() and "R²" in fits.linear.text()
    line = shape_fits(xs, [1.0 + 1e-6 * x + (0.01 if i % 2 else -0.01) for i, x in enumerate(xs)])
    assert line is not None and line.linear.r2 > line.log.r2 and line.linear.aic < line.log.aic
    assert shape_fits([1e3, 1e3], [1.0, 1.1]) is None
    with pytest.raises(ValueError, match="positive"):
        shape_fits([0.0, 1.0, 2.0], [1.0, 1.1, 1.2])


def test_target_budgets_count_the_draft_tokens_the_target_verifies():
    assert tree_budget("sd", None, 6) == 6
    assert [tree_budget("rsd_c", t, None) for t in ("2-1-1", "2-2", "3-1", "3-2-2")] == [6, 6, 6, 21]
    assert [tree_budget("rsd_s", t, None) for t in ("2x3", "7x3", "6x5")] == [6, 21, 30]


def test_a_retrained_extra_drafter_changes_the_measure_key(tmp_path):
    drafter = tmp_path / "finetune" / "de-en"
    drafter.mkdir(parents=True)
    (tmp_path / "finetune" / "manifest.json").write_text('{"key": "a"}')
    first = stage_manifests({"x": str(drafter), "hub": "org/model"})
    assert list(first) == ["x"]  # a hub id has no stage folder
    (tmp_path / "finetune" / "manifest.json").write_text('{"key": "b"}')
    assert stage_manifests({"x": str(drafter)}) != first


def test_the_checks_table_shows_the_interval_and_the_detectable_effect_beside_the_seeds():
    a, b = study_prompts(0.0)
    table = checks_table([check_of(a, b), check_of(a[:1], [b[0][:1]])])
    row = table.splitlines()[2]
    assert re.search(r"\| [+-]\d\.\d{3} \[[+-]\d\.\d{3}, [+-]\d\.\d{3}\] at 95%, 18 prompts \| 0\.\d{3} \(seed: \+0\.290\) \| within noise \|$", row), row  # fmt: skip
    assert table.splitlines()[3].endswith("| - | - (seed: +0.290) | too few prompts |")


def test_the_docs_heading_is_the_recorded_studys_counts():
    study = json.loads((ROOT / "bench" / "results" / "study.json").read_text())
    docs = (ROOT / "docs" / "study.md").read_text()
    assert docs.splitlines()[0] == f"# Study: {headline(study['findings'])}", (
        "docs/study.md's first line must be that heading (python -m bench.study_docs writes it)"
    )
    recorded = [Finding.model_validate(f) for f in study["findings"]]
    table = "\n".join([tally(recorded), "", *summary_table(recorded, 1)])
    assert f"\n{table}\n" in docs, (
        "docs/study.md's summary must be the recorded one (python -m bench.study_docs)"
    )
    assert f": {headline(study['findings'])} |" in (ROOT / "README.md").read_text()
    findings = [{"verdict": v, "seed_claim": True} for v in ("reproduced", "not reproduced", "inconclusive")]
    findings.append({"verdict": "reproduced", "seed_claim": False})
    assert headline(findings) == "1 of the seeds' 3 findings reproduced, 1 contradicted, 1 open"
