"""Pretrain then finetune through the real launcher (`accelerate launch`, one CPU process)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from polydraft.data.prompts import task_prefix, vicuna_prompt
from polydraft.train.drafter import step_loss
from polydraft.train.losses import ce_sum, loss_window, topk_kl_sum
from polydraft.train.steplog import read_log
from tests.drafter_setup import context, run_stage, tiny_recipe, write_tiny_mix
from tests.wandb_log import read_wandb_records


@pytest.fixture(scope="module")
def pf_run(tmp_path_factory, tiny_target_dir):
    """P then F (with the kd loss, the target loaded beside the drafter) for two pairs, as the runner
    would run them (work dirs kept as they are)."""
    root = tmp_path_factory.mktemp("pf")
    distill = write_tiny_mix(root / "distill", ["de-en", "fr-en"])
    recipe = tiny_recipe(tiny_target_dir, finetune={"loss": "kd", "kd_top_k": 8, "loop": {"eval_every": 3}})
    # the pretrain subprocess logs to an offline wandb run (under the run dir)
    pretrain_ctx = context(root, "pretrain", mode="offline")
    pretrain = run_stage("pretrain", recipe, pretrain_ctx, tiny_target_dir)
    finetune_ctx = context(root, "finetune", {"distill": distill, "pretrain": pretrain_ctx.work_dir})
    finetune = run_stage("finetune", recipe, finetune_ctx, tiny_target_dir)
    return {
        "pretrain": (pretrain_ctx.work_dir, pretrain.metrics),
        "finetune": (finetune_ctx.work_dir, finetune.metrics),
    }


def test_pretrain_packs_the_corpus_and_exports_a_drafter(pf_run):
    work_dir, metrics = pf_run["pretrain"]
    drafter = metrics["drafter"]
    assert drafter["steps"] == 6 and drafter["tokens"] == 6 * 4 * 64  # token_budget / (batch x length)
    assert (metrics["distributed_type"], metrics["num_processes"]) == ("NO", 1)
    log = read_log(work_dir / "model.train_log.jsonl")
    assert [e["step"] for e in log] == list(range(1, 7))
    assert all(e["tokens"] == 256 * e["step"] for e in log)  # packed: no padding anywhere
    assert (work_dir / "model" / "model.safetensors").is_file()
    checkpoints = sorted(p.name for p in (work_dir / "model.checkpoints").iterdir())
    assert checkpoints == ["step-00000004", "step-00000006"]  # every 2 steps, the last 2 kept


def test_the_training_subprocess_logs_to_wandb(pf_run):
    work_dir, metrics = pf_run["pretrain"]
    runs = list((work_dir.parent / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1  # one run, from the main process only
    records = read_wandb_records(runs[0])
    history = [
        {i.key or "/".join(i.nested_key): i.value_json for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    logged = [h for h in history if "pretrain/train/loss" in h]
    assert [int(h["_step"]) for h in logged] == list(range(1, 7))
    for key in ("lr", "grad_norm", "tokens_per_s", "tokens"):
        assert all(f"pretrain/train/{key}" in h for h in logged)
    summary = {
        i.key: i.value_json
        for r in records
        if r.WhichOneof("record_type") == "summary"
        for i in r.summary.update
    }
    assert json.loads(summary["drafter"])["train_loss"] == pytest.approx(metrics["drafter"]["train_loss"])


def test_finetune_trains_one_drafter_per_pair_from_the_pretrained_one(pf_run):
    work_dir, metrics = pf_run["finetune"]
    for pair in ("de-en", "fr-en"):
        trained = metrics["pairs"][pair]
        assert trained["steps"] == 6
        assert trained["eval"][pair]["eval_loss"] > 0
        assert 0.0 <= trained["eval"][pair]["top1_agreement"] <= 1.0
        log = read_log(work_dir / f"{pair}.train_log.jsonl")
        assert len(log) == 6 and all(torch.isfinite(torch.tensor(e["loss"])) for e in log)
        assert json.loads((work_dir / f"{pair}.metrics.json").read_text()) == trained
    pretrained = AutoModelForCausalLM.from_pretrained(pf_run["pretrain"][0] / "model")
    finetuned = AutoModelForCausalLM.from_pretrained(work_dir / "de-en")
    assert finetuned.config.to_dict()["hidden_size"] == pretrained.config.hidden_size
    assert not torch.equal(finetuned.model.embed_tokens.weight, pretrained.model.embed_tokens.weight)


def test_finetuned_drafter_works_as_assistant_model_with_the_target(pf_run, tiny_target_dir):
    work_dir, _ = pf_run["finetune"]
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    drafter = AutoModelForCausalLM.from_pretrained(work_dir / "fr-en", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(work_dir / "fr-en")
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(tiny_target_dir).get_vocab()
    prompt = vicuna_prompt([{"role": "user", "content": task_prefix("fr-en") + "Bonjour à tous"}])
    inputs = tokenizer(prompt, return_tensors="pt")
    settings = {"max_new_tokens": 24, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    with torch.no_grad():
        plain = target.generate(**inputs, **settings)
        assisted = target.generate(**inputs, assistant_model=drafter, **settings)
    assert plain.shape[1] > inputs["input_ids"].shape[1]
    assert torch.equal(assisted, plain)


def test_rerun_of_a_finished_finetune_trains_nothing_again(pf_run, tiny_target_dir):
    work_dir, metrics = pf_run["finetune"]
    before = {p: (work_dir / p / "model.safetensors").stat().st_mtime_ns for p in ("de-en", "fr-en")}
    recipe = tiny_recipe(tiny_target_dir, finetune={"loss": "kd", "kd_top_k": 8, "loop": {"eval_every": 3}})
    upstream = {"distill": work_dir.parent / "distill", "pretrain": pf_run["pretrain"][0]}
    ctx = context(work_dir.parent, "finetune", upstream)
    again = run_stage("finetune", recipe, ctx, tiny_target_dir)
    # the same per-pair metrics, and no launch: nothing says how it ran, because nothing ran
    assert again.metrics["pairs"] == metrics["pairs"]
    assert metrics["num_processes"] == 1 and again.metrics["num_processes"] is None
    assert before == {p: (work_dir / p / "model.safetensors").stat().st_mtime_ns for p in ("de-en", "fr-en")}


def test_kd_adds_the_weighted_kl_to_the_targets_top_k(tiny_target, tiny_tokenizer):
    from polydraft.models.drafters import build_drafter
    from polydraft.train.data import collate, encode_texts

    example = encode_texts(tiny_tokenizer, [("USER: Hallo ASSISTANT:", " Hello there")], 64)[0]
    batch = collate([example], tiny_tokenizer.pad_token_id)
    drafter = build_drafter(
        "custom", len(tiny_tokenizer), bos_token_id=1, eos_token_id=2, pad_token_id=3,
        hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
    )  # fmt: skip
    ce = step_loss(drafter, batch, None, 8, 0.5)
    with_kd = step_loss(drafter, batch, tiny_target, 8, 0.5)
    logits = drafter(input_ids=batch["input_ids"]).logits
    kl = topk_kl_sum(logits, tiny_target(input_ids=batch["input_ids"]).logits, batch["labels"], 8)
    assert kl > 0
    torch.testing.assert_close(with_kd, ce + 0.5 * kl)
    # a drafter identical to the target has nothing left to learn from it
    torch.testing.assert_close(
        step_loss(tiny_target, batch, tiny_target, 8, 0.5), step_loss(tiny_target, batch, None, 8, 0.5)
    )


def test_the_head_runs_from_the_first_response_token_and_the_loss_is_that_of_all_logits(tiny_tokenizer):
    from polydraft.models.drafters import build_drafter
    from polydraft.train.data import collate, encode_texts

    pairs = [
        ("USER: Hallo Welt, wie geht es dir heute? ASSISTANT:", " Hello world"),
        ("USER: Ja ASSISTANT:", " Yes"),
    ]
    batch = collate(encode_texts(tiny_tokenizer, pairs, 64), tiny_tokenizer.pad_token_id)
    short_prompt = int((batch["labels"][1] != -100).nonzero()[0, 0])
    # the shorter prompt's first response token is predicted by the position before it
    assert loss_window(batch["labels"]) == short_prompt - 1
    assert loss_window(torch.full((2, 5), -100)) == 4
    drafter = build_drafter(
        "custom", len(tiny_tokenizer), bos_token_id=1, eos_token_id=2, pad_token_id=3,
        hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
    )  # fmt: skip
    windowed = step_loss(drafter, batch, None, 8, 0.0)
    (windowed_grad,) = torch.autograd.grad(windowed, drafter.lm_head.weight)
    full = ce_sum(
        drafter(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits, batch["labels"]
    )[0]
    (full_grad,) = torch.autograd.grad(full, drafter.lm_head.weight)
    torch.testing.assert_close(windowed, full)
    torch.testing.assert_close(windowed_grad, full_grad)
