"""`polydraft study`: the report's structure on a `--quick` study of the demo recipe (not its verdicts,
which tiny models cannot support), the sharing of stages between variants, and the verdict rule."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from polydraft.pipelines.cli import main
from polydraft.pipelines.study.findings import all_findings
from polydraft.pipelines.study.model import HEADS, VariantData
from polydraft.pipelines.study.verdicts import VERDICTS, compare, log_fit, slope_check, verdict_of
from tests.export_setup import result_row

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "recipes" / "demo" / "demo.yaml"
FINDINGS = [  # the ten findings, in its order; written here so that dropping one fails
    "pretrain_finetune",
    "in_domain",
    "finetune_tokens",
    "exit_layer",
    "thompson_eesd",
    "thompson_standalone",
    "trees",
    "rescoring",
    "distill_temperatures",
    "lossless",
]
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
    assert keys == FINDINGS
    for number, key, (_, _, seed, measured, verdict, reason) in zip(range(1, 11), keys, rows):
        assert verdict.strip("*") in VERDICTS and verdict.strip("*") != "not run", (key, verdict)
        assert reason and seed.startswith("seed"), key
        counts = [int(n) for n in re.findall(NUMBER, measured)]
        assert counts and min(counts) >= 3, (key, measured)  # >= 3 repetitions behind every number
        section = report.split(f"### {number}. ")[1].split("\n### ")[0]
        assert f"(`{key}`)" in section and "**Verdict:" in section and "| check |" in section
        plot = re.search(r"!\[\w+\]\((plots/\w+\.png)\)", section)
        assert plot and (quick / plot.group(1)).stat().st_size > 1000, key
    study = json.loads((quick / "study.json").read_text())
    assert [f["key"] for f in study["findings"]] == FINDINGS
    assert all(f["checks"] for f in study["findings"])
    assert {v["status"] for v in study["variants"]} == {"ok"}


def test_variants_share_identical_stages_and_a_rerun_runs_nothing(quick):
    variants = json.loads((quick / "study.json").read_text())["variants"]
    made = [stage for v in variants for stage in v["made"]]
    assert made.count("distill") == 1 and made.count("pretrain") == 1  # made once, copied everywhere else
    assert sum(v["shared"].get("distill") == "pf" for v in variants) == len(variants) - 1
    assert all(v["ran"] == list(v["made"]) for v in variants)
    assert main(["study", str(DEMO), "--quick", "--study-dir", str(quick), "--quiet"]) == 0
    again = json.loads((quick / "study.json").read_text())["variants"]
    assert [v["ran"] for v in again] == [[]] * len(variants)
    assert [v["made"] for v in again] == [v["made"] for v in variants]  # the accounting reads manifests


def test_only_runs_one_variant_and_reads_the_others_where_up_to_date(quick):
    (quick / "heads" / "measure" / "manifest.json").unlink()  # its measure is no longer complete
    assert main(["study", str(DEMO), "--quick", "--study-dir", str(quick), "--only", "trees", "--quiet"]) == 0
    study = json.loads((quick / "study.json").read_text())
    status = {v["name"]: v["status"] for v in study["variants"]}
    assert status["trees"] == "ok" and status["pf"] == "ok"
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


def test_a_non_strict_claim_fails_only_when_clearly_below():
    assert compare("x", ">=", "a", [1.0, 1.1, 0.9], "b", [1.05, 1.15, 0.95]).outcome == "holds"
    assert compare("x", ">=", "a", [1.0, 1.1, 0.9], "b", [2.0, 2.1, 1.9]).outcome == "contradicted"


def test_a_finding_is_reproduced_only_when_every_check_holds():
    holds = compare("h", ">", "a", [2.0, 2.1, 1.9], "b", [1.0, 1.1, 0.9])
    within = compare("w", ">", "a", [1.05, 1.15, 0.95], "b", [1.0, 1.1, 0.9])
    against = compare("c", ">", "a", [1.0, 1.1, 0.9], "b", [2.0, 2.1, 1.9])
    assert verdict_of([holds, holds])[0] == "reproduced"
    assert verdict_of([holds, within]) == ("inconclusive", verdict_of([within, holds])[1])
    assert "1 of 2 checks within noise" in verdict_of([holds, within])[1]
    assert verdict_of([holds, within, against]) == ("not reproduced", "contradicted beyond noise: c")
    assert verdict_of([])[0] == "not run"


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
    runs = {name: VariantData(status="ok") for name in ("pf", "trees")}
    runs[HEADS] = VariantData(status="failed: heads: training exited with status 1")
    findings = {f.key: f for f in all_findings(runs, draft_length=2)}
    assert sorted(findings) == sorted(FINDINGS)
    rescoring = findings["rescoring"]
    assert rescoring.verdict == "not run" and "training exited with status 1" in rescoring.reason
    assert findings["exit_layer"].verdict == "not run" and "not planned" in findings["exit_layer"].reason
    assert findings["pretrain_finetune"].verdict == "not run"  # f_only is missing
    assert findings["trees"].verdict == "not run" and findings["trees"].reason  # no rows at all


def test_rows_are_matched_on_their_fields_not_their_labels():
    def rows(decoder: str, start: float, **fields: object) -> list:
        return [
            result_row(decoder=decoder, method="one label", temperature=0.3, seed=s,
                       block_efficiency=start + 0.1 * s, **fields)
            for s in range(3)
        ]  # fmt: skip

    measured = rows("rsd_s", 2.0, control=None, draft_length=None, tree="3x3")
    measured += rows("rsd_c", 1.5, control=None, draft_length=None, tree="2-2-2")
    measured += rows("sd", 1.0, control="fixed", draft_length=3) + rows(
        "sd", 9.0, control="fixed", draft_length=4
    )
    runs = {"trees": VariantData(status="ok", rows=measured)}
    trees = {f.key: f for f in all_findings(runs, draft_length=2)}["trees"]
    assert [c.outcome for c in trees.checks] == ["holds", "holds"] and trees.verdict == "reproduced"
    assert trees.checks[1].b is not None and trees.checks[1].b.mean == pytest.approx(1.1)  # K=3 only
