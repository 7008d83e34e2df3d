"""`polydraft study`: the report's structure on a `--quick` study of the study recipe (not its verdicts,
which tiny models cannot support), the sharing of stages between variants, and the verdict rule."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from polydraft.decoding.measurement.claims import outcome_of
from polydraft.pipelines.cli import main
from polydraft.pipelines.schema.inputs import stage_manifests
from polydraft.pipelines.study.findings import all_findings, sanity_checks
from polydraft.pipelines.study.fits import shape_fits
from polydraft.pipelines.study.model import HEADS, PF_BUDGETS, VariantData, pf_variant, tree_budget
from polydraft.pipelines.study.verdicts import (
    VERDICTS,
    compare,
    log_fit,
    sanity_verdict,
    slope_check,
    verdict_of,
)
from tests.export_setup import result_row

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "recipes" / "demo" / "study.yaml"  # the demo recipe with the study's measure settings
FINDINGS = [  # the seeds' findings by seed, then the study items; written here so that dropping one fails
    "pf_over_p",
    "pf_over_f",
    "in_domain",
    "finetune_tokens",
    "exit_layer",
    "shared_layers",
    "thompson_eesd_preset",
    "thompson_eesd_best",
    "thompson_standalone_preset",
    "trees",
    "rsd_budget",
    "rescoring",
    "thompson_standalone_best",
    "distill_temperatures",
]
NOT_SEED_CLAIMS = {"thompson_standalone_best", "distill_temperatures"}
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
    assert re.search(r"Of the seeds' 12 findings: \d+ reproduced, \d+ consistent,.*and 2 study item", report)
    for number, key, (_, title, seed, measured, verdict, reason) in zip(range(1, 16), keys, rows):
        assert ("not a seed claim" in title) == (key in NOT_SEED_CLAIMS), key
        allowed = ("passed",) if key in SANITY else [v for v in VERDICTS if v != "not run"]
        assert verdict.strip("*") in allowed, (key, verdict)
        assert reason and "seed" in seed, key
        counts = [int(n) for n in re.findall(NUMBER, measured)]
        assert counts and min(counts) >= 3, (key, measured)  # >= 3 repetitions behind every number
        trained = key not in {"trees", "rsd_budget", "rescoring", "lossless"}  # these compare decoders
        assert not trained or key == "finetune_tokens" or counts[0] >= 6, (key, measured)  # 2 seeds x 3
        section = report.split(f"### {number}. ")[1].split("\n### ")[0]
        assert f"(`{key}`)" in section and "**Verdict:" in section and "| check |" in section
        plot = re.search(r"!\[\w+\]\((plots/\w+\.png)\)", section)
        assert plot and (quick / plot.group(1)).stat().st_size > 1000, key
    study = json.loads((quick / "study.json").read_text())
    assert [f["key"] for f in study["findings"]] == FINDINGS
    assert [f["key"] for f in study["sanity_checks"]] == SANITY
    assert all(f["checks"] for f in study["findings"] + study["sanity_checks"])
    assert report.index("## Sanity checks") > report.index("### 14. ")  # after the findings, apart
    claims = report.split("## Finding → seed claim")[1].split("## The rule")[0]
    assert all(f"| `{key}` |" in claims for key in FINDINGS)
    assert {v["status"] for v in study["variants"]} == {"ok"}


def test_variants_share_identical_stages_and_a_rerun_runs_nothing(quick):
    variants = json.loads((quick / "study.json").read_text())["variants"]
    made = [stage for v in variants for stage in v["made"]]
    # the recipe's distillation once (+ the two of the temperature item), a pretrain per training seed
    assert made.count("distill") == 3 and made.count("pretrain") == 2
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
    assert (
        findings["rescoring"]["verdict"] == "not run" and "`heads` not run" in findings["rescoring"]["reason"]
    )
    assert findings["trees"]["verdict"] != "not run"
    assert main(["study", str(DEMO), "--quick", "--study-dir", str(quick), "--only", "nope", "--quiet"]) == 2


# ----------------------------------------------------------------------------- the rule, on plain numbers


def test_a_strict_claim_holds_only_beyond_twice_the_pooled_std():
    assert compare("x", ">", "a", [2.0, 2.1, 1.9], "b", [1.0, 1.1, 0.9]).outcome == "holds"
    assert compare("x", ">", "a", [1.05, 1.15, 0.95], "b", [1.0, 1.1, 0.9]).outcome == "within noise"
    assert compare("x", ">", "a", [1.0, 1.1, 0.9], "b", [2.0, 2.1, 1.9]).outcome == "contradicted"
    check = compare("x", ">", "a", [2.0, 2.1, 1.9], "b", [1.0, 1.1, 0.9])
    assert check.noise == pytest.approx(0.2) and check.difference == pytest.approx(1.0)
    assert compare("x", ">", "a", [2.0], "b", [1.0, 1.1]).outcome == "too few repetitions"


def spread(mean: float, std: float) -> list[float]:
    """Three values with this mean and sample std."""
    return [mean - std, mean, mean + std]


def test_a_non_strict_claim_is_at_best_consistent_never_holds():
    assert compare("x", ">=", "a", [2.0, 2.1, 1.9], "b", [1.0, 1.1, 0.9]).outcome == "consistent"  # far above
    assert compare("x", ">=", "a", [1.0, 1.1, 0.9], "b", [1.05, 1.15, 0.95]).outcome == "consistent"
    assert compare("x", ">=", "a", [1.0, 1.1, 0.9], "b", [2.0, 2.1, 1.9]).outcome == "contradicted"
    assert compare("x", ">=", "a", [2.0], "b", [1.0, 1.1]).outcome == "too few repetitions"


def test_an_equality_holds_within_the_noise_only():
    assert outcome_of("==", 0.0, 0.0) == "holds" and outcome_of("==", -0.05, 0.1) == "holds"
    assert outcome_of("==", -0.01, 0.0) == "contradicted" and outcome_of("==", 0.2, 0.1) == "contradicted"


def test_the_issues_flattering_cases_no_longer_hold():
    # bench/results/study.md (old rule): RSD-S 3.038 ± 0.073 vs RSD-C 2.969 ± 0.172 "held" as `>=`
    trees = compare("RSD-S > RSD-C", ">", "RSD-S", spread(3.038, 0.073), "RSD-C", spread(2.969, 0.172))
    assert trees.noise == pytest.approx(0.264, abs=1e-3) and trees.outcome == "within noise"
    # Cali-TS 0.928 ± 0.025 below Beta-TS 0.945 ± 0.031 "held" as `>=`
    cali = compare("Cali-TS > Beta-TS", ">", "Cali-TS", spread(0.928, 0.025), "Beta-TS", spread(0.945, 0.031))
    assert cali.outcome == "within noise"
    assert verdict_of([trees, cali])[0] == "inconclusive"


def test_a_finding_is_reproduced_only_when_every_check_is_strict_and_holds():
    holds = compare("h", ">", "a", [2.0, 2.1, 1.9], "b", [1.0, 1.1, 0.9])
    within = compare("w", ">", "a", [1.05, 1.15, 0.95], "b", [1.0, 1.1, 0.9])
    against = compare("c", ">", "a", [1.0, 1.1, 0.9], "b", [2.0, 2.1, 1.9])
    merely = compare("m", ">=", "a", [2.0, 2.1, 1.9], "b", [1.0, 1.1, 0.9])
    assert verdict_of([holds, holds]) == ("reproduced", "all 2 checks hold beyond noise")
    assert verdict_of([holds, merely])[0] == "consistent" and verdict_of([merely])[0] == "consistent"
    assert "1 of 2 checks are non-strict" in verdict_of([holds, merely])[1]
    assert verdict_of([holds, within]) == ("inconclusive", verdict_of([within, holds])[1])
    assert verdict_of([merely, within])[0] == "inconclusive"  # an open check outranks a consistent one
    assert "1 of 2 checks within noise" in verdict_of([holds, within])[1]
    assert verdict_of([holds, within, against]) == ("not reproduced", "contradicted beyond noise: c")
    assert verdict_of([merely, against])[0] == "not reproduced"
    assert verdict_of([])[0] == "not run"


def test_every_check_of_the_seeds_findings_is_a_strict_claim():
    def rows(decoder: str, start: float, **fields: object) -> list:
        return [
            result_row(decoder=decoder, method="m", temperature=0.3, seed=s, block_efficiency=start + 0.1 * s,
                       mbsu=start, token_rate=start, **fields)
            for s in range(3)
        ]  # fmt: skip

    measured = rows("rsd_s", 2.0, control=None, draft_length=None, tree="3x3")
    measured += rows("rsd_c", 1.5, control=None, draft_length=None, tree="2-2-2")
    measured += rows("sd", 1.0, control="fixed", draft_length=3)
    eesd = [
        result_row(decoder="eesd", method="m", control=control, draft_length=k, seed=s, speedup=1.0 + 0.1 * s)
        for control, k in (("fixed", 2), ("beta_ts", None), ("cali_ts", None))
        for s in range(3)
    ]  # fmt: skip
    runs = {"trees": VariantData(status="ok", rows=measured)}
    runs |= {f"eesd_s{s}": VariantData(status="ok", rows=eesd) for s in (0, 1)}  # two training seeds
    findings = {f.key: f for f in all_findings(runs, 2, ["de-en"], 1)}
    for key in ("trees", "thompson_eesd_best"):
        assert findings[key].checks and {c.claim for c in findings[key].checks} == {">"}, key
    best = findings["thompson_eesd_best"].checks
    assert [c.outcome for c in best] == ["within noise"] and best[0].a.n == 6  # equal: not a win; n = 2 x 3
    assert findings["thompson_eesd_best"].verdict == "inconclusive"


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


def test_the_logarithmic_fit_recovers_a_known_slope():
    xs = [1e3, 1e3, 1e4, 1e4, 1e5, 1e5, 1e6, 1e6]
    ys = [1.0 + 0.2 * (i // 2) + (0.01 if i % 2 else -0.01) for i in range(8)]
    fit = log_fit(xs, ys)
    assert fit is not None and fit.slope == pytest.approx(0.2) and fit.r2_log > fit.r2_linear
    assert slope_check("s", fit).outcome == "holds"
    flat = log_fit(xs, [1.0 + (0.01 if i % 2 else -0.01) for i in range(8)])
    assert slope_check("s", flat).outcome == "within noise"
    assert log_fit([1e3, 1e3], [1.0, 1.1]) is None and slope_check("s", None).outcome == "too few repetitions"


def test_a_finding_whose_variant_failed_is_not_run_with_the_reason():
    runs = {name: VariantData(status="ok") for name in ("compare", "trees")}
    runs[HEADS] = VariantData(status="failed: heads: training exited with status 1")
    findings = {f.key: f for f in all_findings(runs, 2, ["de-en"], 1)}
    assert sorted(findings) == sorted(FINDINGS)
    rescoring = findings["rescoring"]
    assert rescoring.verdict == "not run" and "training exited with status 1" in rescoring.reason
    assert findings["exit_layer"].verdict == "not run" and "not planned" in findings["exit_layer"].reason
    assert findings["pf_over_f"].verdict == "not run"  # compare_budgets_de-en is missing
    assert findings["trees"].verdict == "not run" and findings["trees"].reason  # no rows at all


def test_rows_are_matched_on_their_fields_not_their_labels():
    def rows(decoder: str, start: float, **fields: object) -> list:
        return [
            result_row(decoder=decoder, method="one label", temperature=0.3, seed=s,
                       block_efficiency=start + 0.1 * s, mbsu=start + 0.1 * s, token_rate=start + 0.1 * s, **fields)
            for s in range(3)
        ]  # fmt: skip

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
    assert fits.linear.slope > 0 and len(fits.linear.squared_residuals) == 8
    assert "log10(tokens)" in fits.log.text() and "R²" in fits.linear.text()
    line = shape_fits(xs, [1.0 + 1e-6 * x + (0.01 if i % 2 else -0.01) for i, x in enumerate(xs)])
    assert line is not None and line.linear.r2 > line.log.r2  # a straight line: the linear fit wins
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
