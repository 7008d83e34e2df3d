"""Smoke checks that must fail: a broken export is caught before it leaves the machine."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoTokenizer

from polydraft.data.prompts import encode_prompt, translation_messages, vicuna_prompt
from polydraft.pipelines.export.smoke import VLLM_ARCHITECTURES, drafter_checks, passed, vllm_rule_checks
from polydraft.pipelines.runtime.contract import StageFailed
from tests.decoding_helpers import single_thread_fixture
from tests.drafter_setup import context, run_stage
from tests.export_setup import TRAINING, export_recipe, save_drafter

single_thread = single_thread_fixture()


def statuses(checks) -> dict[str, str]:
    return {c.name: c.status for c in checks}


def test_a_drafter_with_another_vocabulary_fails_with_a_clear_message(tmp_path, tiny_tokenizer, tiny_target):
    folder = save_drafter(tmp_path / "broken", tiny_tokenizer, vocab_size=len(tiny_tokenizer) + 8)
    checks = drafter_checks(folder, tiny_target, tiny_tokenizer, [torch.tensor([1, 40, 41])], 4, {2})
    assert not passed(checks)
    found = statuses(checks)
    assert found["reload"] == "pass"
    assert found["tokenizer"] == found["vllm_vocabulary"] == "fail"
    assert found["assisted_generation"] == "skipped"
    vocab = next(c for c in checks if c.name == "vllm_vocabulary").detail
    assert f"{len(tiny_tokenizer) + 8} tokens but the target {len(tiny_tokenizer)}" in vocab
    assert "same vocabulary size" in vocab


def test_a_folder_without_weights_or_tokenizer_fails(tmp_path, tiny_tokenizer, tiny_target):
    folder = save_drafter(tmp_path / "drafter", tiny_tokenizer)
    (folder / "tokenizer.json").unlink()
    (folder / "model.safetensors").unlink()
    checks = drafter_checks(folder, tiny_target, tiny_tokenizer, [torch.tensor([1, 40, 41])], 4, {2})
    assert statuses(checks)["files"] == "fail" and statuses(checks)["reload"] == "fail"
    assert "model.safetensors" in checks[0].detail and "tokenizer files" in checks[0].detail


def test_vllm_rules(tiny_target):
    from transformers import LlamaConfig, Qwen2VLConfig

    target = tiny_target.config
    vocab = target.vocab_size
    good = LlamaConfig(vocab_size=vocab, hidden_size=32, num_attention_heads=2, max_position_embeddings=2048)
    good.architectures = ["LlamaForCausalLM"]
    assert passed(vllm_rule_checks(good, target, VLLM_ARCHITECTURES, "the list"))

    short = LlamaConfig(vocab_size=vocab, hidden_size=32, num_attention_heads=2, max_position_embeddings=64)
    short.architectures = ["LlamaForCausalLM"]
    checks = vllm_rule_checks(short, target, VLLM_ARCHITECTURES, "the list")
    assert passed(checks) and statuses(checks)["vllm_max_model_len"] == "warn"

    unknown = LlamaConfig(vocab_size=vocab, hidden_size=32, num_attention_heads=2)
    unknown.architectures = ["MyOwnForCausalLM"]
    checks = vllm_rule_checks(unknown, target, VLLM_ARCHITECTURES, "the list")
    assert statuses(checks)["vllm_architecture"] == "fail" and "not in the list" in checks[1].detail

    multimodal = Qwen2VLConfig()
    multimodal.architectures = ["Qwen2VLForConditionalGeneration"]
    checks = vllm_rule_checks(multimodal, target, frozenset({"Qwen2VLForConditionalGeneration"}), "the list")
    assert statuses(checks)["vllm_architecture"] == "fail" and "multimodal" in checks[1].detail

    mrope = LlamaConfig(vocab_size=vocab, hidden_size=32, num_attention_heads=2, max_position_embeddings=2048)
    mrope.architectures = ["LlamaForCausalLM"]
    mrope.rope_parameters = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}
    checks = vllm_rule_checks(mrope, target, VLLM_ARCHITECTURES, "the list")
    assert statuses(checks)["vllm_rope"] == "fail" and "M-RoPE" in checks[2].detail


def test_strict_export_stops_on_a_broken_drafter_and_a_rerun_resumes(
    tmp_path, tiny_tokenizer, tiny_target_dir
):
    upstream = tmp_path / "finetune"
    save_drafter(upstream / "de-en", tiny_tokenizer, seed=2)
    save_drafter(upstream / "fr-en", tiny_tokenizer, vocab_size=len(tiny_tokenizer) + 8, seed=3)
    (upstream / "manifest.json").write_text(json.dumps({"metrics": TRAINING["finetune"]}))
    ctx = context(tmp_path / "run", "export", {"finetune": upstream})
    strict = export_recipe(tiny_target_dir, {"strict": True, "smoke_prompts": 1, "smoke_max_new_tokens": 4})
    with pytest.raises(
        StageFailed, match=r"fr-en failed its smoke check \(tokenizer: .*vocabulary of 520 tokens"
    ):
        run_stage("export", strict, ctx, tiny_target_dir)
    assert (ctx.work_dir / "de-en" / "results.json").is_file()  # finished before the failure, kept
    assert (ctx.work_dir / "fr-en.tmp").is_dir() and not (ctx.work_dir / "fr-en").exists()
    finished = (ctx.work_dir / "de-en" / "results.json").stat().st_mtime_ns

    lenient = export_recipe(tiny_target_dir, {"smoke_prompts": 1, "smoke_max_new_tokens": 4})
    result = run_stage("export", lenient, ctx, tiny_target_dir)
    assert (ctx.work_dir / "de-en" / "results.json").stat().st_mtime_ns == finished  # not redone
    assert not (ctx.work_dir / "fr-en.tmp").exists()
    assert (
        result.metrics["smoke_failed"] == ["fr-en"]
        and result.metrics["items"]["de-en"]["smoke_passed"] is True
    )
    info = json.loads((ctx.work_dir / "fr-en" / "results.json").read_text(encoding="utf-8"))
    assert info["smoke"]["passed"] is False
    card = (ctx.work_dir / "fr-en" / "README.md").read_text(encoding="utf-8")
    assert "**FAILED** (do not use this export)" in card and "| vllm_vocabulary | fail |" in card


@pytest.fixture(scope="module")
def demo_drafters(tmp_path_factory):
    """A 1-layer drafter with the demo target's tokenizer, and a copy whose config names an architecture
    vLLM does not have. (vLLM loads a weights file that lacks a tensor without a word, and names no
    tensor when one has the wrong shape: neither makes a drafter it refuses with a clear cause.)"""
    from tests.vllm_setup import demo_target

    target = demo_target()
    root = tmp_path_factory.mktemp("vllm_drafters")
    # head size 32: vLLM's CPU attention has no kernel for TINY's head size 16 ("Unsupported CPU attention
    # configuration: head_dim=16")
    shape = {"hidden_size": 64, "num_layers": 1, "num_heads": 2, "intermediate_size": 128}
    good = save_drafter(root / "good", AutoTokenizer.from_pretrained(target), seed=1, shape=shape)
    broken = root / "broken"
    shutil.copytree(good, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "architectures": ["PolydraftTestForCausalLM"]}))
    return target, good, broken


def test_real_vllm_checks_every_drafter_in_one_process_and_names_why_one_does_not_load(demo_drafters):
    """The real CPU build of vLLM: the target alone, then each folder as its draft model, one subprocess for
    all: a drafter vLLM cannot load fails with vLLM's reason, and the folder after it is still checked."""
    from polydraft.pipelines.export.vllm_check import VllmDraft, vllm_generation_checks
    from tests.vllm_setup import require_vllm

    require_vllm()
    target, good, broken = demo_drafters
    spec = {"path": str(target), "revision": None, "trust_remote_code": False}
    # the demo's task, which the target answers at length (on random ids it may stop at once)
    tokenizer = AutoTokenizer.from_pretrained(target)
    sources = [
        ("de-en", "dreiundneunzig\nsiebentausendvierundneunzig"),
        ("fr-en", "quatre-vingt-treize\nsoixante-douze"),
    ]
    prompts = [
        encode_prompt(tokenizer, vicuna_prompt(translation_messages(pair, text))) for pair, text in sources
    ]
    drafts = [
        VllmDraft(str(good), "draft_model", 3, prompts),
        VllmDraft(str(broken), "draft_model", 3, [[1, 319, 13]]),
        VllmDraft(str(good), "draft_model", 2, prompts[:1]),
    ]
    first, failed, last = vllm_generation_checks("require", spec, drafts, 12, [])
    assert first.status == "pass", first.detail
    assert (
        "24 greedy tokens for 2 prompts" in first.detail and "identical to the target alone" in first.detail
    )
    assert failed.status == "fail"
    assert "the drafter does not load" in failed.detail and "PolydraftTestForCausalLM" in failed.detail, (
        failed.detail
    )
    assert last.status == "pass" and "12 greedy tokens for 1 prompts" in last.detail, last.detail


