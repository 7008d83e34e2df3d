"""The facts a card is made of, computed from hand-made results rows and configs."""

from __future__ import annotations

from polydraft.decoding.measurement.results import ResultRow
from polydraft.pipelines.export.info import best_draft_length, measurements, public_target, rows_for
from polydraft.pipelines.schema import ResolvedTarget
from tests.export_setup import measure_rows, result_row


def row(
    method: str, decoder: str, k: int | None, speedup: float, dataset: str = "de-en", **extra
) -> ResultRow:
    base = {
        "method": method,
        "decoder": decoder,
        "drafter": None if decoder == "ar" else "de-en",
        "control": "fixed" if k else None,
        "draft_length": k,
        "tree": None,
        "dataset": dataset,
        "temperature": 0.0,
        "seed": 0,
        "in_domain": None if decoder == "ar" else dataset == "de-en",
        "speedup": speedup,
        "block_efficiency": speedup + 1,
        "matches_ar": True,
    }
    return result_row(**{**base, **extra})


def test_best_k_is_the_fastest_in_domain_and_the_smaller_on_ties():
    rows = [
        row("sd K=2", "sd", 2, 1.5),
        row("sd K=4", "sd", 4, 1.5),
        row("sd K=6", "sd", 6, 1.2),
        row("sd K=6", "sd", 6, 3.0, dataset="fr-en"),  # out of domain: not counted
        row("sd beta_ts", "sd", 10, 9.0, control="beta_ts"),  # not a fixed K
    ]
    assert best_draft_length(rows, "sd") == 2
    assert best_draft_length(rows, "rsd_c") is None


def test_without_fixed_chain_rows_the_assisted_k_is_used():
    rows = [row("ar", "ar", None, 1.0), row("assisted K=5", "assisted", 5, 1.3)]
    measured = measurements(rows, "de-en", "sd", None)
    assert measured.measured and measured.best_draft_length == 5
    assert measured.headline is not None and measured.headline.method == "assisted K=5"
    assert all(r.target == "local" for r in measured.rows)


def test_rows_for_keeps_the_baseline_of_the_drafters_groups_only():
    rows = measure_rows()
    mine = rows_for(rows, "fr-en")
    groups = {r.group for r in rows if r.drafter == "fr-en"}
    assert {r.drafter for r in mine} == {None, "fr-en"}
    assert {r.group for r in mine if r.decoder == "ar"} == groups
    assert not measurements(rows, "pretrain", "sd", None).measured


def test_public_target_never_names_a_local_folder(tmp_path):
    local = ResolvedTarget(path=str(tmp_path), revision=None, dtype="auto", trust_remote_code=False)
    assert public_target(None, str(tmp_path), local).model_dump() == {
        "id": None,
        "revision": None,
        "label": None,
    }
    assert public_target("org/target", str(tmp_path), local).id == "org/target"
    hub = ResolvedTarget(path="lmsys/vicuna-7b-v1.3", revision="v1", dtype="auto", trust_remote_code=False)
    assert public_target(None, "lmsys/vicuna-7b-v1.3", hub).model_dump() == {
        "id": "lmsys/vicuna-7b-v1.3",
        "revision": "v1",
        "label": "vicuna-7b-v1.3",
    }
