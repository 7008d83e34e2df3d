"""The export stage on a run with real (tiny) drafters, head and calibration model and measured rows."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import yaml

from polydraft.pipelines.export.routing import load_router
from tests.decoding_helpers import single_thread_fixture
from tests.export_setup import TRAINING, build_templates, export_recipe, measure_rows, run_export

single_thread = single_thread_fixture()


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_tokenizer, tiny_target_dir):
    root = tmp_path_factory.mktemp("export")
    templates = build_templates(root / "templates", tiny_tokenizer, tiny_target_dir)
    outcomes = run_export(export_recipe(tiny_target_dir), root / "run", templates, tiny_target_dir)
    return root / "run", templates, {o.name: o for o in outcomes}


def results(run_dir: Path, name: str) -> dict:
    return json.loads((run_dir / "export" / name / "results.json").read_text(encoding="utf-8"))


def card_tables(card: str) -> dict[str, dict[tuple[str, str], tuple[float, float | None]]]:
    """Markdown tables after `### <title>` headings: (method, column) -> (mean, std) of `m ± s` cells,
    (mean, None) of a single measurement's `m (n=1)`."""
    tables: dict[str, dict[tuple[str, str], tuple[float, float | None]]] = {}
    for block in card.split("\n### ")[1:]:
        title, _, body = block.partition("\n")
        lines = [line for line in body.splitlines() if line.startswith("|")]
        if not lines:
            continue
        header = [c.strip() for c in lines[0].strip("|").split("|")]
        cells = {}
        for line in lines[2:]:
            values = [c.strip() for c in line.strip("|").split("|")]
            for column, value in zip(header[1:], values[1:]):
                match = re.fullmatch(r"(-?[\d.]+)(?: ± ([\d.]+)| \(n=1\))", value)
                if match:
                    cells[(values[0], column)] = (float(match[1]), float(match[2]) if match[2] else None)
        tables[title.strip()] = cells
    return tables


def expected_cells(rows: list[dict], metric: str) -> dict[tuple[str, str], tuple[float, float | None]]:
    """Mean and sample std over seeds (None for one seed), recomputed here from results.jsonl rows."""
    groups: dict[tuple[str, str], list[float]] = {}
    for row in rows:
        groups.setdefault((row["method"], f"{row['dataset']} T={row['temperature']:g}"), []).append(
            row[metric]
        )
    out = {}
    for key, values in groups.items():
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else None
        out[key] = (mean, std)
    return out


def test_export_writes_a_smoke_checked_folder_per_drafter_and_head(exported):
    run_dir, templates, outcomes = exported
    export_dir = run_dir / "export"
    assert sorted(p.name for p in export_dir.iterdir() if p.is_dir()) == [
        "de-en",
        "early_exit",
        "fr-en",
        "pretrain",
    ]
    metrics = outcomes["export"].metrics
    assert (
        metrics["exported"] == 4 and metrics["smoke_failed"] == [] and metrics["unmeasured"] == ["pretrain"]
    )
    manifest = json.loads((export_dir / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["metrics"]["items"]["de-en"]["smoke_passed"] is True
    index = json.loads((export_dir / "export.json").read_text(encoding="utf-8"))
    assert {i["name"]: i["smoke_passed"] for i in index["items"]} == dict.fromkeys(
        ["de-en", "fr-en", "pretrain", "early_exit"], True
    )
    for name in ("de-en", "fr-en", "pretrain"):
        files = {p.name for p in (export_dir / name).iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= files
        assert {"README.md", "results.json"} <= files
        checks = {c["name"]: c["status"] for c in results(run_dir, name)["smoke"]["checks"]}
        assert checks["reload"] == checks["assisted_generation"] == checks["vllm_vocabulary"] == "pass"
        assert checks["vllm_generation"] == "skipped"  # export.vllm_check is off in the tests
    # the routing table beside the drafters: no multilingual drafter here, so the generic one is the fallback
    assert metrics["routing"] == {"de": "de-en", "fr": "fr-en", "fallback": "pretrain"}
    router = load_router(export_dir / "routing.json")
    assert router.folder(router.route("Translate German to English: zweiundvierzig")) == export_dir / "de-en"
    drafter = export_dir / "de-en"  # its calibration model sits apart: vLLM loads every top-level safetensors
    assert [p.name for p in drafter.glob("*.safetensors")] == ["model.safetensors"]
    assert (drafter / "calibration" / "calibration.safetensors").is_file()
    assert {c["name"]: c["status"] for c in results(run_dir, "de-en")["smoke"]["checks"]}[
        "calibration"
    ] == "pass"
    head = export_dir / "early_exit"
    assert {"early_exit.safetensors", "early_exit.json", "calibration/calibration.safetensors"} <= {
        p.relative_to(head).as_posix() for p in head.rglob("*")
    }
    assert {c["name"]: c["status"] for c in results(run_dir, "early_exit")["smoke"]["checks"]}[
        "eesd_greedy"
    ] == "pass"


def test_exported_drafter_reloads_with_its_weights_and_assists_the_target(exported, tiny_target_dir):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run_dir, templates, _ = exported
    folder = run_dir / "export" / "de-en"
    drafter = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    original = load_file(str(templates / "finetune" / "de-en" / "model.safetensors"))
    assert all(torch.equal(drafter.state_dict()[k], v) for k, v in original.items())
    assert (
        drafter.generation_config.num_assistant_tokens
        == results(run_dir, "de-en")["measurement"]["best_draft_length"]
    )
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 40, 41, 42, 43]])
    options = {"max_new_tokens": 8, "do_sample": False, "attention_mask": torch.ones_like(ids)}
    alone = target.generate(ids, **options)
    assert torch.equal(target.generate(ids, assistant_model=drafter, **options), alone)