def test_a_draft_that_kills_the_vllm_process_fails_alone_and_the_rest_are_checked(monkeypatch):
    """vLLM dying on one folder (a crash, not an exception) fails that folder's check with what it printed;
    the folders after it are checked in a new subprocess."""
    from polydraft.pipelines.export import vllm_check

    calls = []

    def fake(target, drafts, max_new_tokens, device):
        calls.append([d.folder for d in drafts])
        done = [{"vllm": "0", "device": "CPU build", "alone": [[1]], "drafted": [[1]], "accepted": 1,
                 "drafted_tokens": 2, "accepted_per_position": [1]}]  # fmt: skip
        if drafts[0].folder == "a":  # `a` finishes, then the process dies on `b`
            return done, "vLLM exited with -11: Segmentation fault"
        return done * len(drafts), "vLLM exited with 0: "

    monkeypatch.setattr(vllm_check, "_subprocess", fake)
    drafts = [vllm_check.VllmDraft(name, "draft_model", 2, [[5, 6]]) for name in "abcd"]
    results = vllm_check.vllm_generations({"path": "t"}, drafts, 4, [])
    assert calls == [["a", "b", "c", "d"], ["c", "d"]]
    assert [r.get("error") for r in results] == [None, "vLLM exited with -11: Segmentation fault", None, None]
    checks = [vllm_check.check_of(r, d) for r, d in zip(results, drafts, strict=True)]
    assert [c.status for c in checks] == ["pass", "fail", "pass", "pass"]


