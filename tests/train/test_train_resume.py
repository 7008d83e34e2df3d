"""Drafter training (pretrain, finetune) killed with SIGKILL mid-run and rerun resumes: the same later
losses and the same final weights, bit for bit, as a run never interrupted, and the steps before the
checkpoint are not trained again (tests/resume_check.py); a NaN loss stops the run cleanly."""

from __future__ import annotations

import pytest

from polydraft.pipelines.runtime.contract import StageFailed
from polydraft.train.checkpoint import list_checkpoints, read_state
from tests.drafter_setup import context, run_stage, tiny_recipe, write_tiny_mix
from tests.resume_check import assert_resumed, assert_same_weights, killed_then_resumed

STEPS = 16  # per pair; the kill comes right after step 12 (checkpoints every 10 or 5: steps are redone)


def assert_kill_resumes(stage: str, recipe, ctx, whole, target_dir, name: str) -> None:
    """Stage `stage`, killed right after step 12 of its model `name` (checkpoints and step log beside the
    output folder, `train.loop.TrainJob.beside`) and rerun, resumes from its last checkpoint and logs the
    same steps as the uninterrupted run in `whole`."""
    work, log = ctx.work_dir, f"{name}.train_log.jsonl"
    step, checkpoint = killed_then_resumed(
        stage, recipe, ctx, target_dir, 12, work / f"{name}.checkpoints", work / log, work / name
    )
    assert 0 < step < STEPS
    assert_resumed(work / log, work / f"{stage}.log", checkpoint, step, whole.work_dir / log)


def test_killed_pretraining_resumes_like_an_uninterrupted_run(tmp_path, tiny_target_dir):
    recipe = tiny_recipe(
        tiny_target_dir, pretrain={"loop": {"max_steps": STEPS, "checkpoint_every": 10, "log_every": 50}}
    )
    whole = context(tmp_path / "whole", "pretrain")
    assert run_stage("pretrain", recipe, whole, tiny_target_dir).metrics["drafter"]["steps"] == STEPS
    ctx = context(tmp_path / "killed", "pretrain")
    assert_kill_resumes("pretrain", recipe, ctx, whole, tiny_target_dir, "model")
    assert_same_weights(
        ctx.work_dir / "model" / "model.safetensors", whole.work_dir / "model" / "model.safetensors"
    )


def test_killed_finetuning_resumes_like_an_uninterrupted_run(tmp_path, tiny_target_dir):
    """Killed while training its first pair: that pair resumes, the second trains after it."""
    distill = write_tiny_mix(tmp_path / "distill", ["de-en", "fr-en"], train_rows=24, eval_rows=4)
    recipe = tiny_recipe(
        tiny_target_dir,
        pretrain={"enabled": False},
        finetune={"loop": {"max_steps": STEPS, "checkpoint_every": 5, "per_device_batch_size": 2}},
    )
    whole = context(tmp_path / "whole", "finetune", {"distill": distill})
    run_stage("finetune", recipe, whole, tiny_target_dir)
    ctx = context(tmp_path / "killed", "finetune", {"distill": distill})
    assert_kill_resumes("finetune", recipe, ctx, whole, tiny_target_dir, "de-en")
    for pair in ("de-en", "fr-en"):
        weights = f"{pair}/model.safetensors"
        assert_same_weights(ctx.work_dir / weights, whole.work_dir / weights)


def test_a_nan_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path, tiny_target_dir):
    # an absurd learning rate: step 1 is fine, its update overflows the weights, step 2's loss is NaN
    recipe = tiny_recipe(
        tiny_target_dir,
        pretrain={
            "optim": {"lr": 1e30, "max_grad_norm": 0.0, "weight_decay": 0.0},
            "loop": {"max_steps": 6, "checkpoint_every": 1},
        },
    )
    ctx = context(tmp_path, "pretrain")
    with pytest.raises(
        StageFailed, match=r"loss is nan at step 2; the last good checkpoint is kept at .*step-00000001"
    ):
        run_stage("pretrain", recipe, ctx, tiny_target_dir)
    kept = list_checkpoints(ctx.work_dir / "model.checkpoints")
    assert [p.name for p in kept] == ["step-00000001"]
    assert read_state(kept[0])["step"] == 1 and (kept[0] / "model.safetensors").is_file()
    assert not (ctx.work_dir / "model").exists() and not (ctx.work_dir / "metrics.json").exists()