@pytest.mark.parametrize("name", ["de-en", "early_exit"])
def test_every_number_in_the_card_tables_matches_results_jsonl(exported, name):
    run_dir, templates, _ = exported
    rows = [json.loads(line) for line in (templates / "measure" / "results.jsonl").read_text().splitlines()]
    mine = [r for r in rows if r["drafter"] == name]
    groups = {(r["dataset"], r["temperature"], r["seed"]) for r in mine}
    shown = mine + [
        r for r in rows if r["decoder"] == "ar" and (r["dataset"], r["temperature"], r["seed"]) in groups
    ]
    card = (run_dir / "export" / name / "README.md").read_text(encoding="utf-8")
    tables = card_tables(card)
    for title, metric in (
        ("Block efficiency (tokens per target call)", "block_efficiency"),
        ("Speedup over autoregressive decoding", "speedup"),
    ):
        expected = expected_cells(shown, metric)
        assert set(tables[title]) == set(expected), title
        for key, (mean, std) in tables[title].items():
            assert (mean, std) == (round(expected[key][0], 2), round(expected[key][1], 2)), (title, key)


def test_card_headline_best_k_and_training_counts_come_from_the_run_files(exported):
    run_dir, templates, _ = exported
    card = (run_dir / "export" / "de-en" / "README.md").read_text(encoding="utf-8")
    rows = [r.model_dump() for r in measure_rows() if r.drafter == "de-en"]
    by_k: dict[int, list[float]] = {}
    for row in rows:
        if row["decoder"] == "sd" and row["in_domain"]:
            by_k.setdefault(row["draft_length"], []).append(row["speedup"])
    best = max(by_k, key=lambda k: sum(by_k[k]) / len(by_k[k]))
    assert f'"num_speculative_tokens": {best}' in card
    greedy = [
        r
        for r in rows
        if r["method"] == f"sd[de-en] K={best}" and r["temperature"] == 0 and r["dataset"] == "de-en"
    ]
    speedup = sum(r["speedup"] for r in greedy) / len(greedy)
    efficiency = sum(r["block_efficiency"] for r in greedy) / len(greedy)
    assert f"block efficiency of {efficiency:.2f} and a wall-clock speedup of {speedup:.2f}x" in card
    assert f"{TRAINING['finetune']['pairs']['de-en']['tokens']:,} tokens seen" in card
    assert f"{TRAINING['pretrain']['drafter']['tokens']:,} tokens seen" in card
    assert "held-out top-1 agreement with the target's greedy tokens 0.25" in card
    assert "Test CPU (2 cores)" in card and "2026-11-20T10:00:00+00:00" in card
    assert "At temperature 0 every method produced exactly `ar`'s tokens" in card


def test_card_metadata(exported):
    run_dir, _, _ = exported
    card = (run_dir / "export" / "de-en" / "README.md").read_text(encoding="utf-8")
    meta = yaml.safe_load(card.split("---\n")[1])
    assert meta["language"] == ["de", "en"] and meta["license"] == "apache-2.0"
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert {"speculative-decoding", "draft-model"} <= set(meta["tags"])
    assert "base_model" not in meta  # a local target is never named by its path


