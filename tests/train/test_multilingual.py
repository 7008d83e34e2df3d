"""`finetune.multilingual`: one drafter on the union of every pair's mix, balanced by pair, trained beside
the per-pair drafters from the same starting drafter."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM

from polydraft.train.mix_cache import balanced_union
from tests.drafter_setup import context, run_stage, tiny_recipe, write_tiny_mix


def test_the_union_gives_every_pair_the_largest_pairs_count_and_every_row_at_least_once():
    mixes = {"fr-en": [f"fr{i}" for i in range(3)], "de-en": [f"de{i}" for i in range(7)]}
    union, rows = balanced_union(mixes, seed=5)
    assert rows == {"de-en": 7, "fr-en": 7} and len(union) == 14
    seen = Counter(union[i] for i in range(len(union)))
    assert {f"de{i}" for i in range(7)} == {k for k in seen if k.startswith("de")}
    assert all(seen[f"de{i}"] == 1 for i in range(7))
    # 7 = 3 + 3 + 1: two full passes over the small pair, then one more row
    assert sorted(seen[f"fr{i}"] for i in range(3)) == [2, 2, 3]
    again, _ = balanced_union(mixes, seed=5)
    assert [again[i] for i in range(14)] == [union[i] for i in range(14)]


def test_a_pair_without_rows_cannot_be_balanced():
    with pytest.raises(ValueError, match=r"pairs \['fr-en'\]"):
        balanced_union({"de-en": [1, 2], "fr-en": []}, seed=0)


def test_the_multilingual_drafter_is_trained_beside_the_finished_pair_drafters(tmp_path, tiny_target_dir):
    distill = write_tiny_mix(tmp_path / "distill", ["de-en", "fr-en"])
    ctx = context(tmp_path, "finetune", {"distill": distill})
    recipe = tiny_recipe(tiny_target_dir, pretrain={"enabled": False})
    first = run_stage("finetune", recipe, ctx, tiny_target_dir)
    assert first.metrics["multilingual"] is None and not (ctx.work_dir / "multilingual").exists()
    before = {p: (ctx.work_dir / p / "model.safetensors").stat().st_mtime_ns for p in ("de-en", "fr-en")}

    recipe = tiny_recipe(tiny_target_dir, pretrain={"enabled": False}, finetune={"multilingual": True})
    second = run_stage("finetune", recipe, ctx, tiny_target_dir)
    # the pair drafters were done: only the multilingual one trained
    assert before == {
        p: (ctx.work_dir / p / "model.safetensors").stat().st_mtime_ns for p in ("de-en", "fr-en")
    }
    assert second.metrics["pairs"] == first.metrics["pairs"]
    multilingual = second.metrics["multilingual"]
    assert multilingual == json.loads((ctx.work_dir / "multilingual.metrics.json").read_text())
    examples = multilingual["examples_per_pair"]
    assert set(examples) == {"de-en", "fr-en"} and min(examples.values()) > 0
    largest = max(examples.values())
    assert multilingual["rows_per_pair"] == {"de-en": largest, "fr-en": largest}
    assert multilingual["drafter"]["steps"] == 6
    assert set(multilingual["drafter"]["eval"]) == {"de-en", "fr-en"}  # held out per pair
    drafters = {
        name: AutoModelForCausalLM.from_pretrained(ctx.work_dir / name) for name in ("de-en", "multilingual")
    }
    assert not torch.equal(
        drafters["de-en"].model.embed_tokens.weight, drafters["multilingual"].model.embed_tokens.weight
    )
