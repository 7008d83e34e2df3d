"""The export stage on a run with proposal heads: one folder in polydraft's and vLLM's medusa format, smoke
checked, with a card carrying the heads' measured rows (bpd, medusa and their `+rescore` variants)."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch

from polydraft.decoding.measurement.results import ResultRow
from polydraft.models.heads import (
    VLLM_LM_HEAD_FILE,
    add_vllm_medusa,
    attach_heads,
    heads_for_target,
    load_vllm_medusa,
    save_heads,
)
from polydraft.pipelines.run.runner import run_pipeline
from polydraft.pipelines.runtime.contract import Stage
from polydraft.pipelines.schema import ResolvedTarget
from tests.decoding_helpers import single_thread_fixture
from tests.export_setup import _provider, _row, export_recipe

single_thread = single_thread_fixture()
HEADS_METHODS = [
    {"decoder": "ar", "method": "ar"},
    {"decoder": "bpd", "method": "bpd[heads] K=3", "drafter": "heads", "kind": "heads", "k": 3, "control": "fixed"},
    {"decoder": "medusa", "method": "medusa[heads] 4 nodes", "drafter": "heads", "kind": "heads", "tree": "4 nodes"},
    {"decoder": "bpd+rescore", "method": "bpd+rescore[de-en] K=3", "drafter": "heads", "kind": "heads", "k": 3,
     "control": "fixed", "rescorer": "de-en"},
    {"decoder": "medusa+rescore", "method": "medusa+rescore[de-en] 3x3", "drafter": "heads", "kind": "heads",
     "tree": "3x3", "rescorer": "de-en"},
]  # fmt: skip
TRAINED = {
    "steps": 7, "train_loss": 2.5, "distributed_type": "NO", "num_processes": 1,
    "initial": {"eval_loss": 5.0, "target_top1": 0.5, "heads": [
        {"loss": 5.0, "top1": 0.1, "top1_target": 0.125}, {"loss": 5.0, "top1": 0.1, "top1_target": 0.0625},
        {"loss": 5.0, "top1": 0.1, "top1_target": 0.03125}]},
    "final": {"eval_loss": 4.0, "target_top1": 0.5, "heads": [
        {"loss": 4.0, "top1": 0.2, "top1_target": 0.375}, {"loss": 4.0, "top1": 0.2, "top1_target": 0.25},
        {"loss": 4.0, "top1": 0.2, "top1_target": 0.1875}]},
}  # fmt: skip
"""The heads stage's metrics (`train.stage_metrics.HeadsMetrics`) as its manifest holds them."""


def heads_rows() -> list[ResultRow]:
    rng, rows = random.Random(3), []
    for dataset in ("de-en", "fr-en"):
        for seed in (0, 1):
            for method in HEADS_METHODS:
                row = _row(rng, method, dataset, 0.0, seed, len(HEADS_METHODS))
                if method.get("rescorer"):
                    row.update(rescorer="de-en", rescore_weight=0.5, drafter_pair="de-en", in_domain=None)
                rows.append(ResultRow.model_validate(row))
    return rows


def templates(root: Path, target_dir: Path, kind: str) -> Path:
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    heads = heads_for_target(target, kind, 3)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():  # trained-looking blocks: small, so the heads still agree with the target at times
        for block in heads.blocks:
            for parameter in block.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    folder = save_heads(heads, root / "heads" / "heads", {"path": str(target_dir), "revision": None})
    add_vllm_medusa(folder, target.get_output_embeddings())
    (root / "measure").mkdir(parents=True)
    rows = heads_rows()
    (root / "measure" / "results.jsonl").write_text("".join(r.model_dump_json() + "\n" for r in rows))
    return root


def run_heads_export(root: Path, target_dir: Path, kind: str, break_folder=None):
    from polydraft.pipelines.stages import default_stages

    source = templates(root / "templates", target_dir, kind)
    if break_folder is not None:
        break_folder(source / "heads" / "heads")
    real = {s.name: s for s in default_stages()}
    stages = [
        Stage("heads", _provider(source / "heads", TRAINED), real["heads"].inputs, real["heads"].upstream),
        Stage("measure", _provider(source / "measure", {}), real["measure"].inputs, real["measure"].upstream),
        real["export"],
    ]
    off = {"enabled": False}
    recipe = export_recipe(
        target_dir, pretrain=off, finetune=off, early_exit=off, calibrate=off, heads={"enabled": True}
    )
    target = ResolvedTarget(path=str(target_dir), revision=None, dtype="float32", trust_remote_code=False)
    outcomes = run_pipeline(recipe, root / "run", stages, target, command="test", quiet=True)
    return root / "run" / "export", {o.name: o for o in outcomes}