def test_a_hub_target_is_the_base_model(exported):
    from polydraft.pipelines.export.cards import render_card
    from polydraft.pipelines.export.info import public_target
    from polydraft.pipelines.export.records import ExportResults
    from polydraft.pipelines.schema import ResolvedTarget

    run_dir, _, _ = exported
    info = ExportResults.model_validate(results(run_dir, "de-en"))
    resolved = ResolvedTarget(
        path="lmsys/vicuna-7b-v1.3", revision="main", dtype="auto", trust_remote_code=False
    )
    info = info.model_copy(update={"target": public_target(None, "lmsys/vicuna-7b-v1.3", resolved)})
    card = render_card(info, "org/vicuna-drafter")
    assert yaml.safe_load(card.split("---\n")[1])["base_model"] == "lmsys/vicuna-7b-v1.3"
    assert 'from_pretrained("lmsys/vicuna-7b-v1.3"' in card and 'model="lmsys/vicuna-7b-v1.3"' in card
    assert '"model": "org/vicuna-drafter"' in card


def test_a_drafter_without_measurements_gets_a_card_that_says_so(exported):
    run_dir, _, _ = exported
    card = (run_dir / "export" / "pretrain" / "README.md").read_text(encoding="utf-8")
    assert "**No measurements.**" in card and "### Speedup" not in card
    info = results(run_dir, "pretrain")
    assert info["measurement"]["measured"] is False and info["measurement"]["rows"] == []
    assert (
        '"num_speculative_tokens": 3' in card and "not measured: the recipe's `measure.draft_length`" in card
    )


def test_no_local_path_leaves_in_an_exported_folder(exported, tiny_target_dir):
    run_dir, templates, _ = exported
    for folder in (p for p in (run_dir / "export").iterdir() if p.is_dir()):
        for path in folder.rglob("*"):
            if path.suffix in (".json", ".md", ".jinja"):
                text = path.read_text(encoding="utf-8")
                for local in (str(tiny_target_dir), str(run_dir), str(templates), "/home/someone"):
                    assert local not in text, (path, local)


def test_the_exported_head_attaches_to_the_target(exported, tiny_target_dir):
    from transformers import AutoModelForCausalLM

    from polydraft.models.calibration import CalibrationModel
    from polydraft.models.early_exit import attach_exit_head, read_head_config

    run_dir, _, _ = exported
    folder = run_dir / "export" / "early_exit"
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    head = attach_exit_head(target, folder)
    assert head.num_shared_layers == read_head_config(folder)["num_shared_layers"] == 2
    assert CalibrationModel.load(folder / "calibration").target_hidden_size == 64
    assert json.loads((folder / "calibration" / "calibration.json").read_text())["drafter_path"] == ".."
    card = (folder / "README.md").read_text(encoding="utf-8")
    assert "head = attach_exit_head(target, folder)" in card and "FixedK(4)" in card
    assert "accuracy 0.75 (base rate 0.625)" in card


def test_export_reads_what_the_real_measure_stage_writes(tmp_path, tiny_tokenizer, tiny_target_dir):
    """The measure stage itself (not hand-written rows) measures the drafters; the card shows its rows."""
    from polydraft.decoding.measurement.results import read_rows

    templates = build_templates(tmp_path / "templates", tiny_tokenizer, tiny_target_dir)
    recipe = export_recipe(
        tiny_target_dir,
        {"include_pretrained": False, "smoke_prompts": 1, "smoke_max_new_tokens": 4},
        early_exit={"enabled": False},
        calibrate={"enabled": False},
        measure={
            "decoders": ["ar", "sd", "assisted"],
            "temperatures": [0.0],
            "seeds": [0],
            "num_prompts": 1,
            "max_new_tokens": 4,
            "draft_length": 2,
            "include_pretrained": False,
        },
    )
    outcomes = {
        o.name: o for o in run_export(recipe, tmp_path / "run", templates, tiny_target_dir, real_measure=True)
    }
    assert outcomes["measure"].status == outcomes["export"].status == "ran"
    rows = [r.model_dump() for r in read_rows(tmp_path / "run" / "measure" / "results.jsonl")]
    info = results(tmp_path / "run", "de-en")
    assert info["measurement"]["measured"] and info["measurement"]["best_draft_length"] == 2
    mine = [r for r in rows if r["drafter"] == "de-en" or r["decoder"] == "ar"]
    card = (tmp_path / "run" / "export" / "de-en" / "README.md").read_text(encoding="utf-8")
    table = card_tables(card)["Speedup over autoregressive decoding"]
    expected = expected_cells(mine, "speedup")
    assert {k: v for k, v in table.items()} == {
        k: (round(m, 2), None if s is None else round(s, 2)) for k, (m, s) in expected.items()
    }