def test_the_drafts_are_dealt_over_the_copies_of_the_target_and_come_back_in_order(monkeypatch):
    """On a node whose GPUs hold 2 copies of the target, the folders go round-robin to one subprocess per
    copy, each on its copy's GPUs; the results come back in the folders' order; a copy without a folder
    starts nothing."""
    from polydraft.pipelines.export import vllm_check

    calls = []

    def fake(target, drafts, max_new_tokens, device):
        calls.append((device, [d.folder for d in drafts]))
        return [{"vllm": "0", "folder": d.folder} for d in drafts], "vLLM exited with 0: "

    monkeypatch.setattr(vllm_check, "_subprocess", fake)
    drafts = [vllm_check.VllmDraft(name, "draft_model", 2, [[5]]) for name in "abcde"]
    results = vllm_check.vllm_generations({"path": "t"}, drafts, 4, ["0,1", "2,3"])
    assert sorted(calls) == [("0,1", ["a", "c", "e"]), ("2,3", ["b", "d"])]
    assert [r["folder"] for r in results] == list("abcde")
    calls.clear()
    vllm_check.vllm_generations({"path": "t"}, drafts[:1], 4, ["0", "1", "2"])
    assert calls == [("0", ["a"])]


def test_vllm_generation_is_skipped_or_required(monkeypatch):
    import importlib.util

    from polydraft.pipelines.export.vllm_check import VllmDraft, vllm_generation_checks

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    target = {"path": "t", "revision": None, "trust_remote_code": False}
    drafts = [VllmDraft("d", "draft_model", 3, [])] * 2
    assert [c.status for c in vllm_generation_checks("off", target, drafts, 4, [])] == ["skipped"] * 2
    assert [c.status for c in vllm_generation_checks("auto", target, drafts, 4, [])] == ["skipped"] * 2
    required = vllm_generation_checks("require", target, drafts, 4, [])
    assert [c.status for c in required] == ["fail"] * 2 and "vllm is not installed" in required[0].detail
