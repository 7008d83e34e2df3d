"""The EAGLE-3 trainer and stage: the training-time test's masks and rows, what trains, the draft vocabulary,
the speculators folder it writes, the loss it logs, and resume after kill -9."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from polydraft.models.eagle3 import load_eagle3, read_info
from polydraft.pipelines.runtime.contract import PROJECT_ROOT, spec_for
from polydraft.pipelines.runtime.tracking import Tracker
from polydraft.pipelines.stages.eagle3 import train_heads
from polydraft.train.chunked_loss import OutputHead
from polydraft.train.eagle3 import restricted_kl, step_rows, ttt_mask
from polydraft.train.losses import IGNORE_INDEX
from polydraft.train.runtime import make_accelerator
from tests.drafter_setup import context, stage_inputs, tiny_recipe, write_tiny_mix
from tests.resume_check import run_killed_at

X = IGNORE_INDEX
LOOP = {"per_device_batch_size": 4, "grad_accum_steps": 2, "max_length": 96, "log_every": 1, "eval_every": 0,
        "eval_batches": 2, "checkpoint_every": 2, "loss_chunk_tokens": 16}  # fmt: skip
BLOCK = {"enabled": True, "aux_layers": [1, 2, 3], "draft_vocab_size": 300, "ttt_steps": 3,
         "optim": {"lr": 3e-3}, "loop": LOOP}  # fmt: skip


def test_step_j_attends_to_the_committed_prefix_and_its_own_earlier_steps_at_the_same_position():
    allowed = ttt_mask(torch.arange(3).view(1, 3), 3, 2, torch.float32)[0, 0] == 0
    assert allowed.tolist() == [
        [True, False, False, True, False, False, True, False, False],
        [True, True, False, False, True, False, False, True, False],
        [True, True, True, False, False, True, False, False, True],
    ]
    # queries at positions 1 and 3 only: step 0's keys up to each, then each slot's own
    allowed = ttt_mask(torch.tensor([[1, 3]]), 4, 1, torch.float32)[0, 0] == 0
    assert allowed.tolist() == [
        [True, True, False, False, True, False],
        [True, True, True, True, False, True],
    ]


def test_later_steps_only_where_they_train_give_the_outputs_and_gradients_of_every_position():
    """Steps 1 and 2 run packed at the positions some later step trains (rows of different lengths and
    answers): the per-step outputs and every gradient equal those of the three steps run at every position
    with the full mask (written out here)."""
    from transformers import DynamicCache, LlamaConfig

    from polydraft.models.eagle3 import Eagle3Head, layer_config
    from polydraft.train.eagle3 import Unroll

    torch.manual_seed(0)
    target = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                         num_hidden_layers=3, max_position_embeddings=64)  # fmt: skip
    head = Eagle3Head(layer_config(target, None), 16, [0, 1, 2], torch.arange(0, 50, 2))
    features, embeds = torch.randn(2, 12, 48), torch.randn(2, 12, 16)
    labels = torch.full((2, 12), X)
    labels[0, 5:10], labels[1, 8:12] = 1, 1  # answers at 5..9 and 8..11; row 0 padded after 9
    rows = [step_rows(labels, j) for j in range(3)]

    def every_position() -> list[torch.Tensor]:
        hidden, cache, out = head.project(features), DynamicCache(), []
        for j in range(3):
            tokens = torch.cat([embeds[:, j + 1 :], embeds.new_zeros(2, j + 1, 16)], 1)
            blocks = [torch.ones(12, 12, dtype=torch.bool).tril()] + [torch.eye(12, dtype=torch.bool)] * j
            mask = torch.zeros(12, 12 * (j + 1)).masked_fill_(
                ~torch.cat(blocks, 1), torch.finfo(torch.float32).min
            )
            hidden = head(
                tokens, hidden, torch.arange(j, j + 12).expand(2, -1), mask.view(1, 1, 12, -1), cache
            )
            out.append(head.lm_head(head.normed(hidden[rows[j]])))
        return out

    def outputs_and_grads(run) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        head.zero_grad()
        out = run()
        sum((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in out).backward()
        return [o.detach() for o in out], [p.grad.clone() for p in head.parameters()]

    packed, packed_grads = outputs_and_grads(lambda: Unroll(head, 3)(features, embeds, rows, project=True))
    full, full_grads = outputs_and_grads(every_position)
    assert [o.shape[0] for o in packed] == [int(r.sum()) for r in rows] == [9, 9, 9]
    for a, b in zip(packed, full, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(packed_grads, full_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # a batch whose answers leave the later steps nothing to train: they still run, on one empty slot a row
    labels = torch.full((2, 12), X)
    labels[:, 2] = 1
    out = Unroll(head, 3)(features, embeds, [step_rows(labels, j) for j in range(3)], project=True)
    assert [o.shape[0] for o in out] == [2, 0, 0]
    sum(o.sum() for o in out).backward()


def test_step_j_at_i_learns_the_target_at_i_plus_j_plus_1_where_token_i_plus_j_plus_2_is_an_answer():
    labels = torch.tensor([[X, X, 10, 11, 12, 13, X]])  # the answer: positions 2..5, then padding
    assert step_rows(labels, 0)[0].tolist() == [True, True, True, True, False, False, False]
    assert step_rows(labels, 1)[0].tolist() == [True, True, True, False, False, False, False]
    assert step_rows(labels, 4)[0].tolist() == [False] * 7


def job(tmp_path, target_dir, distill, name, **changes):
    block = {**BLOCK, **changes, "loop": {**LOOP, **changes.get("loop", {})}}
    inputs = stage_inputs("eagle3", tiny_recipe(target_dir, eagle3=block), target_dir)
    spec = spec_for(inputs, context(tmp_path / name, "eagle3", {"distill": distill}))
    return spec, inputs


def train(spec, inputs):
    accelerator = make_accelerator(inputs.eagle3.loop.grad_accum_steps, "no")
    return train_heads(spec, inputs, accelerator, Tracker(None, "eagle3"))


def test_a_head_per_pair_and_a_multilingual_one_in_the_speculators_format(
    tmp_path, tiny_target_dir, tiny_target
):
    distill = write_tiny_mix(tmp_path / "distill", ["de-en", "fr-en"], train_rows=16, eval_rows=4)
    spec, inputs = job(tmp_path, tiny_target_dir, distill, "run", multilingual=True, loop={"max_steps": 4})
    before = {k: v.clone() for k, v in tiny_target.state_dict().items()}
    result = train(spec, inputs)
    assert result["aux_layers"] == [1, 2, 3]
    work_dir = Path(spec.work_dir)
    for name in ("de-en", "fr-en", "multilingual"):
        folder = work_dir / name
        config = json.loads((folder / "config.json").read_text())
        assert config["speculators_model_type"] == "eagle3"
        assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
        assert config["norm_before_residual"] is False and config["draft_vocab_size"] == 300
        assert config["speculators_config"]["verifier"]["name_or_path"] == str(tiny_target_dir)
        head = load_eagle3(folder)
        assert head.draft_ids.tolist() == sorted(set(head.draft_ids.tolist()))
        info = read_info(folder)
        metrics = json.loads((work_dir / f"{name}.metrics.json").read_text())
        assert info["pair"] == name and metrics["steps"] == 4 and info["training"] == metrics
        vocab = metrics["vocab"]
        assert vocab["size"] == 300 and 0.0 < vocab["coverage_heldout"] <= 1.0
        # training moved the layer away from its random start and lowered the held-out KL
        assert metrics["final"]["eval_loss"] < metrics["initial"]["eval_loss"]
        assert len(metrics["final"]["steps"]) == 3
        assert not (work_dir / f"{name}.checkpoints").exists()
    # the draft vocabularies differ by language: each pair's own most frequent answer tokens
    de, fr = (set(load_eagle3(work_dir / p).draft_ids.tolist()) for p in ("de-en", "fr-en"))
    assert de != fr
    for key, value in tiny_target.state_dict().items():  # the target is frozen
        assert torch.equal(value, before[key]), key


def test_killed_run_resumes_with_the_same_losses(tmp_path, tiny_target_dir):
    distill = write_tiny_mix(tmp_path / "distill", ["de-en", "fr-en"], train_rows=16, eval_rows=4)
    changes = {"loop": {"max_steps": 6}}
    spec, inputs = job(tmp_path, tiny_target_dir, distill, "whole", **changes)
    train(spec, inputs)
    log_name = "de-en.train_log.jsonl"
    expected = [
        json.loads(line)["loss"] for line in (Path(spec.work_dir) / log_name).read_text().splitlines()
    ]

    spec, inputs = job(tmp_path, tiny_target_dir, distill, "killed", **changes)
    killed = Path(spec.work_dir)
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "ACCELERATE_USE_CPU": "true"}
    command = [
        sys.executable,
        "-m",
        "polydraft.pipelines.stages.eagle3",
        str(spec.write(killed / "spec.json")),
    ]
    step = run_killed_at(command, env, 3, killed / "de-en.checkpoints", killed / log_name)
    assert step == 2 and not (killed / "de-en").exists()

    train(spec, inputs)
    got = [json.loads(line)["loss"] for line in (killed / log_name).read_text().splitlines()]
    assert got == pytest.approx(expected, rel=1e-5)
    assert (killed / "de-en" / "model.safetensors").is_file()


def test_the_feature_cache_runs_the_target_once_per_row_and_trains_the_same_heads(
    tmp_path, tiny_target_dir, monkeypatch
):
    import polydraft.train.eagle3 as trainer

    distill = write_tiny_mix(tmp_path / "distill", ["de-en", "fr-en"], train_rows=16, eval_rows=4)
    passes = {"rows": 0}
    computed = trainer.target_pass

    def counted(target, batch, aux_layers):
        passes["rows"] += batch["input_ids"].shape[0]
        return computed(target, batch, aux_layers)

    monkeypatch.setattr(trainer, "target_pass", counted)
    finals, losses, rows = {}, {}, {}
    for gib in (0.0, 1.0):
        name = f"cache{gib:g}"
        spec, inputs = job(
            tmp_path, tiny_target_dir, distill, name, multilingual=True, feature_cache_gib=gib,
            loop={"max_steps": 4},
        )  # fmt: skip
        passes["rows"] = 0
        train(spec, inputs)
        rows[gib] = passes["rows"]
        finals[gib] = {
            head: json.loads((Path(spec.work_dir) / f"{head}.metrics.json").read_text())["final"]
            for head in ("de-en", "fr-en", "multilingual")
        }
        log = (Path(spec.work_dir) / "multilingual.train_log.jsonl").read_text().splitlines()
        losses[gib] = [json.loads(line)["loss"] for line in log]
    # every pair head saw each of its rows: the multilingual head (4 steps of 8 rows) and its evaluations
    # read them all from the cache, so the target ran on at least 32 + 2 x 8 fewer rows
    assert rows[1.0] <= rows[0.0] - 48
    assert losses[1.0] == pytest.approx(losses[0.0], rel=1e-5)
    for head, final in finals[0.0].items():
        cached = finals[1.0][head]
        assert cached["eval_loss"] == pytest.approx(final["eval_loss"], rel=1e-5), head
        for step, step_cached in zip(final["steps"], cached["steps"], strict=True):
            assert step_cached["top1"] == pytest.approx(step["top1"], abs=1e-6), head


def test_the_fill_runs_the_tokens_every_row_starts_with_once_and_keeps_each_rows_own_pass(tiny_target):
    """Rows of different lengths that start with the same 7 tokens (a system prompt): the target runs those
    7 once, and every row's kept features and final states are those of a pass over the row alone."""
    from polydraft.train.eagle3 import FeatureCache, target_pass

    torch.manual_seed(0)
    head = torch.randint(5, 300, (7,)).tolist()
    rows = [head + torch.randint(5, 300, (n,)).tolist() for n in (3, 9, 1, 14, 6, 5, 11, 2, 8, 4)]
    calls = []
    hook = tiny_target.model.layers[0].register_forward_hook(lambda m, a, out: calls.append(a[0].shape[:2]))
    cache = FeatureCache(2**30)
    try:
        cache.fill(tiny_target, [{"input_ids": r} for r in rows], [1, 2, 3], 0, torch.device("cpu"))
    finally:
        hook.remove()
    assert calls[0] == (1, 7), "the shared tokens first, alone"
    assert sum(b * t for b, t in calls[1:]) < sum(len(r) for r in rows), "then only what follows them"
    assert all(t <= 14 for _, t in calls[1:])
    for row in rows:
        ids = torch.tensor([row])
        features, last, _ = target_pass(
            tiny_target, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, [1, 2, 3]
        )
        kept_features, kept_last = cache.rows[ids[0].numpy().tobytes()]
        torch.testing.assert_close(kept_features, features[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(kept_last, last[0], rtol=1e-4, atol=1e-5)


def test_the_loss_is_the_kl_from_the_target_restricted_to_the_draft_vocabulary_chunked_or_not():
    """KL(p || q), p the target's softmax over the draft vocabulary's logits, on the rows whose target argmax
    is a draft token: as `F.kl_div` computes it, with its gradient, projected at once or 7 rows at a time."""
    torch.manual_seed(0)
    rows, hidden, vocab = 30, 8, 50
    draft_ids = torch.arange(0, 40, 2)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    teacher = OutputHead(torch.randn(vocab, hidden))
    teacher_rows = torch.randn(rows, hidden)
    states = torch.randn(rows, hidden)
    weight = torch.randn(len(draft_ids), hidden, requires_grad=True)
    logits = teacher.logits(teacher_rows)
    inside = t2d[logits.argmax(-1)]
    assert 0 < inside.sum() < rows  # some rows count, some do not
    p = F.softmax(logits[:, draft_ids], dim=-1)
    log_q = F.log_softmax(states @ weight.T, dim=-1)
    expected = F.kl_div(log_q, p, reduction="none").sum(-1)[inside].sum()
    (expected_grad,) = torch.autograd.grad(expected, weight)
    hits = (draft_ids[log_q.argmax(-1)] == logits.argmax(-1)).sum()
    for projected, chunk in ((states @ weight.T, None), (states, 7)):
        total, stats = restricted_kl(
            projected, teacher_rows, None if chunk is None else weight, teacher, draft_ids, t2d, chunk
        )
        (grad,) = torch.autograd.grad(total, weight)
        assert torch.allclose(total, expected, rtol=1e-5), (chunk, float(total), float(expected))
        assert torch.allclose(grad, expected_grad, rtol=1e-4, atol=1e-6)
        assert stats.tolist() == [float(inside.sum()), float(hits), float(rows)]