@pytest.fixture(scope="module", params=["medusa", "bpd"])
def exported(request, tmp_path_factory, tiny_target_dir):
    root = tmp_path_factory.mktemp(f"heads-export-{request.param}")
    export_dir, _ = run_heads_export(root, tiny_target_dir, request.param)
    return request.param, export_dir


def test_one_smoke_checked_folder_in_both_formats(exported, tiny_target, tiny_target_dir):
    kind, export_dir = exported
    folder = export_dir / "heads"
    index = json.loads((export_dir / "export.json").read_text())
    assert [(i["name"], i["kind"], i["smoke_passed"]) for i in index["items"]] == [("heads", "heads", True)]
    info = json.loads((folder / "results.json").read_text())
    checks = {c["name"]: c["status"] for c in info["smoke"]["checks"]}
    assert checks == {
        "files": "pass", "attach": "pass", "vllm_medusa_format": "pass", "heads_greedy": "pass",
        "vllm_generation": "skipped",  # export.vllm_check is off here; tests/export/test_drafts_vllm.py runs vLLM
    }  # fmt: skip
    names = {p.name for p in folder.iterdir()}
    assert {"heads.json", "heads.safetensors", "config.json", "README.md", "results.json"} <= names
    assert (VLLM_LM_HEAD_FILE in names) is (kind == "bpd")
    # polydraft's loader and vLLM's reading give the same heads; no local path is written anywhere
    attached = attach_heads(tiny_target, folder)
    read, shared = load_vllm_medusa(folder)
    hidden = torch.randn(4, attached.hidden_size)
    head = tiny_target.get_output_embeddings() if kind == "bpd" else None
    torch.testing.assert_close(read(hidden, head), attached(hidden, head))
    assert (shared is not None) is (kind == "bpd")
    for path in folder.iterdir():
        if path.suffix in (".json", ".md"):
            assert str(tiny_target_dir) not in path.read_text(), path.name
    assert json.loads((folder / "heads.json").read_text())["target"] == {"path": None, "revision": None}


def test_the_card_carries_the_heads_rows(exported):
    kind, export_dir = exported
    card = (export_dir / "heads" / "README.md").read_text()
    info = json.loads((export_dir / "heads" / "results.json").read_text())
    assert card.splitlines()[0] == "---" and "- medusa" in card
    assert ("# Medusa-1 proposal heads" if kind == "medusa" else "# BPD proposal heads") in card
    assert info["measurement"]["decoder"] == "bpd" and info["measurement"]["best_draft_length"] == 3
    assert info["heads"]["top1_target"] == [0.375, 0.25, 0.1875] and info["heads"]["steps"] == 7
    assert "0.375, 0.250, 0.188 (as initialised: 0.125, 0.062, 0.031)" in card
    rows = [r for r in info["measurement"]["rows"] if r["drafter"] == "heads"]
    assert {r["method"] for r in rows} == {m["method"] for m in HEADS_METHODS[1:]}
    # every block-efficiency cell of the card is the mean over seeds of the rows
    table = card.split("### Block efficiency")[1].split("###")[0]
    for method in ("bpd[heads] K=3", "medusa+rescore[de-en] 3x3"):
        line = next(x for x in table.splitlines() if x.startswith(f"| {method} |"))
        values = [r["block_efficiency"] for r in rows if r["method"] == method and r["dataset"] == "de-en"]
        mean = float(re.findall(r"([\d.]+) ±", line)[0])
        assert abs(mean - sum(values) / len(values)) < 0.005, (line, values)
    assert '"method": "medusa"' in card and '"num_speculative_tokens": 3' in card


@pytest.mark.parametrize("damage", ["no vLLM config", "another lm head"])
def test_a_damaged_folder_fails_its_smoke_check(tmp_path, tiny_target_dir, damage):
    def break_folder(folder: Path) -> None:
        if damage == "no vLLM config":
            (folder / "config.json").unlink()
            return
        from safetensors.torch import load_file, save_file

        weights = load_file(str(folder / VLLM_LM_HEAD_FILE))
        save_file({"lm_head.weight": weights["lm_head.weight"] + 0.1}, str(folder / VLLM_LM_HEAD_FILE))

    export_dir, _ = run_heads_export(tmp_path, tiny_target_dir, "bpd", break_folder)
    info = json.loads((export_dir / "heads" / "results.json").read_text())
    failed = {c["name"]: c["detail"] for c in info["smoke"]["checks"] if c["status"] == "fail"}
    assert not info["smoke"]["passed"]
    if damage == "no vLLM config":
        assert "missing config.json" in failed["files"] and "vllm_medusa_format" in failed
    else:
        assert failed == {"vllm_medusa_format": "lm_head.safetensors is not the target's lm head"}
    shutil.rmtree(tmp_path / "run")