def test_a_card_shows_both_engines_and_where_they_differ(exported):
    """vLLM rows of the drafter (engine `vllm`) appear beside polydraft's, each method naming its engine."""
    from polydraft.decoding.measurement.results import BatchRate
    from polydraft.pipelines.export.cards import render_card
    from polydraft.pipelines.export.info import measurements
    from polydraft.pipelines.export.records import ExportResults

    run_dir, _, _ = exported
    info = ExportResults.model_validate(results(run_dir, "de-en"))
    # polydraft's sd K=4 accepts the first draft token 0.6 of the time on every seed, vLLM's 0.02
    rows = [
        r.model_copy(update={"acceptance_per_position": [0.6]}) if r.method == "sd[de-en] K=4" else r
        for r in info.measurement.rows
    ]
    own = [r for r in rows if r.method == "sd[de-en] K=4"]
    rate = BatchRate(batch_size=1, without_drafter=100.0, with_drafter=80.0, speedup=0.8)
    vllm = [
        r.model_copy(
            update={"engine": "vllm", "engine_detail": "vLLM 0.32.0 cpu, greedy drafts", "batch_rates": [rate],
                    "method": "sd[de-en] K=4 (vLLM)", "acceptance_per_position": [0.02], "speedup": 0.8}
        )
        for r in own
        if r.seed == 0
    ]  # fmt: skip
    measured = measurements([*rows, *vllm], "de-en", "sd", None)
    card = render_card(info.model_copy(update={"measurement": measured}), "org/de-en")
    assert "| sd[de-en] K=4 (vLLM) | vLLM 0.32.0 cpu, greedy drafts | sd | fixed | 4 | - |" in card
    assert "| sd[de-en] K=4 | polydraft | sd | fixed | 4 | - |" in card
    assert "### vLLM beside polydraft's engine" in card and "bs 1: 100 -> 80 (x0.80)" in card
    assert "first draft token accepted 0.02 of the time in vLLM" in card and "issue 55005" in card
    # polydraft's best K and headline stay polydraft's own
    assert measured.best_draft_length == info.measurement.best_draft_length
    assert measured.headline == info.measurement.headline.model_copy(update={"engine": "polydraft"})


def test_finetuned_drafters_cards_say_which_mixed_traffic_choice_won(
    tmp_path, tiny_tokenizer, tiny_target_dir
):
    from polydraft.decoding.measurement.mixed import write_group
    from polydraft.pipelines.runtime.contract import StageFailed
    from tests.decoding.test_mixed_traffic import _groups, _seconds

    templates = build_templates(tmp_path / "templates", tiny_tokenizer, tiny_target_dir)
    for group in _groups(_seconds([1.6, 1.7, 1.8]), _seconds([1.2, 1.3, 1.4])):
        write_group(templates / "measure", group)
    run_export(export_recipe(tiny_target_dir), tmp_path / "run", templates, tiny_target_dir)
    decision = (
        "The routed per-language drafters won (routed 1.70 ± 0.10x vs multilingual 1.30 ± 0.10x over 3 "
        "repetitions at T=0; per request +0.400 [+0.400, +0.400] at 95% over 12 requests, which excludes 0)."
    )
    for name in ("de-en", "fr-en"):
        card = (tmp_path / "run" / "export" / name / "README.md").read_text(encoding="utf-8")
        assert "## Mixed-language traffic" in card and f"- {decision}" in card
        assert "Decision rule: each request's speedup over `ar` with the routed choice minus" in card
        assert "| routed | 2.00 ± 0.00 | 1.70 ± 0.10 |" in card
        assert results(tmp_path / "run", name)["mixed_traffic"]["decisions"] == [
            decision[0].lower() + decision[1:-1]
        ]
    for name in ("pretrain", "early_exit"):
        assert "Mixed-language traffic" not in (tmp_path / "run" / "export" / name / "README.md").read_text()

    # a group file that is not one fails the export before any folder is written, naming the file
    (templates / "measure" / "mixed" / "T0-seed1.json").write_text("{")
    with pytest.raises(StageFailed, match=r"T0-seed1.json: not a mixed-traffic group"):
        run_export(export_recipe(tiny_target_dir), tmp_path / "again", templates, tiny_target_dir)
    assert not list((tmp_path / "again").glob("export*/de-en*"))
